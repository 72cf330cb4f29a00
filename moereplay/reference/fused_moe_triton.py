"""Exact fp32 reference for vLLM 0.25.1's Triton fused MoE kernels, needing no kernel.

Facts, from ``vllm/model_executor/layers/fused_moe/fused_moe.py`` (0.25.1): ``fused_moe_kernel`` (launched by
``invoke_fused_moe_triton_kernel``) and ``fused_moe_kernel_gptq_awq`` (by ``invoke_fused_moe_wna16_triton_kernel``).

Both kernels, one launch:

- ``C`` is ``[M, top_k, N]``; its rows are addressed flat, ``C.stride(1)`` apart: output row ``id`` is
  ``C[id // top_k, id % top_k]``. ``num_valid_tokens = A.size(0) · top_k``.
- The grid covers ``cdiv(EM, BLOCK_SIZE_M)`` blocks, ``EM = len(sorted_token_ids)`` — or, when ``A.size(0) <
  BLOCK_SIZE_M``, ``min(EM, A.size(0) · top_k · BLOCK_SIZE_M)``. A block ``b`` with ``b · BLOCK_SIZE_M >=
  num_tokens_post_padded[0]`` returns at once. Otherwise it reads ``BLOCK_SIZE_M`` ids
  ``sorted_token_ids[b·BM : (b+1)·BM]``; an id ``< num_valid_tokens`` is a row it writes (the padding vLLM writes is
  ``numel``, masked). Without ``sorted_token_ids`` (the "naive block assignment", ``fused_moe_kernel`` only) block
  ``b`` writes row ``b`` alone.
- The block's expert is ``expert_ids[b]``; ``-1`` (an expert of another expert-parallel rank) writes zeros.
- Row ``id`` reads activation row ``id // top_k`` (gemm2 passes pre-expanded rows with ``top_k = 1``).
- ``B`` is ``[E, N, K]`` (``fused_moe_kernel``) and the product is ``A[row] · B[e]ᵀ``, accumulated in float32.
- With ``MUL_ROUTED_WEIGHT`` the row is multiplied by ``topk_weights`` at flat index ``id`` from its data pointer
  (the host asserts ``stride(1) == 1`` only), in float32, after bias and dequantisation; then cast to
  ``compute_type`` and stored.

``fused_moe_kernel`` quantisation modes (strides as the launcher passes them: a scale's stride is 0 along a
dimension it lacks — a 1-D per-token ``A_scale`` is read at element 0 for every row):

- unquantised (bf16/fp16/fp32): ``A_scale`` and ``B_scale`` must be ``None`` (host assert);
- ``use_int8_w8a16``: int8 ``B``, ``acc · B_scale[e, n]``;
- ``use_fp8_w8a8`` / ``use_int8_w8a8``, by ``block_shape = [group_n, group_k]`` (both > 0): per-block scales,
  ``A_scale[row, k // group_k]`` and ``B_scale[e, n // group_n, k // group_k]`` (the launcher clamps
  ``BLOCK_SIZE_K`` to ``min(block_shape)`` so a K block never straddles two scale groups);
  else ``per_channel_quant``: ``A_scale[row]`` (stride 0 of a 2-D ``[M, 1]``) and ``B_scale[e, n]``;
  else per tensor: ``A_scale`` element 0 and ``B_scale`` element ``e``;
- ``B_bias[e, n]`` is added after the scales.

``fused_moe_kernel_gptq_awq`` (int4/int8 weight-only, ``block_shape = [0, group_size]``):

- int4: ``B`` is ``[E, N, K / 2]`` bytes, weight ``(n, k)`` is nibble ``k % 2`` (low first) of ``B[e, n, k // 2]``;
  int8: ``B[e, n, k]`` as stored;
- zero point: ``B_zp`` (int4: ``[E, N / 2, K / group]``, nibble ``n % 2`` of ``B_zp[e, n // 2, g]``; int8:
  ``B_zp[e, n, g]``), or without one 8 (int4) / 128 (int8);
- scale ``B_scale[e, n, k // group_size]``; the weight ``(q − zp) · scale`` is computed in float32 and **rounded to
  compute_type** before the dot — part of what the kernel means, so the reference rounds it too;
- no bias.

The reference does that arithmetic in float32 (dequantised operands, no TF32) for the rows a correct kernel
writes, and reports what each row is made of so findings can decompose a wrong output. It runs on the inputs'
device: the rows are grouped by expert on the host (the routing arrays are read back once), the activation rows
gathered once, only the used experts' weights converted (one pass per run of consecutive experts, at most
:data:`DENSE_ELEMENTS_AT_ONCE` elements at a time). On the CPU each used expert's rows are one float32 matmul — the
same product, bit for bit, a loop over experts computes (:mod:`moereplay.reference.expert_groups`); on a GPU the
experts are bucketed by row count and each bucket is one batched float32 product
(:func:`moereplay.reference.expert_groups.batched_matmul_into`: the same dot products, summed in the batched
kernel's order, within float32 rounding of the loop's). No host sync inside either. Cost: ``rows · K · N``
multiply-adds (GPU: up to 16 padding rows per expert, free at these sizes) plus one conversion pass over the used
experts' weights — on a GPU with Triton, quantised weights are dequantised in that one pass by a kernel
(:mod:`moereplay.reference.dequant_dense`: the same bits as the torch passes the CPU makes). On an H200 at
Qwen3-30B-A3B gemm1 shapes (64 tokens) the reference takes 8.1× the kernel in bf16 and 5.0× in int4 g128, and 9.5×
for DeepSeek-V3 fp8 block-128 (``tools/bench/reference_bench.py``, 2026-12-04; with the torch passes 11.5× and
16.6×).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from moereplay.errors import ReferenceError_
from moereplay.reference import dequant_dense
from moereplay.reference.dequant_dense import QuantizedWeights
from moereplay.reference.expert_groups import (
    BATCHED_DEVICE_TYPES,
    batched_matmul_into,
    expert_runs,
    gather_experts,
    group_by_expert,
    matmul_into,
)
from moereplay.reference.marlin_moe import exact_fp32_matmul

COMPUTE_TYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
"""``compute_type`` by its canonical name (what the codec decodes ``tl.bfloat16`` etc. to)."""


@dataclass(frozen=True)
class TritonMoeRows:
    """Which rows a launch writes. ``row``/``expert``/``block`` are int64 ``[R]`` (``expert`` -1: written as
    zeros); rows of ``[0, num_valid_tokens)`` absent here are not written."""

    row: torch.Tensor
    expert: torch.Tensor
    block: torch.Tensor
    num_valid_tokens: int


@dataclass(frozen=True)
class TritonMoeResult:
    """One launch's exact answer: ``output`` fp32 ``[num_valid_tokens, N]`` (zeros where not written), ``written``
    bool, ``gemm`` the dequantised product, ``bias_rows`` the bias term (or ``None``), ``row_weights`` the
    coefficient each written row gets (its routing weight with ``mul_routed_weight``, else 1; 0 for zero rows),
    ``expert`` / ``block`` per row (-1: not written or zeroed)."""

    output: torch.Tensor
    written: torch.Tensor
    gemm: torch.Tensor
    bias_rows: torch.Tensor | None
    row_weights: torch.Tensor
    expert: torch.Tensor
    block: torch.Tensor
    weight_index: torch.Tensor


def compute_dtype(value: Any) -> torch.dtype:
    """``compute_type`` in any recorded form: a canonical name, a triton dtype name (``bf16``), a torch dtype."""
    if isinstance(value, torch.dtype):
        return value
    text = str(getattr(value, "name", value)).removeprefix("torch.")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    text = aliases.get(text, text)
    if text not in COMPUTE_TYPES:
        raise ReferenceError_(f"compute_type {value!r} is not bf16, fp16 or fp32")
    return COMPUTE_TYPES[text]


def _strided(tensor: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...], what: str) -> torch.Tensor:
    """``tensor``'s storage read with the launcher's strides from its data pointer (stride 0 repeats)."""
    try:
        return tensor.as_strided(size, stride, tensor.storage_offset())
    except RuntimeError as error:
        raise ReferenceError_(
            f"{what}: the kernel would read past the tensor's storage with strides {stride} ({error})"
        ) from error


# --------------------------------------------------------------------------------------------------------------
# which rows a launch writes
# --------------------------------------------------------------------------------------------------------------


def launch_rows(
    *,
    input_rows: int,
    top_k: int,
    block_size_m: int,
    sorted_token_ids: torch.Tensor | None,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
) -> TritonMoeRows:
    """The (row, expert, block) triples one launch processes (module docstring); the last occurrence of a row wins
    (duplicates race in the kernel)."""
    if block_size_m <= 0:
        raise ReferenceError_(f"BLOCK_SIZE_M must be positive, got {block_size_m}")
    num_valid = input_rows * top_k
    total = int(num_tokens_post_padded.reshape(-1)[0])
    experts = expert_ids.reshape(-1).to(torch.long).cpu()
    if sorted_token_ids is None:
        blocks = num_valid
        if experts.numel() < blocks:
            raise ReferenceError_(
                f"expert_ids has {experts.numel()} entries for {blocks} rows (naive blocks)"
            )
        naive = torch.arange(blocks)
        naive = naive[naive * block_size_m < total]
        return TritonMoeRows(naive.clone(), experts[naive], naive, num_valid)
    ids = sorted_token_ids.reshape(-1).to(torch.long).cpu()
    em = ids.numel()
    if input_rows < block_size_m:
        em = min(em, input_rows * top_k * block_size_m)
    grid = -(-em // block_size_m)
    processed = min(grid, -(-total // block_size_m) if total > 0 else 0)
    if processed * block_size_m > ids.numel():
        raise ReferenceError_(
            f"sorted_token_ids has {ids.numel()} entries; block {processed - 1} reads up to "
            f"{processed * block_size_m} (past its end)"
        )
    if processed > experts.numel():
        raise ReferenceError_(f"expert_ids has {experts.numel()} entries; {processed} blocks are processed")
    chunk = ids[: processed * block_size_m].view(processed, block_size_m)
    block = torch.arange(processed).view(-1, 1).expand_as(chunk)
    valid = chunk < num_valid
    if bool((chunk[valid] < 0).any()):
        raise ReferenceError_("sorted_token_ids holds negative ids: the kernel would write before C")
    rows, row_blocks = chunk[valid], block[valid]
    return TritonMoeRows(rows, experts[row_blocks], row_blocks, num_valid)


# --------------------------------------------------------------------------------------------------------------
# dequantisation
# --------------------------------------------------------------------------------------------------------------


def unpack_int4_along(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Bytes holding two 4-bit codes, low nibble first, unpacked along ``dim``: codes 0..15, as ``uint8`` (one byte
    per code: a GPU unpacks a model's experts without int64 temporaries eight times their size)."""
    data = (
        values.view(torch.uint8)
        if values.element_size() == 1
        else (values.to(torch.int64) & 0xFF).to(torch.uint8)
    )
    low, high = data & 0xF, data >> 4
    stacked = torch.stack((low, high), dim=dim + 1)
    shape = list(values.shape)
    shape[dim] *= 2
    return stacked.reshape(shape)


def _grouped_last(values: torch.Tensor, group: int) -> torch.Tensor | None:
    """``values`` (``[..., K]``) viewed as ``[..., K / group, group]``, or ``None`` when ``K`` is not a multiple of
    ``group`` (the caller then repeats its per-group factors out to ``K``). Applying a per-group factor through
    this view is the same arithmetic, element by element, as applying the repeated factor."""
    k = values.shape[-1]
    if group <= 0 or k % group or not values.is_contiguous():
        return None
    return values.view(*values.shape[:-1], k // group, group)


def w8a8_weight(
    B: torch.Tensor,
    B_scale: torch.Tensor,
    experts: Sequence[int],
    *,
    block_shape: tuple[int, int] | None,
    per_channel: bool,
) -> torch.Tensor:
    """fp32 ``[len(experts), N, K]`` dequantised fp8/int8 weights of the given experts (one float32 multiply per
    element by its scale; block scales applied through a view when the blocks tile ``N`` and ``K``)."""
    E, N, K = B.shape
    values = gather_experts(B, experts, torch.float32)
    s = B_scale.stride()
    if block_shape is not None:
        group_n, group_k = block_shape
        blocks_n, blocks_k = -(-N // group_n), -(-K // group_k)
        strides = (
            s[0] if B_scale.dim() >= 2 else 0,
            s[1] if B_scale.dim() >= 2 else 0,
            s[2] if B_scale.dim() == 3 else 0,
        )
        scales = gather_experts(
            _strided(B_scale, (E, blocks_n, blocks_k), strides, "B_scale"), experts, torch.float32
        )
        if N % group_n == 0 and K % group_k == 0:
            tiles = values.view(-1, blocks_n, group_n, blocks_k, group_k)
            tiles.mul_(scales[:, :, None, :, None])
            return values
        scales = scales.repeat_interleave(group_n, dim=1)[:, :N].repeat_interleave(group_k, dim=2)[:, :, :K]
        return values.mul_(scales)
    if per_channel:
        strides2 = (s[0] if B_scale.dim() >= 2 else 0, s[1] if B_scale.dim() >= 2 else 0)
        channel = gather_experts(_strided(B_scale, (E, N), strides2, "B_scale"), experts, torch.float32)
        return values.mul_(channel[:, :, None])
    tensor = gather_experts(_strided(B_scale, (E,), (1,), "B_scale"), experts, torch.float32)
    return values.mul_(tensor[:, None, None])


def w8a8_quantized(
    B: torch.Tensor,
    B_scale: torch.Tensor,
    *,
    block_shape: tuple[int, int] | None,
    per_channel: bool,
) -> QuantizedWeights:
    """:func:`w8a8_weight`'s dequantisation as a description (the scale of weight ``(e, n, k)`` at the same element
    of ``B_scale`` it reads)."""
    E, N, K = B.shape
    s = B_scale.stride()
    if block_shape is not None:
        group_n, group_k = block_shape
        strides = (
            s[0] if B_scale.dim() >= 2 else 0,
            s[1] if B_scale.dim() >= 2 else 0,
            s[2] if B_scale.dim() == 3 else 0,
        )
        blocks = (E, -(-N // group_n), -(-K // group_k))
        scale = _strided(B_scale, blocks, strides, "B_scale")
        return QuantizedWeights(B, mode=1, scale=scale, group_n=group_n, group_k=group_k)
    if per_channel:
        strides2 = (s[0] if B_scale.dim() >= 2 else 0, s[1] if B_scale.dim() >= 2 else 0)
        scale = _strided(B_scale, (E, N, 1), (*strides2, 0), "B_scale")
        return QuantizedWeights(B, mode=1, scale=scale, group_k=max(1, K))
    scale = _strided(B_scale, (E, 1, 1), (1, 0, 0), "B_scale")
    return QuantizedWeights(B, mode=1, scale=scale, group_n=max(1, N), group_k=max(1, K))


def w8a8_activation(
    A: torch.Tensor,
    A_scale: torch.Tensor,
    rows: torch.Tensor,
    *,
    block_shape: tuple[int, int] | None,
    per_channel: bool,
) -> torch.Tensor:
    """fp32 dequantised activation rows ``rows`` of ``A`` (per-block, per-token or per-tensor scale)."""
    M, K = A.shape
    values = A[rows].to(torch.float32)
    two_d = A_scale.dim() == 2
    stride_m = A_scale.stride(0) if two_d else 0
    stride_k = A_scale.stride(1) if two_d else 0
    if block_shape is not None:
        group_k = block_shape[1]
        blocks_k = -(-K // group_k)
        scales = _strided(A_scale, (M, blocks_k), (stride_m, stride_k), "A_scale").to(torch.float32)[rows]
        return values * scales.repeat_interleave(group_k, dim=1)[:, :K]
    if per_channel:
        per_row = _strided(A_scale, (M,), (stride_m,), "A_scale").to(torch.float32)[rows]
        return values * per_row[:, None]
    return values * _strided(A_scale, (1,), (1,), "A_scale").to(torch.float32)


def wna16_weight(
    B: torch.Tensor,
    B_scale: torch.Tensor,
    B_zp: torch.Tensor | None,
    experts: Sequence[int],
    *,
    group_size: int,
    int4: bool,
    compute: torch.dtype,
) -> torch.Tensor:
    """fp32 ``[len(experts), N, K]`` int4/int8 weight-only weights, rounded to ``compute`` as the kernel rounds.
    Cost: the codes unpacked as bytes, one float32 pass for ``(q − zp) · scale`` (per-group factors through a view
    when groups tile ``K``), and the rounding through ``compute``."""
    chosen = gather_experts(B, experts)
    codes = unpack_int4_along(chosen, 2) if int4 else chosen
    N, K = codes.shape[1], codes.shape[2]
    if group_size <= 0:
        raise ReferenceError_(f"group size {group_size} must be positive (block_shape[1])")
    groups = -(-K // group_size)
    E = B.shape[0]
    s = B_scale.stride()
    scales = gather_experts(
        _strided(B_scale, (E, N, groups), (s[0], s[1], s[2]), "B_scale"), experts, torch.float32
    )
    zero: torch.Tensor | float
    if B_zp is None:
        zero = 8.0 if int4 else 128.0
    else:
        z = B_zp.stride()
        if int4:
            packed = gather_experts(
                _strided(B_zp, (E, -(-N // 2), groups), (z[0], z[1], z[2]), "B_zp"), experts
            )
            zero = unpack_int4_along(packed, 1)[:, :N].to(torch.float32)
        else:
            zero = gather_experts(
                _strided(B_zp, (E, N, groups), (z[0], z[1], z[2]), "B_zp"), experts, torch.float32
            )
    weights = codes.to(torch.float32)
    tiles = _grouped_last(weights, group_size)
    if tiles is not None:
        tiles.sub_(zero[..., None] if isinstance(zero, torch.Tensor) else zero).mul_(scales[..., None])
    else:
        if isinstance(zero, torch.Tensor):
            zero = zero.repeat_interleave(group_size, dim=2)[:, :, :K]
        weights.sub_(zero).mul_(scales.repeat_interleave(group_size, dim=2)[:, :, :K])
    return weights.to(compute).to(torch.float32)


def wna16_quantized(
    B: torch.Tensor,
    B_scale: torch.Tensor,
    B_zp: torch.Tensor | None,
    *,
    group_size: int,
    int4: bool,
    compute: torch.dtype,
) -> QuantizedWeights:
    """:func:`wna16_weight`'s dequantisation as a description."""
    if group_size <= 0:
        raise ReferenceError_(f"group size {group_size} must be positive (block_shape[1])")
    E, N = int(B.shape[0]), int(B.shape[1])
    K = int(B.shape[2]) * (2 if int4 else 1)
    groups = -(-K // group_size)
    s = B_scale.stride()
    scale = _strided(B_scale, (E, N, groups), (s[0], s[1], s[2]), "B_scale")
    zero_points = None
    if B_zp is not None:
        z = B_zp.stride()
        rows = -(-N // 2) if int4 else N
        zero_points = _strided(B_zp, (E, rows, groups), (z[0], z[1], z[2]), "B_zp")
    return QuantizedWeights(
        B,
        mode=2,
        scale=scale,
        group_k=group_size,
        int4=int4,
        zero_points=zero_points,
        zero_points_int4=int4,
        zero_default=8.0 if int4 else 128.0,
        round_to=compute,
    )


# --------------------------------------------------------------------------------------------------------------
# the launches
# --------------------------------------------------------------------------------------------------------------


def _topk_weight_values(topk_weights: torch.Tensor, count: int) -> torch.Tensor:
    """``topk_weights`` read flat from its data pointer (``count`` elements), as fp32."""
    return _strided(topk_weights, (count,), (1,), "topk_weights").to(torch.float32)


DENSE_ELEMENTS_AT_ONCE = {"cpu": 1 << 22, "cuda": 1 << 28}
"""Most dequantised float32 weight elements held at once, per device type; experts are converted a run of
consecutive ids at a time, never fewer than one. On the CPU 16 MB (one Qwen3-30B-A3B expert of 1536 × 2048): a
bigger run is a fresh mapping the allocator returns to the system each time, and its page faults cost more than the
conversion (a run of five experts made that reference 3.5× slower). On a GPU 1 GB: Qwen3-30B-A3B's 128 experts
convert in two launches."""


class _Launch:
    """One launch's arithmetic, split into what the loop needs: the activation rows (fp32), the dequantised
    weights of a run of consecutive experts (fp32 ``[N, K]`` each, laid out as a one-expert computation lays them
    out) and what comes after each row's dot product."""

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 activations of output rows ``rows`` (``A[rows // top_k]``, dequantised)."""
        raise NotImplementedError

    def weights(self, first: int, count: int) -> Sequence[torch.Tensor]:
        raise NotImplementedError

    def dense(self, experts: Sequence[int]) -> torch.Tensor:
        """fp32 ``[len(experts), N, K]`` dequantised weights of ``experts`` (ids), the same values :meth:`weights`
        gives them (element by element), contiguous."""
        raise NotImplementedError

    def finish(self, grouped: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``grouped`` (fp32 ``[R, N]``, rows sorted by expert; ``experts`` their experts) after the dot products."""
        return grouped

    def quantized(self) -> QuantizedWeights | None:
        """The stored weights and their dequantisation, for the one-pass dequantising kernel
        (:mod:`moereplay.reference.dequant_dense`): element by element the values :meth:`dense` gives; ``None``
        where this launch's weights have no such description."""
        return None


def _assemble(
    rows: TritonMoeRows,
    N: int,
    device: torch.device,
    launch: _Launch,
    experts_of_b: int,
    bias: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
    mul_routed_weight: bool,
) -> TritonMoeResult:
    """The launch's result from its rows: rows grouped by expert on the host, the activations gathered once, one
    float32 matmul per used expert (``A[row // top_k] · W[e]ᵀ``, as a per-expert loop computes it:
    :func:`moereplay.reference.expert_groups.matmul_into`), scattered back; one host-to-device copy of the row
    bookkeeping, no sync after it. Cost: ``rows · K · N`` multiply-adds; used experts' weights converted a run at a
    time (:data:`DENSE_ELEMENTS_AT_ONCE`)."""
    count = rows.num_valid_tokens
    # last occurrence wins, like a later block overwriting an earlier one
    last = torch.full((count,), -1, dtype=torch.long)
    if rows.row.numel():
        last.scatter_reduce_(0, rows.row, torch.arange(rows.row.numel()), reduce="amax")
    keep = last[last >= 0]
    row, expert, block = rows.row[keep], rows.expert[keep], rows.block[keep]
    active = expert >= 0
    live_rows, live_experts = row[active], expert[active]
    groups = group_by_expert(live_experts)
    order = groups.order
    written = torch.zeros(count, dtype=torch.long)
    written[row] = 1
    expert_of = torch.full((count,), -1, dtype=torch.long)
    expert_of[row] = expert
    block_of = torch.full((count,), -1, dtype=torch.long)
    block_of[row] = block
    # one host-to-device copy: per-row bookkeeping, then the sorted live rows and their experts
    packed = torch.cat((written, expert_of, block_of, live_rows[order], live_experts[order])).to(device)
    written_d, expert_of_d, block_of_d = (packed[i * count : (i + 1) * count] for i in range(3))
    live = live_rows.numel()
    sorted_rows = packed[3 * count : 3 * count + live]
    sorted_experts = packed[3 * count + live :]
    written_mask = written_d.bool()

    weights = None
    if mul_routed_weight:
        if topk_weights is None:
            raise ReferenceError_("mul_routed_weight needs topk_weights")
        weights = _topk_weight_values(topk_weights, count).to(device)

    gemm = torch.zeros(count, N, dtype=torch.float32, device=device)
    beyond = [e for e in groups.experts if e >= experts_of_b]
    within = len(groups.experts) - len(beyond)
    if live:
        grouped = torch.empty(live, N, dtype=torch.float32, device=device)
        with exact_fp32_matmul():
            x_sorted = launch.rows(sorted_rows)
            k = max(1, int(x_sorted.shape[1]))
            budget = DENSE_ELEMENTS_AT_ONCE.get(device.type, DENSE_ELEMENTS_AT_ONCE["cpu"])
            if device.type in BATCHED_DEVICE_TYPES:
                members = list(range(within))
                described = launch.quantized() if dequant_dense.available(device) else None
                weights_of: Callable[[Sequence[int]], torch.Tensor] = launch.dense
                if described is not None and described.mode != 0 and dequant_dense.usable(described):
                    # plain weights are one conversion pass either way; quantised ones save passes
                    weights_of = partial(dequant_dense.dequant_dense, described)
                batched_matmul_into(grouped, x_sorted.contiguous(), groups, members, weights_of, budget)
            else:
                xs: Sequence[torch.Tensor] = torch.split(x_sorted, list(groups.counts))
                if not x_sorted.is_contiguous():
                    # a strided A gathers into a layout that depends on the row count: gather expert by expert
                    xs = [launch.rows(part) for part in torch.split(sorted_rows, list(groups.counts))]
                outs = torch.split(grouped, list(groups.counts))
                for first, length in expert_runs(groups.experts[:within], budget // max(1, N * k)):
                    chunk = launch.weights(groups.experts[first], length)
                    for index, weight in enumerate(chunk):
                        matmul_into(outs[first + index], xs[first + index], weight.T)
                    del (
                        chunk,
                        weight,
                    )  # the loop variable is a view too: the next run's conversion must not keep this one
        if beyond:
            raise ReferenceError_(f"expert_ids names expert {beyond[0]}; B holds {experts_of_b}")
        gemm[sorted_rows] = launch.finish(grouped, sorted_experts)

    bias_rows = None
    if bias is not None:
        bias_rows = torch.zeros(count, N, dtype=torch.float32, device=device)
        if live:
            bias_rows[sorted_rows] = bias.to(device).index_select(0, sorted_experts).to(torch.float32)
    coefficient = torch.zeros(count, dtype=torch.float32, device=device)
    coefficient[sorted_rows] = weights[sorted_rows] if weights is not None else 1.0
    total = gemm if bias_rows is None else gemm + bias_rows
    output = total * coefficient[:, None]
    weight_index = torch.where(
        written_mask, torch.arange(count, device=device), torch.full_like(block_of_d, -1)
    )
    return TritonMoeResult(
        output, written_mask, gemm, bias_rows, coefficient, expert_of_d, block_of_d, weight_index
    )


def _block_shape(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    items = tuple(int(v) for v in value)
    if len(items) != 2:
        raise ReferenceError_(f"block_shape must hold two sizes, got {value!r}")
    return (items[0], items[1])


def reference_fused_moe_kernel(
    *,
    A: torch.Tensor,
    B: torch.Tensor,
    A_scale: torch.Tensor | None,
    B_scale: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
    sorted_token_ids: torch.Tensor | None,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    mul_routed_weight: bool,
    top_k: int,
    block_size_m: int,
    compute_type: Any,
    use_fp8_w8a8: bool,
    use_int8_w8a8: bool,
    use_int8_w8a16: bool,
    use_int4_w4a16: bool,
    per_channel_quant: bool,
    block_shape: Any = None,
    B_bias: torch.Tensor | None = None,
) -> TritonMoeResult:
    """What ``invoke_fused_moe_triton_kernel`` makes ``fused_moe_kernel`` write (module docstring)."""
    compute_dtype(compute_type)
    if use_int4_w4a16:
        raise ReferenceError_(
            "use_int4_w4a16 reaches fused_moe_kernel, which has no int4 path (vLLM routes int4 with a group size "
            "to fused_moe_kernel_gptq_awq)"
        )
    if A.dim() != 2 or B.dim() != 3:
        raise ReferenceError_(f"A must be [M, K] and B [E, N, K]; got {tuple(A.shape)}, {tuple(B.shape)}")
    if A.shape[1] != B.shape[2]:
        raise ReferenceError_(f"A has K={A.shape[1]}, B has K={B.shape[2]}")
    N = int(B.shape[1])
    rows = launch_rows(
        input_rows=int(A.shape[0]),
        top_k=top_k,
        block_size_m=block_size_m,
        sorted_token_ids=sorted_token_ids,
        expert_ids=expert_ids,
        num_tokens_post_padded=num_tokens_post_padded,
    )
    w8a8 = use_fp8_w8a8 or use_int8_w8a8
    shape = _block_shape(block_shape)
    blockwise = shape if shape is not None and shape[0] > 0 and shape[1] > 0 else None
    if w8a8 and (A_scale is None or B_scale is None):
        raise ReferenceError_("w8a8 needs A_scale and B_scale")
    if use_int8_w8a16 and B_scale is None:
        raise ReferenceError_("int8_w8a16 needs B_scale")
    launch: _Launch
    if w8a8:
        assert A_scale is not None and B_scale is not None
        launch = _W8A8Launch(A, A_scale, B, B_scale, top_k, blockwise, per_channel_quant)
    elif use_int8_w8a16:
        assert B_scale is not None
        launch = _W8A16Launch(A, B, B_scale, top_k)
    else:
        launch = _PlainLaunch(A, B, top_k)
    return _assemble(rows, N, A.device, launch, int(B.shape[0]), B_bias, topk_weights, mul_routed_weight)


class _PlainLaunch(_Launch):
    """bf16/fp16/fp32 operands: ``A[row // top_k]`` and ``B[e]`` converted to float32."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor, top_k: int) -> None:
        self.A, self.B, self.top_k = A, B, top_k

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self.A[rows // self.top_k].to(torch.float32)

    def weights(self, first: int, count: int) -> Sequence[torch.Tensor]:
        if self.B.is_contiguous():  # one conversion for the run
            return self.B.narrow(0, first, count).to(torch.float32).unbind(0)
        return [self.B[e].to(torch.float32) for e in range(first, first + count)]

    def dense(self, experts: Sequence[int]) -> torch.Tensor:
        return gather_experts(self.B, experts, torch.float32)

    def quantized(self) -> QuantizedWeights | None:
        return QuantizedWeights(self.B)


class _W8A16Launch(_PlainLaunch):
    """int8 weights, the dot product times ``B_scale[e, n]`` (per output channel) afterwards."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor, B_scale: torch.Tensor, top_k: int) -> None:
        super().__init__(A, B, top_k)
        self.B_scale = B_scale

    def finish(self, grouped: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        s = self.B_scale.stride()
        strides = (s[0] if self.B_scale.dim() >= 2 else 0, s[1] if self.B_scale.dim() >= 2 else 0)
        scale = _strided(self.B_scale, (int(self.B.shape[0]), int(self.B.shape[1])), strides, "B_scale")
        return grouped * scale[experts.to(scale.device)].to(grouped.device, torch.float32)


class _W8A8Launch(_Launch):
    """fp8/int8 activations and weights, each dequantised by its scales before the dot product."""

    def __init__(
        self,
        A: torch.Tensor,
        A_scale: torch.Tensor,
        B: torch.Tensor,
        B_scale: torch.Tensor,
        top_k: int,
        blockwise: tuple[int, int] | None,
        per_channel: bool,
    ) -> None:
        self.A, self.A_scale, self.B, self.B_scale = A, A_scale, B, B_scale
        self.top_k, self.blockwise, self.per_channel = top_k, blockwise, per_channel

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        return w8a8_activation(
            self.A,
            self.A_scale,
            rows // self.top_k,
            block_shape=self.blockwise,
            per_channel=self.per_channel,
        )

    def weights(self, first: int, count: int) -> Sequence[torch.Tensor]:
        return _one_run_or_each(
            self.B,
            first,
            count,
            self.dense,
        )

    def dense(self, experts: Sequence[int]) -> torch.Tensor:
        return w8a8_weight(
            self.B, self.B_scale, experts, block_shape=self.blockwise, per_channel=self.per_channel
        )

    def quantized(self) -> QuantizedWeights | None:
        return w8a8_quantized(self.B, self.B_scale, block_shape=self.blockwise, per_channel=self.per_channel)


def _one_run_or_each(
    B: torch.Tensor, first: int, count: int, dequantize: Callable[[Sequence[int]], torch.Tensor]
) -> Sequence[torch.Tensor]:
    """The dequantised experts ``first … first + count - 1``: one call for the run when ``B`` is contiguous (every
    expert's matrix then comes out contiguous, as alone), else one call per expert."""
    if B.is_contiguous():
        return dequantize(range(first, first + count)).unbind(0)
    return [dequantize((e,))[0] for e in range(first, first + count)]


def reference_fused_moe_kernel_gptq_awq(
    *,
    A: torch.Tensor,
    B: torch.Tensor,
    B_scale: torch.Tensor,
    B_zp: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    mul_routed_weight: bool,
    top_k: int,
    block_size_m: int,
    compute_type: Any,
    use_int8_w8a16: bool,
    use_int4_w4a16: bool,
    block_shape: Any,
) -> TritonMoeResult:
    """What ``invoke_fused_moe_wna16_triton_kernel`` makes ``fused_moe_kernel_gptq_awq`` write."""
    compute = compute_dtype(compute_type)
    if use_int4_w4a16 == use_int8_w8a16:
        raise ReferenceError_("exactly one of use_int4_w4a16 and use_int8_w8a16 must be set")
    shape = _block_shape(block_shape)
    if shape is None or shape[0] != 0:
        raise ReferenceError_(f"block_shape must be [0, group_size], got {block_shape!r}")
    if A.dim() != 2 or B.dim() != 3:
        raise ReferenceError_(f"A must be [M, K] and B [E, N, K(/2)]; got {tuple(A.shape)}, {tuple(B.shape)}")
    K = int(A.shape[1])
    packed_k = K // 2 if use_int4_w4a16 else K
    if B.shape[2] != packed_k:
        raise ReferenceError_(f"B's last dimension is {B.shape[2]}; K={K} needs {packed_k}")
    N = int(B.shape[1])
    rows = launch_rows(
        input_rows=int(A.shape[0]),
        top_k=top_k,
        block_size_m=block_size_m,
        sorted_token_ids=sorted_token_ids,
        expert_ids=expert_ids,
        num_tokens_post_padded=num_tokens_post_padded,
    )
    launch = _WNA16Launch(A, B, B_scale, B_zp, top_k, shape[1], use_int4_w4a16, compute)
    return _assemble(rows, N, A.device, launch, int(B.shape[0]), None, topk_weights, mul_routed_weight)


class _WNA16Launch(_Launch):
    """int4/int8 weight-only: ``A`` as is, the weights ``(q − zp) · scale`` rounded to ``compute_type``."""

    def __init__(
        self,
        A: torch.Tensor,
        B: torch.Tensor,
        B_scale: torch.Tensor,
        B_zp: torch.Tensor | None,
        top_k: int,
        group_size: int,
        int4: bool,
        compute: torch.dtype,
    ) -> None:
        self.A, self.B, self.B_scale, self.B_zp = A, B, B_scale, B_zp
        self.top_k, self.group_size, self.int4, self.compute = top_k, group_size, int4, compute

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self.A[rows // self.top_k].to(torch.float32)

    def weights(self, first: int, count: int) -> Sequence[torch.Tensor]:
        return _one_run_or_each(self.B, first, count, self.dense)

    def dense(self, experts: Sequence[int]) -> torch.Tensor:
        return wna16_weight(
            self.B,
            self.B_scale,
            self.B_zp,
            experts,
            group_size=self.group_size,
            int4=self.int4,
            compute=self.compute,
        )

    def quantized(self) -> QuantizedWeights | None:
        return wna16_quantized(
            self.B, self.B_scale, self.B_zp, group_size=self.group_size, int4=self.int4, compute=self.compute
        )
