"""Loading a kernel pack: check it fits the running torch, unpack it once into a cache, put it on ``sys.path``.

The unpacked pack is a directory ``CACHE/<key>/`` holding ``site/`` (vLLM's tree, its dist-info, the two CUDA
libraries and the extra wheels' files, as ``pip install --target`` would lay them out) and ``aliases/``, which
holds one link per package the families declare vendored in vLLM's tree (``FamilySurface.vendored``; e.g.
``triton_kernels → ../site/vllm/third_party/triton_kernels``): a vendored library imports itself by its top-level
name, and vLLM prefers a top-level copy when one is importable, so both routes reach the same modules. ``key`` is derived from the archives' sha256, so a changed pack never reuses a stale
cache. ``CACHE`` is ``$MOEREPLAY_PACK_CACHE`` or ``$XDG_CACHE_HOME/moereplay/packs`` (``~/.cache/…``).

A serve pack (profile ``serve``, built from the same vLLM wheel) is attached to an unpacked kernels pack: it
unpacks into ``CACHE/<key>/serve-<serve key>/`` (``site/``: the serving wheels and the FlashAttention-3 library;
``bin/vllm``: a stand-in for vLLM's console script), and each of its libraries is linked into the kernels pack's
tree at its wheel path (``site/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so``), because vLLM imports it relatively,
from the package directory. The kernels pack's ``site/`` is thus the same directory with or without a serve pack,
and a process that imported vLLM from it can still load the pack.

Cost: the first load of a pack verifies 39 MB of archives (sha256, < 1 s) and unpacks ≈ 190 MB (≈ 3 s), a serve
pack 12.5 MB and ≈ 225 MB more; later loads only read the manifests. Importing ``vllm._custom_ops`` then takes a few
seconds (vLLM's own start-up).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType

from moereplay.errors import PackError
from moereplay.ops.surface import vendored_packages
from moereplay.pack.archive import extract_tar_xz
from moereplay.pack.manifest import DEPS_ARCHIVE, MANIFEST_NAME, TREE_ARCHIVE, PackManifest, read_manifest

COMPLETE_MARK = ".complete"
SERVE_PACK_VARIABLE = "MOEREPLAY_SERVE_PACK"
#: ``bin/vllm`` of an attached serve pack: vLLM's console script is not in the pack, its ``main`` is.
VLLM_SCRIPT = (
    "#!/bin/sh\n"
    "# vLLM's console script, for a vLLM loaded from a kernel pack (moereplay.pack.load)\n"
    'exec python3 -m vllm.entrypoints.cli.main "$@"\n'
)


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
                f"{manifest.label}'s wheel {wheel.file} is built for CPython 3.{tag_minor}, "
                f"but Python {running} is running"
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
class UnpackedServe:
    """Where a serve pack lies unpacked, beside the kernels pack it completes."""

    manifest: PackManifest
    root: Path

    @property
    def site(self) -> Path:
        return self.root / "site"

    @property
    def bin(self) -> Path:
        """Holds ``vllm``: put it on ``PATH`` and ``vllm serve …`` works."""
        return self.root / "bin"


@dataclass(frozen=True)
class UnpackedPack:
    """Where a pack lies unpacked. ``paths`` go on ``sys.path`` / ``PYTHONPATH``, in this order."""

    manifest: PackManifest
    root: Path
    serve: UnpackedServe | None = None

    @property
    def site(self) -> Path:
        return self.root / "site"

    @property
    def aliases(self) -> Path:
        return self.root / "aliases"

    @property
    def paths(self) -> tuple[Path, ...]:
        return (self.site, self.aliases) + ((self.serve.site,) if self.serve else ())


def cache_key(manifest: PackManifest) -> str:
    """A directory name unique to the pack's contents."""
    hashes = "".join(digest.sha256[:12] for digest in manifest.files)
    return f"vllm-{manifest.vllm_version}-{manifest.arch or 'all'}-{hashes}"


def serve_pack_setting(environ: Mapping[str, str], default: Path) -> Path | None:
    """The serve pack to attach, from ``$MOEREPLAY_SERVE_PACK`` (read at the edge, never at import).

    Unset: ``default`` (e.g. ``REPO/.servepack``) when it holds a pack, else none. Set but empty: none. Set: that
    directory (loading fails with one line if it is not a serve pack).
    """
    value = environ.get(SERVE_PACK_VARIABLE)
    if value is None:
        return default if (default / MANIFEST_NAME).is_file() else None
    return Path(value) if value.strip() else None


def check_companion(kernels: PackManifest, serve: PackManifest) -> None:
    """Refuse a serve pack that does not complete this kernels pack: another profile, another vLLM wheel (its
    libraries and wheels were chosen for that build), another arch, or an extra wheel both packs hold."""
    if kernels.profile != "kernels":
        raise PackError(f"{kernels.label} given where a kernels pack is expected")
    if serve.profile != "serve":
        raise PackError(f"{serve.label} given where a serve pack is expected")
    if serve.vllm_wheel.sha256 != kernels.vllm_wheel.sha256 or serve.torch_pin != kernels.torch_pin:
        raise PackError(
            f"serve pack is for {serve.vllm_wheel.name} (sha256 {serve.vllm_wheel.sha256[:12]}, torch "
            f"{serve.torch_pin}), the kernel pack for {kernels.vllm_wheel.name} (sha256 "
            f"{kernels.vllm_wheel.sha256[:12]}, torch {kernels.torch_pin}): build both from one wheel"
        )
    if serve.arch != kernels.arch:
        raise PackError(
            f"serve pack is slimmed for {serve.arch or 'all'}, the kernel pack for {kernels.arch or 'all'}"
        )
    both = sorted(
        {wheel.name for wheel in kernels.extra_wheels} & {wheel.name for wheel in serve.extra_wheels}
    )
    if both:
        raise PackError(f"kernel pack and serve pack both hold {', '.join(both)}: rebuild the serve pack")


def _unpack_into(root: Path, directory: Path, manifest: PackManifest, finish: Callable[[Path], None]) -> None:
    """Verify the pack's archives, unpack them into ``root/site`` and let ``finish`` complete the staging
    directory. Safe against concurrent callers: each unpacks into its own temporary directory and the first to
    rename it into place wins."""
    verify_files(directory, manifest)
    for required in (TREE_ARCHIVE, DEPS_ARCHIVE):
        if manifest.file(required) is None:
            raise PackError(f"{manifest.label} manifest lists no {required}")
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = root.parent / f".{root.name}.{os.getpid()}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        for archive in (TREE_ARCHIVE, DEPS_ARCHIVE):
            extract_tar_xz(directory / archive, staging / "site")
        finish(staging)
        (staging / COMPLETE_MARK).write_text(manifest.to_json(), encoding="utf-8")
        if root.exists():
            shutil.rmtree(root)  # an unfinished earlier unpack (no COMPLETE_MARK)
        try:
            staging.rename(root)
        except OSError:
            if not (root / COMPLETE_MARK).is_file():
                raise
    except OSError as error:
        raise PackError(f"cannot unpack {manifest.label} into {root}: {error}") from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def unpack_pack(directory: Path, cache_dir: Path | None = None, serve: Path | None = None) -> UnpackedPack:
    """Unpack a kernels pack into the cache unless it already is there, and attach the serve pack ``serve`` if
    given (:func:`attach_serve_pack`); needs no torch."""
    manifest = read_manifest(directory)
    if manifest.profile != "kernels":
        raise PackError(
            f"{directory} is a {manifest.label}: load the kernels pack built from the same wheel, with this one "
            f"as its serve pack (${SERVE_PACK_VARIABLE})"
        )
    root = (cache_dir or default_cache_dir()) / cache_key(manifest)
    unpacked = UnpackedPack(manifest=manifest, root=root)
    if not (root / COMPLETE_MARK).is_file():

        def finish(staging: Path) -> None:
            vendored = vendored_packages()
            for where in vendored.values():
                if not (staging / "site" / where).is_dir():
                    raise PackError(f"kernel pack {directory} has no {where}")
            (staging / "aliases").mkdir()
            for name, where in vendored.items():
                (staging / "aliases" / name).symlink_to(Path("..", "site", where))

        _unpack_into(root, directory, manifest, finish)
    if serve is None:
        return unpacked
    return replace(unpacked, serve=attach_serve_pack(unpacked, serve))


def attach_serve_pack(unpacked: UnpackedPack, directory: Path) -> UnpackedServe:
    """Unpack the serve pack in ``directory`` beside ``unpacked`` (once) and link its libraries into the kernels
    pack's tree, replacing links to another serve pack's libraries."""
    manifest = read_manifest(directory)
    check_companion(unpacked.manifest, manifest)
    hashes = "".join(digest.sha256[:12] for digest in manifest.files)
    served = UnpackedServe(manifest=manifest, root=unpacked.root / f"serve-{hashes}")
    if not (served.root / COMPLETE_MARK).is_file():

        def finish(staging: Path) -> None:
            for library in manifest.libraries:
                if not (staging / "site" / library.member).is_file():
                    raise PackError(f"serve pack {directory} lacks {library.member}")
            (staging / "bin").mkdir()
            script = staging / "bin" / "vllm"
            script.write_text(VLLM_SCRIPT, encoding="utf-8")
            script.chmod(0o755)

        _unpack_into(served.root, directory, manifest, finish)
    for library in manifest.libraries:
        _link(served.site / library.member, unpacked.site / library.member)
    return served


def _link(source: Path, target: Path) -> None:
    """Make ``target`` a relative symbolic link to ``source``, atomically; refuse to replace a regular file."""
    if not target.parent.is_dir():
        raise PackError(f"the kernel pack's tree has no {target.parent.name}/ to hold {target.name}")
    relative = Path(os.path.relpath(source, target.parent))
    if target.is_symlink() and Path(os.readlink(target)) == relative:
        return
    if target.exists() and not target.is_symlink():
        raise PackError(f"{target} is a file of the kernel pack, not a link to a serve pack's library")
    temporary = target.with_name(f".{target.name}.{os.getpid()}.link")
    try:
        temporary.unlink(missing_ok=True)
        temporary.symlink_to(relative)
        temporary.replace(target)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise PackError(f"cannot link {target} to the serve pack: {error}") from error


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
        if top == "vllm" or top in vendored_packages():
            origin = Path(getattr(module, "__file__", "") or "").resolve()
            if self.unpacked.site.resolve() not in origin.parents:
                raise PackError(f"{name} was imported from {origin}, not from kernel pack {self.directory}")
        return module

    @property
    def custom_ops(self) -> ModuleType:
        """``vllm._custom_ops``: loads both CUDA libraries and registers ``torch.ops._C`` / ``torch.ops._moe_C``."""
        return self.import_module("vllm._custom_ops")


def activate(unpacked: UnpackedPack) -> None:
    """Put the pack's paths first on ``sys.path``; refuse if another vLLM or triton_kernels is already imported."""
    for top in ("vllm", *vendored_packages()):
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


def load_pack(
    directory: Path | str, cache_dir: Path | None = None, serve: Path | str | None = None
) -> LoadedPack:
    """Check a pack (and the serve pack ``serve``, if given) against the running Python and torch, unpack it if
    needed and put it on ``sys.path``."""
    path = Path(directory)
    manifest = read_manifest(path)
    running = (sys.version_info[0], sys.version_info[1])
    check_python(manifest, running)
    if serve is not None:
        check_companion(manifest, read_manifest(Path(serve)))
        check_python(read_manifest(Path(serve)), running)
    import torch

    check_torch(manifest, torch.__version__, torch.version.cuda)
    unpacked = unpack_pack(path, cache_dir, None if serve is None else Path(serve))
    activate(unpacked)
    return LoadedPack(directory=path, unpacked=unpacked)
