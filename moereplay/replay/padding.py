"""Rows of a CUDA-graph batch's padding: computed by the kernel, discarded by vLLM, not judged by a replay.

vLLM replays a CUDA graph captured for a batch size at least the step's, so a graph-replayed layer call runs on
``graph_batch`` rows of which only the first ``graph_tokens`` are the step's tokens; the rest are computed from
whatever the persistent buffers held — NaN included — and thrown away. The layer-scope flight recorder reads the
replay's token count on the device and writes both numbers into the context of a graph-kept call
(:mod:`moereplay.capture.flight_graph`); ``moereplay expand`` gives them to the kernel calls it regenerates.

A replay of such a call leaves the padding's output rows out of everything it judges — the comparison with the
exact reference, NaN/Inf counts and findings, the bit-exact test, ``bisect --nonfinite`` — and says so in a note:
NaN in a padding row is not the call's fault and never reached a user. Which output rows are padding is the op's
to say (its ``layer_tokens`` hook: the layer token of each output row, from the reference's row map); where it
cannot, every row is judged and the note says that instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from moereplay.ops.base import Args, OpSpec, RowMap, layer_tokens
from moereplay.wording import row_ranges


@dataclass(frozen=True)
class Padding:
    """A graph-replayed call's padded batch: ``tokens`` real of ``batch``."""

    tokens: int
    batch: int

    def rows(self, op: OpSpec, args: Args, rows: RowMap) -> torch.Tensor | None:
        """bool ``[rows]``: the output rows that belong to padding tokens (None: the op cannot say)."""
        token = layer_tokens(op, args, rows, self.batch)
        if token is None:
            return None
        return token.cpu() >= self.tokens

    def note(self, padding: torch.Tensor | None) -> str:
        """What a replay says about it, given :meth:`rows`' answer."""
        batch = f"the CUDA graph ran a batch of {self.batch} tokens for the step's {self.tokens}"
        if padding is None:
            return f"{batch}; this op cannot say which output rows are padding, so every row is judged"
        count = int(padding.sum())
        if not count:
            return f"{batch}; no output row of this call belongs to a padding token"
        where = row_ranges(torch.nonzero(padding).flatten().tolist())
        rows = f"output row {where}" if count == 1 else f"output rows {where} ({count} of {padding.numel()})"
        tokens = (
            f"padding token {self.tokens}"
            if self.batch - self.tokens == 1
            else f"padding tokens {self.tokens}-{self.batch - 1}"
        )
        verb = "belongs" if count == 1 else "belong"
        return f"{batch}: {rows} {verb} to {tokens} and {'is' if count == 1 else 'are'} not judged (vLLM discards them)"


def padding_of(context: Mapping[Any, Any]) -> Padding | None:
    """The padded batch a call's context records (``graph_tokens`` of ``graph_batch``), or None: not recorded,
    not a padded batch, or values that make no sense (a hostile file is ignored, not trusted)."""
    tokens, batch = context.get("graph_tokens"), context.get("graph_batch")
    if type(tokens) is not int or type(batch) is not int:
        return None
    if not 0 < tokens < batch:
        return None
    return Padding(tokens, batch)
