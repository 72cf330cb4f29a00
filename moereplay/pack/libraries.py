"""vLLM's compiled CUDA libraries in a pack: which ones, the CUDA they link, and slimming to one GPU arch.

Both kernels-pack libraries are needed (see shared/kernels/README.md): ``_moe_C`` holds the Marlin MoE GEMM and
``moe_align_block_size``; ``_C`` holds the activations and repacking ops vLLM's MoE Python paths call, and vLLM
imports it as soon as it detects a CUDA platform. Cost: slimming reads and rewrites each library once in memory
(76 MB + 46 MB for vLLM 0.25.1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moereplay.errors import PackError
from moereplay.pack.elf import needed_libraries, parse_elf
from moereplay.pack.fatbin import SlimResult, slim_fatbin, walk_fatbin

#: The wheel members a kernels pack takes, in the order they are reported.
LIBRARY_MEMBERS: tuple[str, ...] = (
    "vllm/_moe_C_stable_libtorch.abi3.so",
    "vllm/_C_stable_libtorch.abi3.so",
)
#: The wheel members a serve pack takes: FlashAttention 3 (Hopper). vLLM's model modules import
#: ``vllm.vllm_flash_attn`` at import time, which raises unless ``_vllm_fa2_C`` or ``_vllm_fa3_C`` imports; in
#: vllm-0.25.1 it is 153 MB of sm_90a cubins only (nothing to slim for sm_90), ≈ 10 MB with xz. ``_vllm_fa2_C``
#: (191 MB, Ampere and up) is not taken: on Hopper vLLM uses FA3.
SERVE_LIBRARY_MEMBERS: tuple[str, ...] = ("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",)
FATBIN_SECTION = ".nv_fatbin"
_CUDART = re.compile(r"^libcudart\.so\.(\d+)$")


@dataclass(frozen=True)
class LibrarySlimReport:
    """What slimming did to one library. ``slim`` is None when the library was taken whole."""

    member: str
    size: int
    cuda_major: int | None
    slim: SlimResult | None


def cuda_major(data: bytes | bytearray) -> int | None:
    """The CUDA runtime major version a library links (``libcudart.so.13`` → 13), or None if it links none."""
    for name in needed_libraries(data):
        match = _CUDART.match(name)
        if match:
            return int(match.group(1))
    return None


def slim_library(
    member: str, data: bytes | bytearray, keep_arch: int | None
) -> tuple[bytes, LibrarySlimReport]:
    """Return the library's bytes with every fatbin entry useless on ``keep_arch`` zeroed (None: unchanged).

    The result has exactly the input's length and layout; only payload bytes of dropped entries differ.
    """
    elf = parse_elf(data)
    major = cuda_major(data)
    if keep_arch is None:
        return bytes(data), LibrarySlimReport(member=member, size=len(data), cuda_major=major, slim=None)
    section = elf.section(FATBIN_SECTION)
    if section is None:
        raise PackError(f"{member} has no {FATBIN_SECTION} section: nothing to slim")
    buffer = bytearray(data)
    result = slim_fatbin(buffer, keep_arch, section.offset, section.end)
    if len(buffer) != len(data):  # pragma: no cover - slim_fatbin never resizes
        raise PackError(f"slimming changed the size of {member}")
    return bytes(buffer), LibrarySlimReport(member=member, size=len(buffer), cuda_major=major, slim=result)


def fatbin_inventory(data: bytes | bytearray) -> dict[tuple[str, int], int]:
    """Count the fatbin entries of a library by (kind, arch); for reports and tests."""
    elf = parse_elf(data)
    section = elf.section(FATBIN_SECTION)
    if section is None:
        return {}
    counts: dict[tuple[str, int], int] = {}
    for entry in walk_fatbin(data, section.offset, section.end):
        key = (entry.kind_name, entry.arch)
        counts[key] = counts.get(key, 0) + 1
    return counts
