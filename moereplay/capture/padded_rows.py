"""How many rows of a graph-replayed layer call are real: the step's token count, where the device can read it.

vLLM replays a CUDA graph captured for a batch size at least the step's: the rows past the step's tokens are
padding, computed from whatever the persistent buffers held (an attention output no request wrote, NaN
included). A flight recorder's check over every row would fire on them — measured: a served gpt-oss whose padding
rows 6–7 of an 8-row graph came into layer 0's MoE as NaN, with no fault anywhere (``tools/gpu/RUNBOOK.md``,
twentieth session). The graph's kernels cannot ask the host, but the model runner rewrites a device buffer before
every step it prepares: ``query_start_loc`` (``max_num_reqs + 1`` int32, vLLM's GPU model runner), whose entries
past the step's last request are filled with the step's token count, so its *last* entry is that count when the
graph replays. (A data-parallel rank's idle dummy batch does not rewrite it: the count is then the last real
step's, and the check covers that many rows.)

:func:`token_count` finds that buffer while a graph is being captured in the runner's own dummy run: one of the
calling frames is a method of the runner (``self`` with a ``query_start_loc`` whose ``gpu`` is a 1-D int32 tensor
on the call's device). Found once per captured layer call, at capture; nothing per replay. It is used only where
the count means the checked output's rows (:func:`limits_rows`): a 2-D output with one row per token of the
padded batch being captured (``BatchDescriptor.num_tokens``). A data-parallel all-gather, sequence-parallel
chunks, a ``[experts, tokens, hidden]`` output or a kernel call's ``[tokens · top_k, N]`` output do not qualify;
neither does a draft model's graph (captured below the runner, its real rows are not the step's count). Where
the count does not apply, or is not found (another runner, a capture on another thread), every row is checked,
as before, and the recorder counts the launch in ``flight_graph_rows_unknown``.
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
    ``None`` — also when the capture runs inside the runner's draft model (a frame below the runner whose
    ``self`` is the runner's ``drafter``). ``frame``: where to start looking (default: the caller's)."""
    current = frame if frame is not None else sys._getframe(1)
    below: list[Any] = []
    for _ in range(MAX_FRAMES):
        if current is None:
            return None
        owner = current.f_locals.get("self")
        if owner is not None:
            try:
                tensor = _buffer(owner, device)
                drafter = getattr(owner, "drafter", None) if tensor is not None else None
            except Exception:  # an object whose attributes raise: not the runner
                tensor = drafter = None
            if tensor is not None:
                if drafter is not None and any(seen is drafter for seen in below):
                    return None
                return tensor[-1:]
            below.append(owner)
        current = current.f_back
    return None


def batch_tokens() -> int | None:
    """The padded token count of the batch vLLM is running (or capturing) now, from its forward context's
    ``BatchDescriptor``; ``None`` outside vLLM or a forward pass."""
    module = sys.modules.get("vllm.forward_context")  # not loaded: no forward context (nothing imported here)
    if module is None:
        return None
    try:
        if not module.is_forward_context_available():
            return None
        descriptor = getattr(module.get_forward_context(), "batch_descriptor", None)
    except Exception:
        return None
    tokens = getattr(descriptor, "num_tokens", None)
    return tokens if isinstance(tokens, int) and tokens > 0 else None


def limits_rows(output: torch.Tensor, tokens: int | None) -> int | None:
    """Elements of one token's row of ``output`` when its rows are the ``tokens`` of the padded batch (a 2-D
    contiguous ``[tokens, hidden]``), else ``None``: the step's count says nothing about its rows."""
    if tokens is None or output.dim() != 2 or output.shape[0] != tokens or not output.is_contiguous():
        return None
    return output.numel() // tokens
