"""Where two outputs of one call differ, element by element, and by how many units in the last place (ULPs).

Two questions use it: is the replay the recording, byte for byte (the fidelity check, :mod:`moereplay.replay.fidelity`),
and which elements change with the guard fill (the memory-dependence finding). Only the rows a correct kernel writes
are compared; elements are compared by their bytes, so NaN payloads and signed zeros count.

ULPs: the distance between two values of the output dtype counted in representable values — for a float dtype
the difference of their sign-magnitude bit patterns laid on one integer line (``+0`` and ``-0`` are 0 apart; a NaN
against anything else is infinitely far), for an integer dtype the difference of the values. Cost: a few
elementwise passes over the output, on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moereplay.ops.base import RowMap
from moereplay.reference.compare import aligned
from moereplay.replay.findings import row_ranges

_SIGNED_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _matrix(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous().reshape(rows, -1)


def _byte_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``[rows, cols, itemsize]`` bytes of a ``[rows, cols]`` matrix (bit patterns, NaN payloads included)."""
    return tensor.view(torch.uint8).reshape(tensor.shape[0], tensor.shape[1], -1)


def _ordered(values: torch.Tensor) -> torch.Tensor | None:
    """int64 keys whose differences count representable values between elements; ``None`` for dtypes without an
    order (complex)."""
    dtype = values.dtype
    if dtype == torch.bool or not (dtype.is_floating_point or dtype.is_complex):
        return values.to(torch.int64)
    if dtype.is_complex:
        return None
    if dtype == torch.float8_e8m0fnu:  # exponent only, no sign: the byte is the order
        return values.view(torch.uint8).to(torch.int64)
    bits = values.view(_SIGNED_VIEW[dtype.itemsize]).to(torch.int64)
    magnitude = bits & ((1 << (8 * dtype.itemsize - 1)) - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


def _nan(values: torch.Tensor) -> torch.Tensor:
    if values.dtype.is_floating_point:
        return torch.isnan(values.float())
    return torch.zeros(values.shape, dtype=torch.bool)


@dataclass(frozen=True, eq=False)
class ElementDifference:
    """Where ``a`` and ``b`` differ. ``mask``: bool ``[rows, cols]`` (CPU), the elements whose bytes differ in
    written rows; ``max_ulp``: the largest distance among them (``inf`` when a NaN faces a number, ``nan`` when
    the dtype has no order, 0 when nothing differs); ``worst``: (row, column) of that element; ``nan_mismatch``:
    differing elements where one side is NaN; ``dtype``: the outputs' dtype."""

    mask: torch.Tensor
    max_ulp: float
    worst: tuple[int, int] | None
    nan_mismatch: int
    dtype: torch.dtype

    @property
    def elements(self) -> int:
        return int(self.mask.sum())

    @property
    def same(self) -> bool:
        return self.elements == 0

    @property
    def rows(self) -> tuple[int, ...]:
        return tuple(int(r) for r in torch.nonzero(self.mask.any(dim=1)).flatten().tolist())

    @property
    def columns(self) -> tuple[int, int] | None:
        columns = torch.nonzero(self.mask.any(dim=0)).flatten()
        return None if columns.numel() == 0 else (int(columns[0]), int(columns[-1]))

    def ulp_text(self) -> str:
        """``"3 ULP of bfloat16"`` / ``"a NaN against a number"``."""
        name = str(self.dtype).removeprefix("torch.")
        if math.isinf(self.max_ulp):
            return "a NaN against a number"
        if math.isnan(self.max_ulp):
            return f"(no ULP order for {name})"
        return f"{self.max_ulp:.0f} ULP of {name}"


def element_difference(a: torch.Tensor, b: torch.Tensor, written: torch.Tensor) -> ElementDifference:
    """Element differences between two outputs of one call (shapes equal up to leading dimensions of 1, one
    dtype); a dtype or shape mismatch marks every written element as differing."""
    rows = int(written.numel())
    left = _matrix(a, rows)
    written_cpu = written.detach().to("cpu", torch.bool).reshape(-1)
    shaped = aligned(b, a.shape)
    if shaped is None or shaped.dtype != a.dtype:
        mask = written_cpu[:, None].expand(left.shape).clone()
        return ElementDifference(mask, math.inf, None, 0, a.dtype)
    right = _matrix(shaped, rows)
    mask = (_byte_rows(left) != _byte_rows(right)).any(dim=-1) & written_cpu[:, None]
    if not bool(mask.any()):
        return ElementDifference(mask, 0.0, None, 0, a.dtype)
    nan_left, nan_right = _nan(left), _nan(right)
    one_nan = (nan_left ^ nan_right) & mask
    keys_left, keys_right = _ordered(left), _ordered(right)
    if keys_left is None or keys_right is None:
        distance = torch.full(left.shape, math.nan, dtype=torch.float64)
    else:
        distance = (keys_left - keys_right).abs().to(torch.float64)
    distance = torch.where(nan_left | nan_right, torch.full_like(distance, math.inf), distance)
    distance = torch.where(mask, distance, torch.zeros_like(distance))
    worst_flat = int(torch.argmax(torch.nan_to_num(distance, nan=0.0, posinf=math.inf)))
    worst = (worst_flat // left.shape[1], worst_flat % left.shape[1])
    largest = float(distance.reshape(-1)[worst_flat])
    if keys_left is None:
        largest = math.nan
    return ElementDifference(mask, largest, worst, int(one_nan.sum()), a.dtype)


def places(difference: ElementDifference, rows: RowMap | None) -> tuple[str, dict[str, list[int]]]:
    """What the differing rows are, in the op's terms: ``("tokens 3-5; experts 31; blocks 44-45", {...})``."""
    if rows is None or difference.same:
        return "", {}
    index = torch.tensor(difference.rows, dtype=torch.long)
    parts: list[str] = []
    evidence: dict[str, list[int]] = {}
    for label, values in (("tokens", rows.token), ("experts", rows.expert), ("blocks", rows.block)):
        picked = sorted(
            {int(v) for v in values.detach().to("cpu", torch.long)[index].tolist() if int(v) >= 0}
        )
        if picked:
            parts.append(f"{label} {row_ranges(picked, limit=8)}")
            evidence[label] = picked
    return "; ".join(parts), evidence


def describe(difference: ElementDifference, rows: RowMap | None) -> str:
    """``"960 of 737280 elements in rows 241-255 (experts 31; …), columns 2816-2879; max 3 ULP of bfloat16 (row
    250 (token 61, slot 2, expert 31), column 2817)"``."""
    total = int(difference.mask.numel())
    where, _ = places(difference, rows)
    text = f"{difference.elements} of {total} elements in rows {row_ranges(difference.rows)}"
    if where:
        text += f" ({where})"
    columns = difference.columns
    if columns is not None:
        text += (
            f", columns {columns[0]}-{columns[1]}" if columns[0] != columns[1] else f", column {columns[0]}"
        )
    text += f"; max {difference.ulp_text()}"
    if difference.worst is not None:
        row, column = difference.worst
        at = rows.describe(row) if rows is not None and 0 <= row < rows.rows else f"row {row}"
        text += f" (at {at}, column {column})"
    if difference.nan_mismatch:
        text += f"; {difference.nan_mismatch} NaN where the other has a number"
    return text
