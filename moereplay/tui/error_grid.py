"""What the heat map and the diff view colour: each element's relative error, binned into a grid.

The element error is :func:`moereplay.reference.compare.compare`'s — ``|actual − reference|`` (minus the variant's
rounding allowance, when its launch rounds partial sums to 16 bits and the replay judged it beyond that bound) over
``max(row_scale, |reference|)`` with compare's own per-row scale — so a cell is red exactly where the replay's
comparison found the output bad. :class:`ErrorField` holds that per element (plus NaN / Inf / large-value masks);
:meth:`ErrorField.grid` reduces it to ``[rows, column blocks]`` maxima and counts for the heat map. Cost: a few
elementwise float32 passes over the output after compare's own (milliseconds for ``[128, 2880]``), done once per
variant, in a worker.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from moereplay.tui.replays import VariantTensors

LARGE_RELATIVE_ERROR = 100.0
"""An element this many row scales away from its reference is marked *large* (a blown-up value, not rounding)."""

Marker = Literal["nan", "inf", "large"]


def _classes(values: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 NaN, 2 +Inf, 3 −Inf, as compare classifies elements."""
    classes = torch.zeros(values.shape, dtype=torch.int8)
    classes[torch.isnan(values)] = 1
    classes[torch.isposinf(values)] = 2
    classes[torch.isneginf(values)] = 3
    return classes


@dataclass(frozen=True, eq=False)
class ErrorField:
    """Per-element errors of one variant's output (``[rows, cols]``, float32 / bool, CPU).

    ``relative``: the relative error where both values are finite, ``inf`` where actual and reference disagree on
    NaN / Inf, 0 in rows the kernel does not write. ``nan`` / ``inf``: the output is NaN / ±Inf where the
    reference is finite. ``tolerance``: compare's max-relative bound for the output dtype.
    """

    relative: torch.Tensor
    nan: torch.Tensor
    inf: torch.Tensor
    written: torch.Tensor
    tolerance: float
    tolerance_name: str

    @classmethod
    def of(cls, tensors: VariantTensors) -> ErrorField:
        from moereplay.errors import ReferenceError_
        from moereplay.reference.compare import compare, profile_for

        actual = tensors.output
        reference = tensors.reference
        written = tensors.written.to(torch.bool).reshape(-1)
        try:
            profile = profile_for(actual.dtype)
        except ReferenceError_:  # an output dtype without a profile: judge it as fp32
            profile = profile_for(torch.float32)
        allowance = tensors.allowance
        if allowance is not None and tuple(allowance.shape) != tuple(reference.shape):
            allowance = None  # not this view's: colour by the dtype's tolerance alone
        if allowance is not None and tensors.allowance_label:  # the replay judged beyond the rounding bound
            profile = dataclasses.replace(profile, name=f"{profile.name}+{tensors.allowance_label}")
        comparison = compare(actual, reference, rows_mask=written, profile=profile, allowance=allowance)
        act = actual.to(torch.float32)
        ref = reference.to(torch.float32)
        rows_mask = written[:, None].expand_as(ref)
        act_finite, ref_finite = torch.isfinite(act), torch.isfinite(ref)
        both = act_finite & ref_finite & rows_mask
        scale = comparison.row_scale.to(torch.float32)[:, None]
        denominator = torch.maximum(scale, ref.abs().nan_to_num(posinf=0.0, neginf=0.0))
        error = (act - ref).abs()
        if allowance is not None:  # as compare judges it: only the error beyond the allowance counts
            error = (error - allowance.to(torch.float32)).clamp_min(0.0)
        relative = torch.where(both, error / denominator, torch.zeros_like(ref))
        disagree = rows_mask & (_classes(act) != _classes(ref))
        relative = torch.where(disagree, torch.full_like(relative, math.inf), relative)
        return cls(
            relative=relative.to(torch.float32),
            nan=torch.isnan(act) & ref_finite & rows_mask,
            inf=torch.isinf(act) & ref_finite & rows_mask,
            written=written,
            tolerance=profile.max_rel,
            tolerance_name=profile.name,
        )

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.relative.shape[0]), int(self.relative.shape[1]))

    def bad(self) -> torch.Tensor:
        """Elements over the tolerance (bool ``[rows, cols]``)."""
        return self.relative > self.tolerance

    def first_bad(self) -> tuple[int, int] | None:
        """Row-major first element over the tolerance."""
        found = torch.nonzero(self.bad().reshape(-1))
        if found.numel() == 0:
            return None
        row, col = divmod(int(found[0]), self.shape[1])
        return row, col

    def marker(self, row: int, col: int) -> Marker | None:
        if bool(self.nan[row, col]):
            return "nan"
        if bool(self.inf[row, col]):
            return "inf"
        if float(self.relative[row, col]) >= LARGE_RELATIVE_ERROR:
            return "large"
        return None

    def grid(self, block: int) -> ErrorGrid:
        """Maxima and marker counts over ``[rows, ceil(cols / block)]`` blocks of ``block`` columns."""
        rows, cols = self.shape
        block = max(1, min(block, max(cols, 1)))
        blocks = max(1, -(-cols // block))
        pad = blocks * block - cols

        def binned(values: torch.Tensor, reduce: Literal["max", "sum"]) -> torch.Tensor:
            padded = torch.nn.functional.pad(values, (0, pad)) if pad else values
            shaped = padded.reshape(rows, blocks, block)
            return shaped.amax(dim=2) if reduce == "max" else shaped.sum(dim=2)

        large = (self.relative >= LARGE_RELATIVE_ERROR) & torch.isfinite(self.relative)
        return ErrorGrid(
            block=block,
            cols=cols,
            maximum=binned(self.relative, "max"),
            nan=binned(self.nan.to(torch.int32), "sum"),
            inf=binned(self.inf.to(torch.int32), "sum"),
            large=binned(large.to(torch.int32), "sum"),
            written=self.written,
            tolerance=self.tolerance,
        )


@dataclass(frozen=True, eq=False)
class ErrorGrid:
    """The heat map's data: per row and per block of ``block`` columns, the maximum relative error and counts of
    NaN, Inf and large elements (``[rows, blocks]`` tensors), and the per-row / per-block maxima."""

    block: int
    cols: int
    maximum: torch.Tensor
    nan: torch.Tensor
    inf: torch.Tensor
    large: torch.Tensor
    written: torch.Tensor
    tolerance: float

    @property
    def rows(self) -> int:
        return int(self.maximum.shape[0])

    @property
    def blocks(self) -> int:
        return int(self.maximum.shape[1])

    def columns(self, block: int) -> tuple[int, int]:
        """Inclusive column range of ``block``."""
        first = block * self.block
        return first, min(self.cols, first + self.block) - 1

    def marker(self, row: int, block: int) -> Marker | None:
        if int(self.nan[row, block]):
            return "nan"
        if int(self.inf[row, block]):
            return "inf"
        if int(self.large[row, block]):
            return "large"
        return None

    def row_maximum(self) -> torch.Tensor:
        return self.maximum.amax(dim=1) if self.blocks else torch.zeros(self.rows)

    def block_maximum(self) -> torch.Tensor:
        return self.maximum.amax(dim=0) if self.rows else torch.zeros(self.blocks)
