"""Adapter from the writer thread's messages to the capture file (:class:`moereplay.format.CaptureWriter`).

Runs on the writer thread only. Copied tensors become host tensor views; static tensors are handed to the file
writer live, with their argument names as ``static=`` so it copies each weight once per file (by identity).
On CUDA those first copies run on a side stream of the writer thread, never on the serving stream.
"""

from __future__ import annotations

from typing import Any

from moereplay.capture.snapshot import materialize
from moereplay.capture.writer_thread import Begin, Complete


class FormatSink:
    """``RecordSink`` over a ``CaptureWriter`` (which it owns and closes)."""

    def __init__(self, writer: Any, *, side_stream: Any = None) -> None:
        self.writer = writer
        self._side_stream = side_stream

    def _on_side_stream(self, action: Any) -> Any:
        if self._side_stream is None:
            return action()
        import torch

        with torch.cuda.stream(self._side_stream):
            return action()

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

    def bytes_written(self) -> int:
        return int(self.writer.bytes_written)

    def flush(self) -> None:
        """Hand what is buffered to the operating system (no fsync)."""
        self.writer.flush()

    def close(self, counters: dict[str, int]) -> None:
        self.writer.close(counters=counters)
