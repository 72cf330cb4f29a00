"""``moereplay trim``: a smaller capture holding chosen calls and only the blobs they use.

Calls are copied *as recorded*, never decoded: value trees keep their codec values (recipes, triton_kernels
objects, vLLM enums — whether or not this process knows their codecs), tensor views keep their dtype, shape, stride,
storage offset, device and storage ids (so aliasing between arguments, and between arguments and outputs, is kept),
and every tensor keeps the exact bytes stored for its storage. Blobs shared by kept calls are stored once (the
writer deduplicates by content), so ``moereplay info`` on the result shows the dedup of what was kept.

Calls are renumbered 0, 1, … in their original order; each keeps its original index in ``context["trimmed_from"]``
and its parent when the parent is kept too (``parents=True`` keeps every ancestor of a chosen call). The header is
the original's (versions, GPU, driver, command line of the capture), plus a ``trim`` entry saying what was kept
from which file (a caller may rewrite it: ``rewrite_header``). Outputs, timings, status and errors are copied; call start/finish times become the trim's.

Cost: every kept blob is read, verified and written once; nothing is decompressed twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moereplay.errors import CaptureFileError, SettingsError, UnsupportedValueError
from moereplay.wording import index_range


def parse_call_spec(spec: str) -> list[int]:
    """``"0,3,10-12"`` → ``[0, 3, 10, 11, 12]`` (sorted, unique). Raises :class:`SettingsError` on bad text."""
    chosen: set[int] = set()
    for part in spec.split(","):
        item = part.strip()
        if not item:
            continue
        low, dash, high = item.partition("-")
        try:
            first = int(low)
            last = int(high) if dash else first
        except ValueError as error:
            raise SettingsError(f"--calls {spec!r}: {item!r} is not N or N-M") from error
        if first < 0 or last < first:
            raise SettingsError(f"--calls {spec!r}: {item!r} is not an ascending range of call indices")
        if last - first > 1_000_000:
            raise SettingsError(f"--calls {spec!r}: range {item!r} is implausibly long")
        chosen.update(range(first, last + 1))
    if not chosen:
        raise SettingsError(f"--calls {spec!r} names no call")
    return sorted(chosen)


@dataclass(frozen=True)
class TrimResult:
    """What :func:`trim_capture` wrote. ``kept``: original indices, in the new file's order."""

    source: Path
    path: Path
    kept: tuple[int, ...]
    source_calls: int
    source_bytes: int
    file_bytes: int


class CallCopier:
    """Copies recorded calls from one reader into one writer, undecoded (``moereplay trim``, ``moereplay expand``).

    Trees become trees the writer accepts: tensor metas → :class:`TensorBytes` carrying the stored bytes of their
    storage (each blob read once per output file; later uses refer to it by digest)."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.written: set[bytes] = set()  # digests the writer holds (committed calls)
        self.current: dict[bytes, torch.Tensor] = {}  # bytes read for the call being copied

    def copy(
        self,
        writer: Any,
        index: int,
        *,
        parent: int | None,
        extra_context: Mapping[Any, Any] | None = None,
    ) -> int:
        """Write call ``index`` of the reader (and its completion, if recorded) into ``writer``; return its new
        index. ``parent``: the enclosing call's index *in the writer's file*; ``extra_context`` is merged over the
        recorded context."""
        call, completion = self.reader.raw_documents(index)  # the raw documents: no codec runs
        where = f"{self.reader.path}: call {index}"
        args = {name: self.tree(value, call["storages"], where) for name, value in call["args"].items()}
        context = dict(call["ctx"])
        context.update(extra_context or {})
        new = int(
            writer.begin_call(
                call["op"], args, site=call["site"], context=context, parent=parent, static=call["static"]
            )
        )
        self.commit()
        if completion is not None:
            outputs = {
                name: self.tree(value, completion["storages"], where)
                for name, value in completion["outputs"].items()
            }
            writer.complete_call(
                new,
                outputs,
                timings=completion["timings"],
                status=completion["status"],
                error=completion["error"],
            )
            self.commit()
        return new

    def commit(self) -> None:
        """The call being copied was written: its blobs can be referred to by digest from now on."""
        self.written.update(self.current)
        self.current.clear()

    def tree(self, value: Any, storages: dict[int, Any], where: str) -> Any:
        from moereplay.format.schema import CodecValue, TensorMeta

        if isinstance(value, TensorMeta):
            return self.tensor(value, storages, where)
        if isinstance(value, dict):
            return {key: self.tree(item, storages, where) for key, item in value.items()}
        if isinstance(value, list):
            return [self.tree(item, storages, where) for item in value]
        if isinstance(value, tuple) and not isinstance(value, torch.Size):
            return tuple(self.tree(item, storages, where) for item in value)
        if isinstance(value, CodecValue):
            return CodecValue(value.type_name, self.tree(value.value, storages, where))
        return value

    def tensor(self, meta: Any, storages: dict[int, Any], where: str) -> Any:
        from moereplay.format.schema import TensorBytes
        from moereplay.format.tensors import DTYPES

        dtype = DTYPES.get(meta.dtype)
        if dtype is None:
            raise CaptureFileError(f"{where}: dtype {meta.dtype} is unknown to torch {torch.__version__}")
        if meta.conj:
            raise UnsupportedValueError(f"{where}: conjugated tensor views cannot be copied by trim")
        if meta.numel == 0:
            return TensorBytes(
                dtype, meta.shape, meta.stride, meta.storage_offset, meta.device, None, 0, None
            )
        storage = storages.get(meta.storage)
        if storage is None:
            raise CaptureFileError(f"{where}: a tensor refers to storage {meta.storage}, which has no bytes")
        data = None
        if storage.digest not in self.written:
            data = self.current.get(storage.digest)
            if data is None:
                data = self.reader.storage_bytes(storage)  # verified fresh bytes of the recorded span
                self.current[storage.digest] = data
        return TensorBytes(
            dtype,
            meta.shape,
            meta.stride,
            meta.storage_offset,
            meta.device,
            ("storage", meta.storage),
            storage.base,
            data,
            static_key=storage.digest,
        )


def _with_ancestors(reader: Any, chosen: Iterable[int]) -> list[int]:
    kept = set(chosen)
    frontier = list(kept)
    while frontier:
        parent = reader.call(frontier.pop()).parent
        if parent is not None and parent in reader.indices and parent not in kept:
            kept.add(parent)
            frontier.append(parent)
    return sorted(kept)


def trim_capture(
    source: str | Path,
    calls: str | Sequence[int],
    output: str | Path,
    *,
    parents: bool = False,
    rewrite_header: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> TrimResult:
    """Copy the calls ``calls`` (a spec like ``"0,3,10-12"`` or indices) of ``source`` into ``output``.

    ``rewrite_header``: applied to the new file's header (the original's plus its ``trim`` entry) before it is
    written — ``moereplay repro`` cuts the recording machine's directories out of it."""
    from moereplay import __version__
    from moereplay.format import CaptureReader, CaptureWriter
    from moereplay.format.summary import header_with_gpu_at_close

    source, output = Path(source), Path(output)
    if source.resolve() == output.resolve():
        raise SettingsError(f"{output}: trim would overwrite its own source")
    wanted = parse_call_spec(calls) if isinstance(calls, str) else sorted(set(int(c) for c in calls))
    with CaptureReader(source) as reader:
        missing = [index for index in wanted if index not in reader.indices]
        if missing:
            raise SettingsError(
                f"{source}: no call {missing[0]} (the file holds {index_range(len(reader), 'call')})"
                if reader.indices
                else f"{source}: the file holds no calls"
            )
        kept = _with_ancestors(reader, wanted) if parents else wanted
        copier = CallCopier(reader)
        header = dict(header_with_gpu_at_close(reader.header, reader.footer))  # a GPU read at close is kept
        header["trim"] = {
            "source": source.name,
            "calls": kept,
            "parents": parents,
            "source_calls": len(reader),
            "moereplay": __version__,
        }
        if rewrite_header is not None:
            header = rewrite_header(header)
        counters = reader.counters
        renumbered: dict[int, int] = {}
        with CaptureWriter(output, header=header) as writer:
            for index in kept:
                parent = reader.call(index).parent
                extra: dict[str, Any] = {"trimmed_from": index}
                if parent is not None and parent not in renumbered:
                    extra["trimmed_parent"] = parent
                renumbered[index] = copier.copy(
                    writer,
                    index,
                    parent=renumbered.get(parent) if parent is not None else None,
                    extra_context=extra,
                )
            writer.close(counters=counters)
        source_calls, source_bytes = len(reader), reader.file_bytes
    return TrimResult(source, output, tuple(kept), source_calls, source_bytes, output.stat().st_size)
