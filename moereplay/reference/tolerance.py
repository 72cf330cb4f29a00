"""Error allowances for kernels that round partial sums to a 16-bit type: split-K with atomics, 16-bit reductions.

A kernel that splits the reduction dimension K across thread blocks and combines the partial sums in the output's
16-bit type rounds each element several times, not once: Marlin's ``use_atomic_add`` rounds every block's partial
sum to the output type and adds it atomically (another rounding per add, in an order that varies between runs);
``use_fp32_reduce=False`` passes the running sum between the blocks of a slice through the 16-bit output. That is
the documented precision trade of those modes, so a comparison must allow for it — and for no more than it.

The model (round to nearest, unit roundoff ``u``: 2⁻⁸ bf16, 2⁻¹¹ fp16; each rounding of ``x`` errs by at most
``u·|x|`` plus half the smallest subnormal). Split K into the ``T`` tiles of the kernel's smallest K tile and let
``q_t`` be tile ``t``'s exact partial product (for one output element). A block's partial sum ``p_i`` covers whole
tiles, so ``Σ_i |p_i| ≤ Σ_t |q_t|`` (*total*); every partial or running sum is a sum of a subset of the ``q_t``, so
its magnitude is at most ``max(Σ q_t⁺, Σ q_t⁻)`` (*subset*). With at most ``s`` blocks per slice (``s ≤ T``: each
block takes at least one tile):

- atomics: ``s`` partials rounded, ``s − 1`` additions rounded → ``|error| ≤ u·(total + (s − 1)·subset)``;
- 16-bit reduction: ``s − 1`` running sums rounded → ``|error| ≤ u·(s − 1)·subset``;

times the row's coefficient (routing weight, scales applied after the sum), plus the rounding of the final value,
which the dtype's :class:`~moereplay.reference.compare.Tolerance` already covers. :func:`compare` subtracts the
allowance from each element's error before judging it, so a wrong coefficient or a zeroed row still fails wherever
its error exceeds the rounding bound (the bound is far below a row's magnitude unless K is split into many tiles
whose partial sums cancel). Cost: :func:`split_k_magnitudes` is one extra float32 product of the same size as the
reference's, done tile-batched; only variants in these modes pay it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from moereplay.errors import ReferenceError_
from moereplay.reference.compare import Tolerance, profile_for
from moereplay.reference.marlin_moe import exact_fp32_matmul

#: Unit roundoff (half an ulp at 1) and half the smallest subnormal of the 16-bit types partial sums are kept in.
_ROUNDING: dict[torch.dtype, tuple[float, float]] = {
    torch.bfloat16: (2.0**-8, 2.0**-134),
    torch.float16: (2.0**-11, 2.0**-25),
    torch.float32: (2.0**-24, 2.0**-150),
}
_CHUNK_ELEMENTS = 1 << 25  # float32 elements of tile partials alive at once (128 MiB)


def op_error_allowance(
    op: object, args: Mapping[str, Any], reference: Any, output_dtype: torch.dtype
) -> ErrorAllowance | None:
    """The op's ``error_allowance(args, reference, output_dtype)`` when it declares one (optional in the OpSpec
    protocol), else ``None``: judge by the dtype's tolerance alone."""
    hook = getattr(op, "error_allowance", None)
    if hook is None:
        return None
    allowance = hook(args, reference, output_dtype)
    if allowance is not None and not isinstance(allowance, ErrorAllowance):
        raise ReferenceError_(f"error_allowance returned {type(allowance).__name__}, not an ErrorAllowance")
    return allowance


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u`` of ``dtype``: rounding ``x`` to it errs by at most ``u·|x|`` (normal range)."""
    return _rounding(dtype)[0]


def _rounding(dtype: torch.dtype) -> tuple[float, float]:
    try:
        return _ROUNDING[dtype]
    except KeyError as error:
        raise ReferenceError_(f"no rounding model for partial sums in {dtype}") from error


@dataclass(frozen=True, eq=False)
class ErrorAllowance:
    """An absolute error each output element may show beyond its dtype's relative tolerance.

    ``absolute``: float32 ``[rows, cols]`` (the compared ``[rows, cols]`` view), finite and ≥ 0. ``label``: what
    it allows for, in a few words (it becomes part of the tolerance's name); ``cause``: the launch mode behind it
    (``"atomic add"``). ``roundings``: the most 16-bit roundings of partial sums an element undergoes.
    ``order_dependent``: the reduction order varies between runs (atomics), so repeats may differ within the
    allowance.
    """

    absolute: torch.Tensor
    cause: str
    label: str
    roundings: int
    order_dependent: bool

    def __post_init__(self) -> None:
        if self.absolute.dim() != 2:
            raise ReferenceError_("an error allowance is [rows, cols]")
        if self.roundings < 0:
            raise ReferenceError_("roundings must be >= 0")

    def profile(self, dtype: torch.dtype) -> Tolerance:
        """The dtype's tolerance, renamed to say it is judged beyond this allowance."""
        base = profile_for(dtype)
        return dataclasses.replace(
            base,
            name=f"{base.name}+{self.label}",
            rationale=f"{base.rationale}; plus, per element, the rounding bound of {self.label}",
        )


@dataclass(frozen=True, eq=False)
class SplitKMagnitudes:
    """Per element of ``x @ weight``: ``total`` = ``Σ_t |q_t|`` and ``subset`` = ``max(Σ q_t⁺, Σ q_t⁻)`` over the
    exact partial products ``q_t`` of the ``tiles`` K tiles (float32 ``[rows, cols]``)."""

    total: torch.Tensor
    subset: torch.Tensor
    tiles: int


def split_k_magnitudes(x: torch.Tensor, weight: torch.Tensor, tile_k: int) -> SplitKMagnitudes:
    """Tile partial products of ``x [rows, K] @ weight [K, cols]`` in float32 (no TF32), K in tiles of ``tile_k``
    (which must divide K), reduced to :class:`SplitKMagnitudes`. Holds at most ~2²⁵ partials at once."""
    rows, size_k = x.shape
    if weight.dim() != 2 or weight.shape[0] != size_k:
        raise ReferenceError_(f"cannot multiply {tuple(x.shape)} by {tuple(weight.shape)}")
    if tile_k < 1 or size_k % tile_k:
        raise ReferenceError_(f"tile_k={tile_k} does not divide K={size_k}")
    cols = weight.shape[1]
    tiles = size_k // tile_k
    device = x.device
    total = torch.zeros((rows, cols), dtype=torch.float32, device=device)
    positive = torch.zeros_like(total)
    negative = torch.zeros_like(total)
    if rows == 0 or cols == 0 or tiles == 0:
        return SplitKMagnitudes(total, total.clone(), tiles)
    x_tiles = x.to(torch.float32).reshape(rows, tiles, tile_k).transpose(0, 1)  # [tiles, rows, tile_k]
    w_tiles = weight.to(torch.float32).reshape(tiles, tile_k, cols)
    step = max(1, _CHUNK_ELEMENTS // max(1, rows * cols))
    with exact_fp32_matmul():
        for start in range(0, tiles, step):
            partials = torch.bmm(x_tiles[start : start + step], w_tiles[start : start + step])
            total += partials.abs().sum(dim=0)
            positive += partials.clamp(min=0).sum(dim=0)
            negative -= partials.clamp(max=0).sum(dim=0)
    return SplitKMagnitudes(total, torch.maximum(positive, negative), tiles)


def split_k_allowance(
    total: torch.Tensor,
    subset: torch.Tensor,
    *,
    slices: int,
    atomic: bool,
    dtype: torch.dtype,
    coefficient: torch.Tensor | None = None,
) -> torch.Tensor:
    """The absolute rounding bound of the module docstring, float32 ``[rows, cols]``.

    ``total`` / ``subset``: :class:`SplitKMagnitudes` fields (plus anything else summed into a partial, e.g.
    ``|bias|``). ``slices``: the most blocks sharing one output element's K range. ``atomic``: partials rounded and
    added with atomics (else: running sums passed through ``dtype``). ``coefficient``: per-row factor applied
    after the sum (non-finite entries give 0: such rows are judged by the dtype's tolerance alone).
    """
    if slices < 1:
        raise ReferenceError_(f"slices={slices} must be >= 1")
    unit, tiny = _rounding(dtype)
    roundings = roundings_of(slices, atomic=atomic)
    bound = subset.to(torch.float32) * ((slices - 1) * unit)
    if atomic:
        bound = bound + total.to(torch.float32) * unit
    if coefficient is not None:
        factor = coefficient.to(device=bound.device, dtype=torch.float32).abs().reshape(-1, 1)
        factor = torch.where(torch.isfinite(factor), factor, torch.zeros_like(factor))
        bound = bound * factor + roundings * tiny * factor.clamp(min=1.0)
    else:
        bound = bound + roundings * tiny
    return torch.where(torch.isfinite(bound), bound, torch.zeros_like(bound))


def roundings_of(slices: int, *, atomic: bool) -> int:
    """16-bit roundings of partial sums per element beyond the final one: ``2s − 1`` with atomics, ``s − 1`` with
    a 16-bit reduction."""
    return 2 * slices - 1 if atomic else slices - 1
