"""Drawing experts one at a time while a worker thread finishes the previous one.

The seeded CPU generator is serial: the codes of a gpt-oss weight set (half a billion draws) take about 1.5 s on one
core whatever else happens, and in a fixed order — expert after expert, since every generator draws its ``[E, ...]``
tensors in row-major order. What a generator then does to each expert's codes (padding, reordering columns, packing
them into the kernel's layout) depends on that expert alone. So the generator draws expert ``e`` on the calling
thread while :class:`ExpertPipeline` runs expert ``e - 1``'s finishing step on one worker thread (torch releases the
GIL inside its operators); the draws keep their order, so the stream, and every byte, is what one draw of the
whole tensor gives (the unit tests compare the two).

Memory: at most one expert waiting and one being finished, besides the one being drawn — a few times one expert's
codes, never the whole set's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any

import torch


class ExpertPipeline:
    """A context manager: :meth:`submit` hands work to one worker thread, first waiting for the work handed before
    (so at most one job waits while the caller draws the next); leaving the block waits for the last job and
    re-raises the first error a job raised."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moereplay-expert")
        self._pending: Future[Any] | None = None

    def __enter__(self) -> ExpertPipeline:
        return self

    def submit(self, function: Callable[..., Any], *args: Any) -> None:
        self._wait()
        self._pending = self._executor.submit(function, *args)

    def wait(self) -> None:
        """Wait for the work handed so far (re-raising its error)."""
        self._wait()

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if kind is None:
                self._wait()
        finally:
            self._executor.shutdown(wait=True)


class SliceDigests:
    """sha256 of an ``[E, ...]`` output, fed one expert's slice at a time in expert order, once its bytes are final:
    of its elements in row-major order and of its storage bytes (the two of :class:`moereplay.synth.recipe.Drawn`).

    ``add(stored)`` for a contiguous output (its storage bytes are its elements); ``add(stored, elements)`` for one
    kept as a view of another layout, with ``elements`` the expert's slice of that view (copied contiguous here)."""

    def __init__(self) -> None:
        self._elements = hashlib.sha256()
        self._storage = hashlib.sha256()

    def add(self, stored: torch.Tensor, elements: torch.Tensor | None = None) -> None:
        raw = stored.view(-1).view(torch.uint8).numpy().data  # view: raises unless ``stored`` is contiguous
        self._storage.update(raw)
        if elements is None:
            self._elements.update(raw)
        else:
            self._elements.update(elements.contiguous().reshape(-1).view(torch.uint8).numpy().data)

    def digests(self) -> tuple[str, str]:
        return self._elements.hexdigest(), self._storage.hexdigest()
