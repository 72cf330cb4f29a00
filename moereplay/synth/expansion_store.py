"""Expanded recipes kept on disk, so a bundled capture's weights are drawn and packed once per machine, not per run.

Drawing and packing a gpt-oss weight set from its recipe takes seconds (the seeded CPU generator is serial); reading
the 270 MB it expands to back from disk takes a fraction of a second. Each expanded tensor is one file
``<sha256>-<dtype>-<shape>-<stride>.bin`` holding the tensor's storage bytes (exactly what ``torch.empty_strided``
with the recorded shape and stride allocates), written once its bytes hashed to the recipe's recorded digest, beside a
``.sum`` file with the sha256 of those storage bytes. A load maps the file privately (copy-on-write: no read copy),
re-hashes it through the mapping (≈0.2 s per 300 MB) and ignores — and removes — an entry whose bytes no longer
match. Files are written under a temporary name and renamed, so a reader never sees half a file, and never rewritten
in place.

Writing can be left to one background thread (:func:`save` with ``background``; 0.1–0.7 s per 300 MB, while the
caller goes on): its checksum is worked out before the call returns, so bytes changed by their owner before they
reach the disk fail the load's check, and a load or :func:`has` in this process waits for a pending write of its
entry; the interpreter waits for the writes at exit, and :func:`flush` waits for them now.

Where: ``$MOEREPLAY_CACHE_DIR`` (``off`` turns the store off), else ``$XDG_CACHE_HOME/moereplay/recipes``, else
``~/.cache/moereplay/recipes``; read when a recipe is expanded, not at import. The store is a cache: a directory that
cannot be created or written only costs the next run the expansion again (one warning says why).
"""

from __future__ import annotations

import hashlib
import os
import threading
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

CACHE_VARIABLE = "MOEREPLAY_CACHE_DIR"

_writes: dict[Path, Future[bool]] = {}  # entries being written in the background
_writes_lock = threading.Lock()
_writer: ThreadPoolExecutor | None = None


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
    if directory is None:
        return False
    path = _entry(directory, digest, dtype, shape, stride)
    _wait_for(path)
    return path.is_file()


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
    _wait_for(path)
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
    background: bool = False,
) -> bool:
    """Keep ``tensor`` (whose elements hash to ``digest``: the caller checked) for later runs; best effort. True when
    the store holds it afterwards (``background``: will hold it, unless writing fails — with a warning).
    ``checksum``: the sha256 of the tensor's storage bytes when the caller knows it (a contiguous tensor's storage
    bytes are its elements: ``digest``); otherwise they are hashed now, before this returns."""
    directory = store_directory(environ)
    if directory is None or not spans_its_storage(tensor):
        return False
    path = _entry(directory, digest, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
    with _writes_lock:
        if path in _writes:
            return True
    if path.exists():
        return True
    checksum = checksum or hashlib.sha256(_storage_view(tensor)).hexdigest()
    if background:
        with _writes_lock:
            if path in _writes:
                return True
            try:
                _writes[path] = _background().submit(_write, directory, path, tensor, checksum)
                return True
            except RuntimeError:  # the interpreter is shutting down: write now
                pass
    return _write(directory, path, tensor, checksum)


def flush() -> None:
    """Wait for every background write of this process."""
    with _writes_lock:
        pending = list(_writes.values())
    for write in pending:
        write.result()


def _background() -> ThreadPoolExecutor:
    """The one writer thread (the caller holds the lock); the interpreter joins it at exit."""
    global _writer
    if _writer is None:
        _writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moereplay-store")
    return _writer


def _wait_for(path: Path) -> None:
    with _writes_lock:
        pending = _writes.get(path)
    if pending is not None:
        pending.result()


def _write(directory: Path, path: Path, tensor: torch.Tensor, checksum: str) -> bool:
    view = _storage_view(tensor)
    partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(view)
        path.with_suffix(".sum").write_text(checksum + "\n")
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
    finally:
        with _writes_lock:
            _writes.pop(path, None)
    return True
