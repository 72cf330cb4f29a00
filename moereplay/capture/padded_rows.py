"""How many rows of a graph-replayed layer call are real: the step's token count, where the device can read it.

vLLM replays a CUDA graph captured for a batch size at least the step's: the rows past the step's tokens are
padding, computed from whatever the persistent buffers held (an attention output no request wrote, NaN
included). A flight recorder's check over every row would fire on them — measured: a served gpt-oss whose padding
rows 6–7 of an 8-row graph came into layer 0's MoE as NaN, with no fault anywhere (``tools/gpu/RUNBOOK.md``,
twentieth session). The graph's kernels cannot ask the host, but the model runner rewrites a device buffer before
every step: ``query_start_loc`` (``max_num_reqs + 1`` int32, vLLM's GPU model runner), whose entries past the
step's last request are filled with the step's token count, so its *last* entry is that count at every replay.

:func:`token_count` finds that buffer while a graph is being captured: the capture runs inside the runner's own
dummy run, so one of the calling frames is a method of the runner (``self`` with a ``query_start_loc`` whose
``gpu`` is a 1-D int32 tensor on the call's device). Found once per captured layer call, at capture; nothing per
replay. Where it is not found (another runner, a vLLM that names it otherwise) the check covers every row, as
before, and the recorder counts the launch in ``flight_graph_rows_unknown``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

MAX_FRAMES = 64
"""Calling frames looked at (a capture is ~30 frames below the runner's dummy run)."""


def _buffer(owner: Any, device: torch.device) -> torch.Tensor | None:
    holder = getattr(owner, "query_start_loc", None)
    tensor = getattr(holder, "gpu", None)
    if (
        isinstance(tensor, torch.Tensor)
        and tensor.dtype == torch.int32
        and tensor.dim() == 1
        and tensor.numel() >= 2
        and tensor.device == device
        and tensor.is_contiguous()
    ):
        return tensor
    return None


def token_count(device: torch.device, *, frame: Any = None) -> torch.Tensor | None:
    """A one-element view of the model runner's token count for ``device`` (see the module docstring), or
    ``None``. ``frame``: where to start looking (default: the caller's)."""
    current = frame if frame is not None else sys._getframe(1)
    for _ in range(MAX_FRAMES):
        if current is None:
            return None
        owner = current.f_locals.get("self")
        if owner is not None:
            try:
                tensor = _buffer(owner, device)
            except Exception:  # an object whose attributes raise: not the runner
                tensor = None
            if tensor is not None:
                return tensor[-1:]
        current = current.f_back
    return None


def row_elements(output: torch.Tensor) -> int | None:
    """Elements one token's row of a layer call's output holds (``[tokens, …]``, contiguous), or ``None``."""
    if output.dim() < 2 or output.shape[0] == 0 or not output.is_contiguous():
        return None
    return output.numel() // output.shape[0]
