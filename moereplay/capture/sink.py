"""Adapter from the writer thread's messages to the capture file (:class:`moereplay.format.CaptureWriter`).

Runs on the writer thread only. Copied tensors become host tensor views; static tensors are handed to the file
writer live, with their argument names as ``static=`` so it copies each weight once per file (by identity).
On CUDA those first copies run on a side stream of the writer thread, never on the serving stream.

``prefetch`` hands a queued message's host copies to the file writer's worker pool (``CaptureWriter.prefetch``)
before the message is written; ``materialize`` keeps the very same data tensors, which is how the writer finds the
work again. ``release`` drops what the message did not use (it was not written, or its storages were deduplicated).
"""

from __future__ import annotations

from typing import Any

from moereplay.capture.snapshot import TensorCopy, materialize
from moereplay.capture.writer_thread import Begin, Complete
from moereplay.format.schema import CodecValue


class FormatSink:
    """``RecordSink`` over a ``CaptureWriter`` (which it owns and closes)."""

    def __init__(self, writer: Any, *, side_stream: Any = None) -> None:
        self.writer = writer
        self._side_stream = side_stream
        self._prefetched: dict[int, list[Any]] = {}  # id(message) -> data tensors handed to the writer

    def _on_side_stream(self, action: Any) -> Any:
        if self._side_stream is None:
            return action()
        import torch

        with torch.cuda.stream(self._side_stream):
            return action()

    @property
    def byte_limit(self) -> int:
        """The file's byte limit (0: none); a record that would pass it raises ``FileLimitError``."""
        return int(getattr(self.writer, "byte_limit", 0))

    @byte_limit.setter
    def byte_limit(self, value: int) -> None:
        self.writer.byte_limit = int(value)

    def begin(self, message: Begin, parent: int | None) -> int:
        args = materialize(message.snapshot.tree)
        return int(
            self._on_side_stream(
                lambda: self.writer.begin_call(
                    message.op,
                    args,
                    site=message.site,
                    context=message.context,
                    parent=parent,
                    static=message.static,
                )
            )
        )

    def complete(self, index: int, message: Complete) -> None:
        outputs = materialize(message.outputs.tree) if message.outputs is not None else {}
        self._on_side_stream(
            lambda: self.writer.complete_call(
                index, outputs, timings=message.timings, status=message.status, error=message.error
            )
        )

    def prefetch(self, message: Begin | Complete) -> None:
        """Start hashing and compressing ``message``'s host copies on the writer's pool (copies must have landed)."""
        start = getattr(self.writer, "prefetch", None)
        copies = message.snapshot if isinstance(message, Begin) else message.outputs
        if start is None or copies is None or id(message) in self._prefetched:
            return
        started: list[Any] = []
        for data in _copied_data(copies.tree):
            if start(data):
                started.append(data)
        self._prefetched[id(message)] = started

    def release(self, message: Begin | Complete) -> None:
        """Drop prefetched work ``message`` did not use."""
        for data in self._prefetched.pop(id(message), ()):
            self.writer.forget(data)

    @property
    def path(self) -> Any:
        """The capture file's path (for the closing summary line)."""
        return getattr(self.writer, "path", None)

    @property
    def kept(self) -> tuple[int, int] | None:
        """After a failed write: (calls, completions) the file holds whole (the closing summary says so)."""
        kept = getattr(self.writer, "kept", None)
        return None if kept is None else (int(kept[0]), int(kept[1]))

    def bytes_written(self) -> int:
        return int(self.writer.bytes_written)

    def flush(self) -> None:
        """Hand what is buffered to the operating system (no fsync)."""
        self.writer.flush()

    def close(self, counters: dict[str, int]) -> None:
        self.writer.close(counters=counters)


def _copied_data(tree: Any) -> list[Any]:
    """The distinct host data tensors of the :class:`TensorCopy` leaves of a snapshot tree, in tree order."""
    found: dict[int, Any] = {}
    stack = [tree]
    while stack:
        value = stack.pop()
        if isinstance(value, TensorCopy):
            if value.data.device.type == "cpu":
                found.setdefault(id(value.data), value.data)
        elif type(value) is dict:
            stack.extend(reversed(list(value.values())))
        elif type(value) in (list, tuple):
            stack.extend(reversed(value))
        elif isinstance(value, CodecValue):
            stack.append(value.value)
    return list(found.values())
