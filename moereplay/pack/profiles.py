"""The kinds of pack one vLLM wheel gives, as data: what each takes from the wheel and which wheels it adds.

- ``kernels`` (conventionally ``.kernelpack``): vLLM's Python tree and dist-info, ``_C`` and ``_moe_C`` slimmed to one
  GPU architecture, and the wheels ``import vllm._custom_ops`` and the fused-MoE modules need (plus moereplay's own
  runtime needs). Enough to call vLLM's MoE kernels and to replay captures; ≈ 39 MB for vLLM 0.25.1 on sm_90.
- ``serve`` (conventionally ``.servepack``): what ``vllm serve`` needs on the GPU machine beyond a kernels pack and
  the machine's own packages: the FlashAttention-3 library (vLLM's model modules import ``vllm.vllm_flash_attn``
  at import time) and the serving wheels (FastAPI, uvicorn, pybase64, blake3, …). It holds no Python tree of its
  own and is only ever loaded beside the kernels pack built from the same vLLM wheel.

Both are built by :func:`moereplay.pack.build.build_pack` into the same layout (``tree.tar.xz``, ``deps.tar.xz``,
``manifest.json``) and the manifest names the profile.
"""

from __future__ import annotations

from dataclasses import dataclass

from moereplay.errors import PackError
from moereplay.pack.download import (
    MOEREPLAY_RUNTIME_REQUIREMENTS,
    VLLM_IMPORT_REQUIREMENTS,
    VLLM_SERVE_REQUIREMENTS,
)
from moereplay.pack.libraries import LIBRARY_MEMBERS, SERVE_LIBRARY_MEMBERS
from moereplay.pack.manifest import PROFILE_NAMES, ProfileName, WheelPurpose


@dataclass(frozen=True)
class PackProfile:
    """What one kind of pack holds.

    ``python_tree``: whether the pack takes vLLM's ``*.py`` tree, configs and dist-info (only the kernels pack
    does: a serve pack's library lands inside the kernels pack's tree). ``libraries``: wheel members, slimmed to
    the pack's arch. ``requirements``: exact pins (``name==version``) fetched as cp312 manylinux wheels, each with
    the purpose the manifest records. ``default_output``: the directory name the tools look for by default.
    """

    name: ProfileName
    python_tree: bool
    libraries: tuple[str, ...]
    requirements: tuple[tuple[str, WheelPurpose], ...]
    default_output: str

    def __post_init__(self) -> None:
        if not self.libraries:
            raise PackError(f"pack profile {self.name} takes no library")


PROFILES: dict[ProfileName, PackProfile] = {
    "kernels": PackProfile(
        name="kernels",
        python_tree=True,
        libraries=LIBRARY_MEMBERS,
        requirements=tuple((pin, "vllm-import") for pin in VLLM_IMPORT_REQUIREMENTS)
        + tuple((pin, "moereplay-runtime") for pin in MOEREPLAY_RUNTIME_REQUIREMENTS),
        default_output=".kernelpack",
    ),
    "serve": PackProfile(
        name="serve",
        python_tree=False,
        libraries=SERVE_LIBRARY_MEMBERS,
        requirements=tuple((pin, "vllm-serve") for pin in VLLM_SERVE_REQUIREMENTS),
        default_output=".servepack",
    ),
}


def pack_profile(name: str) -> PackProfile:
    """The profile called ``name``; PackError naming the known ones otherwise."""
    if name not in PROFILES:
        raise PackError(f"pack profile {name!r} is unknown (expected one of {', '.join(PROFILE_NAMES)})")
    return PROFILES[name]
