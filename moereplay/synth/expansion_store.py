"""Expanded recipes kept on disk, so a bundled capture's weights are drawn and packed once per machine, not per run.

Drawing and packing a gpt-oss weight set from its recipe takes 10–15 s on a few cores (the seeded CPU generator is
serial); reading the 270 MB it expands to back from disk takes a fraction of a second. Each expanded tensor is one
file ``<sha256>-<dtype>-<shape>-<stride>.bin`` holding the tensor's storage bytes (exactly what ``torch.empty_strided``
with the recorded shape and stride allocates), written once its bytes hashed to the recipe's recorded digest, beside a
``.sum`` file with the sha256 of those storage bytes; a load re-hashes the file (≈0.2 s per 256 MB) and ignores
— and removes — an entry whose bytes no longer match. Files are written under a temporary name and renamed, so
a reader never sees half a file.

Where: ``$MOEREPLAY_CACHE_DIR`` (``off`` turns the store off), else ``$XDG_CACHE_HOME/moereplay/recipes``, else
``~/.cache/moereplay/recipes``; read when a recipe is expanded, not at import. The store is a cache: a directory that
cannot be created or written only costs the next run the expansion again (one warning says why).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

CACHE_VARIABLE = "MOEREPLAY_CACHE_DIR"


def store_directory(environ: Mapping[str, str] | None = None) -> Path | None:
    """The directory expanded recipes are kept in, or ``None`` when the store is off."""
    environment = os.environ if environ is None else environ
    chosen = environment.get(CACHE_VARIABLE, "").strip()
    if chosen.lower() == "off":
        return None
    if chosen:
        return Path(chosen).expanduser()
    base = environment.get("XDG_CACHE_HOME", "").strip()
    root = Path(base).expanduser() if base else Path.home() / ".cache"
    return root / "moereplay" / "recipes"


def _entry(
    directory: Path, digest: str, dtype: torch.dtype | str, shape: tuple[int, ...], stride: tuple[int, ...]
) -> Path:
    name = str(dtype).removeprefix("torch.")
    dims = "x".join(map(str, shape)) or "scalar"
    steps = "x".join(map(str, stride)) or "scalar"
    return directory / f"{digest}-{name}-{dims}-{steps}.bin"


def _storage_view(tensor: torch.Tensor) -> memoryview:
    storage = tensor.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    return raw.numpy().data.cast("B")


def spans_its_storage(tensor: torch.Tensor) -> bool:
    """True when the tensor's elements are exactly its storage (no offset, no gaps, no overlap)."""
    if tensor.storage_offset() != 0 or tensor.device.type != "cpu":
        return False
    span = 1 + sum(
        (size - 1) * step for size, step in zip(tensor.shape, tensor.stride(), strict=True) if size > 0
    )
    return (
        tensor.numel() > 0
        and span == tensor.numel()
        and tensor.untyped_storage().nbytes() == (tensor.numel() * tensor.element_size())
    )


def has(
    digest: str,
    dtype: str,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    environ: Mapping[str, str] | None = None,
) -> bool:
    """Whether an expansion is kept (by name; :func:`load` still checks its bytes): a stat, no read."""
    directory = store_directory(environ)
    return directory is not None and _entry(directory, digest, dtype, shape, stride).is_file()


def load(
    digest: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    environ: Mapping[str, str] | None = None,
) -> torch.Tensor | None:
    """The stored expansion (a CPU tensor with this shape and stride), or ``None`` when there is none.

    The tensor is a private (copy-on-write) mapping of the file, so reading it back copies nothing; its bytes are
    hashed through the mapping before it is handed out, and the store never rewrites a file in place (a new entry is
    renamed over, a stale one unlinked), so what was checked is what the tensor holds. Writing to the tensor writes
    to the process's own copy of those pages, never to the file."""
    directory = store_directory(environ)
    if directory is None:
        return None
    path = _entry(directory, digest, dtype, shape, stride)
    checksum = path.with_suffix(".sum")
    try:
        expected = checksum.read_text().strip()
        layout = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        size = _storage_bytes(layout)
        if size is None or path.stat().st_size != size:
            return None
        raw = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    except (OSError, RuntimeError):
        return None
    if hashlib.sha256(raw.numpy().data).hexdigest() != expected:
        for stale in (path, checksum):
            stale.unlink(missing_ok=True)
        return None
    return raw.view(dtype).as_strided(shape, stride)


def _storage_bytes(layout: torch.Tensor) -> int | None:
    """Bytes of the storage a tensor with this shape and stride spans exactly (``None``: it does not)."""
    if layout.numel() == 0 or layout.storage_offset() != 0:
        return None
    span = 1 + sum((size - 1) * step for size, step in zip(layout.shape, layout.stride(), strict=True))
    return span * layout.element_size() if span == layout.numel() else None


def save(
    digest: str,
    tensor: torch.Tensor,
    environ: Mapping[str, str] | None = None,
    *,
    checksum: str | None = None,
) -> bool:
    """Keep ``tensor`` (whose elements hash to ``digest``: the caller checked) for later runs; best effort. True when
    the store holds it afterwards. ``checksum``: the sha256 of the tensor's storage bytes when the caller knows it
    (a contiguous tensor's storage bytes are its elements: ``digest``), so they are not hashed twice."""
    directory = store_directory(environ)
    if directory is None or not spans_its_storage(tensor):
        return False
    path = _entry(directory, digest, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
    if path.exists():
        return True
    view = _storage_view(tensor)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(view)
        path.with_suffix(".sum").write_text((checksum or hashlib.sha256(view).hexdigest()) + "\n")
        partial.replace(path)
    except OSError as error:
        partial.unlink(missing_ok=True)
        warnings.warn(
            f"moereplay: cannot keep an expanded recipe in {directory} ({error}); the next run expands it again "
            f"(set {CACHE_VARIABLE} to a writable directory, or to 'off')",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True
