"""Loading a kernel pack: check it fits the running torch, unpack it once into a cache, put it on ``sys.path``.

The unpacked pack is a directory ``CACHE/<key>/`` holding ``site/`` (vLLM's tree, its dist-info, the two CUDA
libraries and the extra wheels' files, as ``pip install --target`` would lay them out) and ``aliases/``, which
holds one link ``triton_kernels → ../site/vllm/third_party/triton_kernels``: the vendored triton_kernels imports
itself by its top-level name, and vLLM prefers a top-level ``triton_kernels`` when one is importable, so both routes
reach the same modules. ``key`` is derived from the archives' sha256, so a changed pack never reuses a stale
cache. ``CACHE`` is ``$MOEREPLAY_PACK_CACHE`` or ``$XDG_CACHE_HOME/moereplay/packs`` (``~/.cache/…``).

Cost: the first load of a pack verifies 53 MB of archives (sha256, < 1 s) and unpacks ≈ 190 MB (≈ 3 s); later
loads only read the manifest. Importing ``vllm._custom_ops`` then takes a few seconds (vLLM's own start-up).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from moereplay.errors import PackError
from moereplay.pack.archive import extract_tar_xz
from moereplay.pack.manifest import DEPS_ARCHIVE, TREE_ARCHIVE, PackManifest, read_manifest

COMPLETE_MARK = ".complete"
TRITON_KERNELS_DIR = "vllm/third_party/triton_kernels"


def default_cache_dir() -> Path:
    """Where packs are unpacked, from the environment at call time (never at import)."""
    explicit = os.environ.get("MOEREPLAY_PACK_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moereplay" / "packs"


def _release(version: str) -> str:
    """``2.11.0+cu130`` → ``2.11.0`` (the public part of a PEP 440 version)."""
    return version.split("+", 1)[0].strip()


def check_torch(manifest: PackManifest, torch_version: str, torch_cuda: str | None) -> None:
    """Refuse a pack whose libraries cannot load against this torch: another release, or another CUDA major."""
    if _release(torch_version) != _release(manifest.torch_pin):
        raise PackError(
            f"kernel pack for vLLM {manifest.vllm_version} needs torch {manifest.torch_pin}, "
            f"but torch {torch_version} is running"
        )
    if manifest.cuda_major is None:
        return
    if not torch_cuda:
        raise PackError(
            f"kernel pack for vLLM {manifest.vllm_version} needs a CUDA {manifest.cuda_major} build of torch, "
            f"but torch {torch_version} has no CUDA"
        )
    major = torch_cuda.split(".", 1)[0]
    if major != str(manifest.cuda_major):
        raise PackError(
            f"kernel pack for vLLM {manifest.vllm_version} needs CUDA {manifest.cuda_major}, "
            f"but torch {torch_version} is built for CUDA {torch_cuda}"
        )


def check_python(manifest: PackManifest, version: tuple[int, int]) -> None:
    """Refuse a pack whose compiled extra wheels (``cp312`` …) cannot load in this Python."""
    running = f"{version[0]}.{version[1]}"
    for wheel in manifest.extra_wheels:
        if wheel.abi == "none" or not wheel.python.startswith("cp3"):
            continue
        tag_minor = int(wheel.python[3:])
        if (wheel.abi == "abi3" and version[1] < tag_minor) or (
            wheel.abi != "abi3" and version[1] != tag_minor
        ):
            raise PackError(
                f"kernel pack's wheel {wheel.file} is built for CPython 3.{tag_minor}, but Python {running} is running"
            )


def verify_files(directory: Path, manifest: PackManifest) -> None:
    """Check each archive's size and sha256 against the manifest."""
    for digest in manifest.files:
        path = directory / digest.name
        if not path.is_file():
            raise PackError(f"kernel pack {directory} lacks {digest.name}")
        if path.stat().st_size != digest.size:
            raise PackError(f"{path} has {path.stat().st_size} bytes, the manifest says {digest.size}")
        hasher = hashlib.sha256()
        with open(path, "rb") as stream:
            while chunk := stream.read(1 << 22):
                hasher.update(chunk)
        if hasher.hexdigest() != digest.sha256:
            raise PackError(f"{path} does not match its sha256 in the manifest (damaged or replaced)")


@dataclass(frozen=True)
class UnpackedPack:
    """Where a pack lies unpacked. ``paths`` go on ``sys.path`` / ``PYTHONPATH``, in this order."""

    manifest: PackManifest
    root: Path

    @property
    def site(self) -> Path:
        return self.root / "site"

    @property
    def aliases(self) -> Path:
        return self.root / "aliases"

    @property
    def paths(self) -> tuple[Path, Path]:
        return (self.site, self.aliases)


def cache_key(manifest: PackManifest) -> str:
    """A directory name unique to the pack's contents."""
    hashes = "".join(digest.sha256[:12] for digest in manifest.files)
    return f"vllm-{manifest.vllm_version}-{manifest.arch or 'all'}-{hashes}"


def unpack_pack(directory: Path, cache_dir: Path | None = None) -> UnpackedPack:
    """Unpack a pack into the cache unless it already is there; needs no torch. Safe against concurrent callers:
    each unpacks into its own temporary directory and the first to rename it into place wins."""
    manifest = read_manifest(directory)
    root = (cache_dir or default_cache_dir()) / cache_key(manifest)
    unpacked = UnpackedPack(manifest=manifest, root=root)
    if (root / COMPLETE_MARK).is_file():
        return unpacked
    verify_files(directory, manifest)
    for required in (TREE_ARCHIVE, DEPS_ARCHIVE):
        if manifest.file(required) is None:
            raise PackError(f"kernel pack manifest lists no {required}")
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = root.parent / f".{root.name}.{os.getpid()}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        for archive in (TREE_ARCHIVE, DEPS_ARCHIVE):
            extract_tar_xz(directory / archive, staging / "site")
        if not (staging / "site" / TRITON_KERNELS_DIR).is_dir():
            raise PackError(f"kernel pack {directory} has no {TRITON_KERNELS_DIR}")
        (staging / "aliases").mkdir()
        (staging / "aliases" / "triton_kernels").symlink_to(Path("..", "site", TRITON_KERNELS_DIR))
        (staging / COMPLETE_MARK).write_text(manifest.to_json(), encoding="utf-8")
        if root.exists():
            shutil.rmtree(root)  # an unfinished earlier unpack (no COMPLETE_MARK)
        try:
            staging.rename(root)
        except OSError:
            if not (root / COMPLETE_MARK).is_file():
                raise
    except OSError as error:
        raise PackError(f"cannot unpack kernel pack into {root}: {error}") from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return unpacked


@dataclass(frozen=True)
class LoadedPack:
    """A pack on ``sys.path``: import vLLM's modules and the vendored triton_kernels from it."""

    directory: Path
    unpacked: UnpackedPack

    @property
    def manifest(self) -> PackManifest:
        return self.unpacked.manifest

    def import_module(self, name: str) -> ModuleType:
        """Import ``name`` and check that a vLLM or triton_kernels module really comes from this pack."""
        try:
            module = importlib.import_module(name)
        except ImportError as error:
            raise PackError(f"cannot import {name} from kernel pack {self.directory}: {error}") from error
        top = name.split(".", 1)[0]
        if top in ("vllm", "triton_kernels"):
            origin = Path(getattr(module, "__file__", "") or "").resolve()
            if self.unpacked.site.resolve() not in origin.parents:
                raise PackError(f"{name} was imported from {origin}, not from kernel pack {self.directory}")
        return module

    @property
    def custom_ops(self) -> ModuleType:
        """``vllm._custom_ops``: loads both CUDA libraries and registers ``torch.ops._C`` / ``torch.ops._moe_C``."""
        return self.import_module("vllm._custom_ops")

    @property
    def triton_kernels(self) -> ModuleType:
        """The vendored ``triton_kernels`` package, by its top-level name (no vLLM import needed)."""
        return self.import_module("triton_kernels")


def activate(unpacked: UnpackedPack) -> None:
    """Put the pack's paths first on ``sys.path``; refuse if another vLLM or triton_kernels is already imported."""
    for top in ("vllm", "triton_kernels"):
        module = sys.modules.get(top)
        if module is None:
            continue
        origin = Path(getattr(module, "__file__", "") or "").resolve()
        if unpacked.site.resolve() not in origin.parents:
            raise PackError(
                f"{top} is already imported from {origin}; load the kernel pack in a fresh process"
            )
    for path in reversed(unpacked.paths):
        text = str(path)
        if text in sys.path:
            sys.path.remove(text)
        sys.path.insert(0, text)
    importlib.invalidate_caches()


def load_pack(directory: Path | str, cache_dir: Path | None = None) -> LoadedPack:
    """Check a pack against the running Python and torch, unpack it if needed and put it on ``sys.path``."""
    path = Path(directory)
    manifest = read_manifest(path)
    check_python(manifest, (sys.version_info[0], sys.version_info[1]))
    import torch

    check_torch(manifest, torch.__version__, torch.version.cuda)
    unpacked = unpack_pack(path, cache_dir)
    activate(unpacked)
    return LoadedPack(directory=path, unpacked=unpacked)
