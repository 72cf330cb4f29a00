"""Keep the writer thread's CUDA calls out of another thread's CUDA graph capture.

A CUDA graph captured in the (default) global mode is invalidated by any potentially unsafe CUDA call from any
thread while it is being captured — an event synchronise, a blocking copy to the host. The capture writer thread
makes such calls (waiting for a snapshot's copies, reading a device timing, copying a weight to the host once),
so a vLLM that captures its CUDA graphs while the writer is still busy with earlier eager calls would fail its
capture (seen on the H200: ``operation failed due to a previous error during capture``).

:class:`GraphGate` serialises the two: the writer thread does its CUDA work inside :meth:`GraphGate.device_work`,
and while a graph is being captured (from ``CUDAGraph.capture_begin`` until ``capture_end``, which
:func:`install` wraps for as long as capture is armed) ``device_work`` waits. ``capture_begin`` waits for the
writer's current message, at most ``wait_s`` seconds (a writer stuck on a hung disk must not stall serving: it
then logs why and lets the capture go ahead). Several graphs may be captured at once (other threads, streams).

Before that, ``capture_begin`` runs :attr:`GraphGate.prepare` (outside the capture, on the capturing thread): the
flight recorder allocates the device memory of its graph ring and compiles the kernels it captures into graphs —
neither is allowed once the capture has begun (nor while another thread captures: then it is skipped). A failing
``prepare`` is logged; the capture goes ahead. Once the capture has begun, :attr:`GraphGate.begun` runs (the flight
recorder opens the graph for staged ring nodes), and :attr:`GraphGate.ending` with its result right before
``capture_end`` (the ring's side stream is joined back: a capture must not end with a forked stream), then
:attr:`GraphGate.ended` after it (the side stream is free for another capture).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

logger = logging.getLogger("moereplay.capture")

DEFAULT_WAIT_S = 30.0


class GraphGate:
    """See the module docstring. ``captures``: graphs being captured now; ``waits``: captures that waited."""

    def __init__(self, wait_s: float = DEFAULT_WAIT_S) -> None:
        self.wait_s = wait_s
        self._condition = threading.Condition()
        self._captures = 0
        self._busy = False
        self.waits = 0
        self.timeouts = 0
        self.prepare: Callable[[], None] | None = None  # run by capture_begin before the capture begins
        self.begun: Callable[[], object] | None = None  # run once it has begun; its result goes to ``ending``
        self.ending: Callable[[object], None] | None = None  # run by capture_end before the capture ends
        # run by capture_end after it (even when it raised)
        self.ended: Callable[[object], None] | None = None
        self._tokens: dict[int, object] = {}

    def prepare_capture(self) -> None:
        """Run :attr:`prepare` (see the module docstring) unless another graph is being captured now (an
        allocation could break that capture: what is not prepared by then is not kept); never raises."""
        prepare = self.prepare
        if prepare is None or self._captures:
            return
        try:
            prepare()
        except Exception as error:
            logger.error(
                "moereplay: preparing for a CUDA graph capture failed: %s: %s", type(error).__name__, error
            )

    def capture_begun(self, graph: object) -> None:
        """Run :attr:`begun` on the capturing thread once ``graph``'s capture has begun; never raises."""
        token = self._run_hook("begin", self.begun)
        if token is not None:
            with self._condition:
                self._tokens[id(graph)] = token

    def capture_ending(self, graph: object) -> None:
        """Run :attr:`ending` with what :attr:`begun` returned for ``graph``, before its capture ends; never
        raises."""
        with self._condition:
            token = self._tokens.get(id(graph))
        if token is not None:
            self._run_hook("end", self.ending, token)

    def capture_ended(self, graph: object) -> None:
        """Run :attr:`ended` with that token once ``graph``'s capture has ended; never raises."""
        with self._condition:
            token = self._tokens.pop(id(graph), None)
        if token is not None:
            self._run_hook("ended", self.ended, token)

    @staticmethod
    def _run_hook(what: str, hook: Callable[..., object] | None, *args: object) -> object:
        """``hook(*args)``'s result; None when there is no hook or it raised (logged)."""
        if hook is None:
            return None
        try:
            return hook(*args)
        except Exception as error:
            logger.error(
                "moereplay: a CUDA graph capture's %s hook failed: %s: %s", what, type(error).__name__, error
            )
            return None

    @property
    def captures(self) -> int:
        return self._captures

    @contextmanager
    def device_work(self) -> Iterator[None]:
        """The writer thread's CUDA calls: not while a graph is being captured."""
        with self._condition:
            while self._captures:
                self._condition.wait()
            self._busy = True
        try:
            yield
        finally:
            with self._condition:
                self._busy = False
                self._condition.notify_all()

    def begin_capture(self) -> None:
        with self._condition:
            if self._busy:
                self.waits += 1
                if not self._condition.wait_for(lambda: not self._busy, timeout=self.wait_s):
                    self.timeouts += 1
                    logger.error(
                        "moereplay: the capture writer is still busy after %.0f s while a CUDA graph capture "
                        "starts; the graph capture goes ahead and may fail (start vLLM with --enforce-eager "
                        "when capturing calls)",
                        self.wait_s,
                    )
            self._captures += 1

    def end_capture(self) -> None:
        with self._condition:
            self._captures = max(0, self._captures - 1)
            self._condition.notify_all()


def install(gate: GraphGate, graph_class: Any = None) -> Callable[[], None]:
    """Wrap ``graph_class.capture_begin`` / ``capture_end`` (``torch.cuda.CUDAGraph`` by default) so a capture
    holds ``gate``; returns the undo. Does nothing (and returns a no-op) where torch has no CUDA graphs."""
    if graph_class is None:
        try:
            import torch

            graph_class = torch.cuda.CUDAGraph
        except (ImportError, AttributeError):
            return lambda: None
    original_begin = graph_class.__dict__.get("capture_begin")
    original_end = graph_class.__dict__.get("capture_end")
    begin = getattr(graph_class, "capture_begin", None)
    end = getattr(graph_class, "capture_end", None)
    if begin is None or end is None:
        return lambda: None

    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        gate.prepare_capture()
        gate.begin_capture()
        try:
            began = begin(self, *args, **kwargs)
        except BaseException:
            gate.end_capture()
            raise
        gate.capture_begun(self)
        return began

    def capture_end(self: Any, *args: Any, **kwargs: Any) -> Any:
        gate.capture_ending(self)
        try:
            return end(self, *args, **kwargs)
        finally:
            gate.capture_ended(self)
            gate.end_capture()

    capture_begin.__wrapped__ = begin  # type: ignore[attr-defined]
    capture_end.__wrapped__ = end  # type: ignore[attr-defined]
    graph_class.capture_begin = capture_begin
    graph_class.capture_end = capture_end

    def undo() -> None:
        for name, original in (("capture_begin", original_begin), ("capture_end", original_end)):
            if original is None:
                with suppress(AttributeError):
                    delattr(graph_class, name)
            else:
                setattr(graph_class, name, original)

    return undo
