"""Capture file format v1: one file per process, a sequence of zstd frames each holding one msgpack document.

Writing::

    from moereplay.format import CaptureWriter

    with CaptureWriter("run.moe.zst", header={"model": "gpt-oss-20b"}) as writer:
        i = writer.begin_call("moe_wna16_marlin_gemm", {"a": a, "b_q_weight": w, "c": out, "top_k": 4},
                              site="fused_marlin_moe:223", context={"layer": 3, "step": 17},
                              static={"b_q_weight"})
        ...                                              # run the kernel, synchronise
        writer.complete_call(i, {"c": out}, timings={"kernel_s": 1.2e-4})
        writer.close(counters={"dropped_calls": 0})      # also done by the ``with`` block (without counters)

Reading::

    from moereplay.format import CaptureReader

    with CaptureReader("run.moe.zst") as reader:
        print(reader.header["versions"], reader.recovery.message, len(reader))
        for record in reader.calls():                    # CallRecord: no tensor bytes are read
            print(record.index, record.op, record.status, record.arg_tensors["a"].describe())
        args = reader.load_args(0, device="cuda")        # tensors materialised, aliasing preserved
        outputs = reader.load_outputs(0)

Public API (stable names; other packages code against these):

- :class:`CaptureWriter` ``(path, header=None, *, index_every=64, compression_level=3)`` — context manager.
  ``begin_call(op, args, *, site="", context=None, parent=None, static=()) -> int``;
  ``complete_call(index, outputs, *, timings=None, status="completed", error=None)``; ``flush()``;
  ``close(counters=None)``; ``.calls`` (begun so far), ``.bytes_written``. The header dict is merged over the automatic environment header (format version,
  moereplay/torch/triton/vLLM/CUDA/driver versions, GPU name/compute capability/SM count when CUDA is
  initialised, host, pid, rank, argv, ``MOEREPLAY_*``/``VLLM_*`` variables). **The writer copies tensors to
  the host itself** (synchronously), so callers pass device tensors as they are. ``static`` names arguments
  whose tensors are weights: cached by identity, so later calls skip the device copy and the hash.
- :class:`CaptureReader` ``(path, *, max_frame_bytes=64 MiB, max_blob_bytes=16 GiB, verify_hashes=True,
  blob_cache_bytes=256 MiB, memory_budget=None)`` — context manager. ``.header`` (dict), ``.recovery``
  (:class:`Recovery`), ``.footer`` (dict or None), ``len(reader)``, ``.calls()`` (iterator of the readable
  :class:`CallRecord`), ``.entries()`` (those and a :class:`DamagedCall` for each call that cannot be read),
  ``.damaged``, ``.call(i)``, ``.select(op=, layer=,
  status=)``, ``.load_args(i, device="cpu")``, ``.load_outputs(i, device="cpu")``, ``.stats()``
  (:class:`CaptureStats`), ``.blob_frames_read`` / ``.bytes_read`` (I/O counters).
- :class:`CallRecord` — index, op, site, context, parent, status (``inputs_saved`` / ``completed`` /
  ``failed``), args and outputs as value trees with :class:`TensorMeta` in place of tensors, timings, error,
  static; ``.layer``, ``.arg_tensors`` / ``.output_tensors`` (path → TensorMeta), ``.aliases()``.
- Values: :class:`TensorMeta`, :class:`Unsupported` (no codec at capture; replay refuses it),
  :class:`CodecValue` (recorded through a codec not registered at load), :class:`EnumValue`.
  A capture layer that copies tensors and runs codecs itself may hand the writer :class:`TensorBytes`
  (original view metadata + the copied bytes of its storage span, a caller-chosen storage identity shared
  by a call's arguments and outputs, and an optional ``static_key`` to reuse a weight's bytes without
  passing them again), :class:`CodecValue`, :class:`EnumValue` and :class:`Unsupported` in its trees.
- :func:`register_codec` ``(type_or_qualname, encode, decode)``, :func:`unregister_codec`,
  :func:`register_enum` ``(enum_class)``, :func:`qualified_name` ``(type)``.
- Errors (from :mod:`moereplay.errors`): :class:`CaptureFileError`, :class:`TruncatedFileError` (one line,
  naming the file and the problem), :class:`MemoryBudgetError` (loading a call would allocate more than
  ``memory_budget``, see :mod:`moereplay.format.budget`), :class:`UnsupportedValueError`.

Recorded values: None, bool, int (any size), float (nan/inf), str, bytes, list, tuple, dict (any hashable
keys), set, frozenset, enums, ``torch.dtype``, ``torch.device``, ``torch.Size``, tensors of every dtype
(shape, stride, storage offset, device, the bytes of the storage span the view covers, aliasing within a call),
and objects with a registered codec; anything else becomes :class:`Unsupported`.

Aliasing: within one call, every storage gets a storage id; tensors (arguments and outputs) on the same storage
share it. Loading checks every tensor description against its storage and the call's total against the memory
budget before allocating, reads each blob once, and rebuilds one buffer per storage id holding the union of the recorded spans and returns views
of it. Arguments and outputs are loaded separately (outputs hold the bytes after the call); an output that was
written in place over an argument has the argument's storage id (``CallRecord.aliases()``).

Importing this package, opening a reader and listing calls do not import torch (about 200 MB resident):
``CaptureWriter`` and the tensor helpers load it on first use, and the reader when it loads tensors.

The byte layout is described in :mod:`moereplay.format.framing` (records), :mod:`moereplay.format.values`
(value encoding), :mod:`moereplay.format.tensors` (tensor spans) and :mod:`moereplay.format.writer` (record
order, index and footer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moereplay.errors import CaptureFileError, TruncatedFileError, UnsupportedValueError
from moereplay.format.codecs import (
    Codec,
    qualified_name,
    register_codec,
    register_enum,
    unregister_codec,
)
from moereplay.format.framing import FORMAT_MAJOR, FORMAT_MINOR
from moereplay.format.reader import CaptureReader
from moereplay.format.records import CallRecord, CallStatus, CaptureStats, DamagedCall, Recovery
from moereplay.format.schema import CodecValue, EnumValue, TensorBytes, TensorMeta, Unsupported

if TYPE_CHECKING:
    from moereplay.format.writer import CaptureWriter


def __getattr__(name: str) -> Any:
    """``CaptureWriter`` is imported on first use: it needs torch, and reading a capture does not."""
    if name == "CaptureWriter":
        from moereplay.format.writer import CaptureWriter

        return CaptureWriter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "CallRecord",
    "CallStatus",
    "CaptureFileError",
    "CaptureReader",
    "CaptureStats",
    "CaptureWriter",
    "Codec",
    "CodecValue",
    "DamagedCall",
    "EnumValue",
    "Recovery",
    "TensorBytes",
    "TensorMeta",
    "TruncatedFileError",
    "Unsupported",
    "UnsupportedValueError",
    "qualified_name",
    "register_codec",
    "register_enum",
    "unregister_codec",
]
