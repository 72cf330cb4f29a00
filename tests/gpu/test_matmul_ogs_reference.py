"""triton_kernels ``matmul_ogs`` (vLLM 0.25.1's gpt-oss Triton MoE path) against moereplay's reference, on Hopper.

gpt-oss-like shapes: E=32 experts, top_k=4, 128 tokens, hidden N=2880; K a multiple of the kernel's K tile (3072)
and K=2880 (not a multiple of 128: the last K step is partial). Inputs are built the way vLLM builds them
(``ogs_inputs``). Every case prints one line (format, shape, max/RMS relative error, verdict) and must agree with
the reference within the bf16 profile; a disagreement fails with the comparison's one-line summary.

Known kernel bug: at K=2880 the Hopper kernel's scale loads are not masked in K, so each expert's last swizzled
scale row is read past its end; for the last expert that is past the end of the whole scale tensor, into whatever
bytes follow the allocation. When a K-not-multiple-of-128 case disagrees *only* in the outputs that read predicts
(``moereplay.reference.hopper_mxfp4.scale_overrun``: the last expert's rows, the columns whose scales sit in the
last swizzled row) and agrees everywhere else, the test calls ``pytest.xfail`` with that statement; any other
disagreement fails.

The fill test puts the swizzled scale tensor at the start of a larger buffer whose trailing bytes are 0x00 or 0xff
and reports whether the kernel's output changes (the unmasked scale loads past the end at K=2880, see
``moereplay.reference.hopper_mxfp4``); it only asserts that the reference itself is finite.

Needs sm_90 and an importable triton + triton_kernels (installed, or vLLM's vendored copy); skips otherwise.
Run with ``-s`` or not: the result lines are printed with capture disabled.
"""

from __future__ import annotations

import contextlib
import importlib
import time
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
from ogs_inputs import (
    CheckpointMx,
    import_triton_kernels,
    make_routing,
    precision_config,
    random_checkpoint,
    scale_in_filled_buffer,
    swiglu_activation,
    swizzle_like_vllm,
)

from moereplay.reference.compare import compare
from moereplay.reference.hopper_mxfp4 import (
    scale_overrun,
    swizzle_hopper_scales,
    swizzle_hopper_values,
    unswizzle_hopper_scales,
    unswizzle_hopper_values,
)
from moereplay.reference.matmul_ogs import (
    FP4,
    LayoutSpec,
    PrecisionSpec,
    TensorSpec,
    reference_matmul_ogs,
)

EXPERTS, TOP_K, TOKENS, HIDDEN = 32, 4, 128, 2880
K_VALUES = (3072, 2880)


@contextlib.contextmanager
def third_party() -> Iterator[None]:
    """vLLM / triton code may warn on import or compile; that is not what these tests judge."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(scope="module")
def tk() -> ModuleType:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(
            f"Hopper layouts are chosen on sm_90 only; this GPU is {torch.cuda.get_device_capability()}"
        )
    with third_party():
        module, where = import_triton_kernels()
    if module is None:
        pytest.skip(where)
    return module


@pytest.fixture(scope="module")
def routing(tk: ModuleType) -> tuple[Any, Any, Any]:
    with third_party():
        return make_routing(tk, TOKENS, EXPERTS, TOP_K, seed=1)


class Prepared:
    """One weight set: checkpoint tensors and what vLLM's preparation made of them."""

    def __init__(self, tk: ModuleType, n: int, k: int, seed: int) -> None:
        self.n, self.k = n, k
        self.ckpt: CheckpointMx = random_checkpoint(EXPERTS, n, k, seed=seed)
        with third_party():
            self.w, self.flex, self.scale, self.source = swizzle_like_vllm(tk, self.ckpt)
        self.scale_layout = self.scale.storage.layout
        self.precision = precision_config(tk, self.flex, self.scale)


_PREPARED: dict[tuple[str, int], Prepared] = {}


def prepared(tk: ModuleType, which: str, k: int) -> Prepared:
    key = (which, k)
    if key not in _PREPARED:
        n = 2 * HIDDEN if which == "w13" else HIDDEN
        _PREPARED[key] = Prepared(tk, n, k, seed=(13 if which == "w13" else 2) * 10_000 + k)
    return _PREPARED[key]


def report(capsys: pytest.CaptureFixture[str], line: str) -> None:
    with capsys.disabled():
        print(line, flush=True)


def _kernel(tk: ModuleType) -> Any:
    """``triton_kernels.matmul_ogs.matmul_ogs`` (the module, not the package attribute, which may be unset)."""
    return importlib.import_module("triton_kernels.matmul_ogs").matmul_ogs


def _timed_reference(**kwargs: Any) -> tuple[Any, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    ref = reference_matmul_ogs(**kwargs)
    torch.cuda.synchronize()
    return ref, time.perf_counter() - start


def _rows_using_expert(ref: Any, expert: int) -> torch.Tensor:
    """Bool per output row: the row is (or sums) a GEMM row computed with ``expert``'s weight."""
    row_map = ref.row_map
    if row_map.sources is not None:  # a top-k sum: any of its sorted source rows
        sources = row_map.sources
        used = torch.where(sources >= 0, ref.sorted_expert[sources.clamp(min=0)], -1)
        return (used == expert).any(dim=1)
    return row_map.expert == expert


def overread_statement(y: torch.Tensor, ref: Any, p: Prepared, k: int, *, swiglu: bool) -> str | None:
    """The xfail statement when the kernel output differs from the reference ONLY where the unmasked Hopper scale
    over-read predicts (rows of the last expert, the columns whose scales sit in its last swizzled row, halved by a
    fused SwiGLU) and agrees within tolerance everywhere else; None when the over-read does not explain it."""
    overrun = scale_overrun(p.n, k, num_warps=p.scale_layout.num_warps)
    columns = overrun.last_row_columns
    if not overrun.overrun or not columns:
        return None
    if swiglu:
        columns = tuple(sorted({c // 2 for c in columns}))
    last = EXPERTS - 1
    rows = _rows_using_expert(ref, last).to(y.device)
    region = torch.zeros(y.shape, dtype=torch.bool, device=y.device)
    region[:, list(columns)] = True
    region &= rows.unsqueeze(1)
    # the rest must agree: put the reference into the predicted region and compare again
    patched = torch.where(region, ref.output.to(y.device, y.dtype), y)
    if not compare(patched, ref.output, rows_mask=ref.row_map.written).ok:
        return None
    inside = compare(
        torch.where(region, y, ref.output.to(y.device, y.dtype)), ref.output, rows_mask=ref.row_map.written
    )
    bad_rows = inside.bad_rows
    where = f"rows {bad_rows[0]}..{bad_rows[-1]} ({len(bad_rows)} rows)" if bad_rows else "its rows"
    return (
        f"known kernel bug (unmasked Hopper MXFP4 scale loads, K={k} not a multiple of {overrun.block_k}): each "
        f"scale row is read {overrun.overrun} B past its end, the last expert's past the end of the tensor; the "
        f"output is wrong only there — expert {last}'s {where}, "
        f"columns {columns[0]}..{columns[-1]}: nan={inside.nan_actual} inf={inside.inf_actual} "
        f"elements over tolerance={inside.elements_over}; everything else agrees within {inside.tolerance.name}"
    )


def judge(result: Any, y: torch.Tensor, ref: Any, p: Prepared, k: int, *, swiglu: bool) -> None:
    """Pass, xfail with the over-read statement, or fail with the comparison's summary."""
    if result.ok:
        return
    statement = overread_statement(y, ref, p, k, swiglu=swiglu)
    if statement is not None:
        pytest.xfail(statement)
    assert result.ok, result.summary()


def _strided_specs(p: Prepared) -> tuple[TensorSpec, TensorSpec]:
    """The checkpoint tensors as unswizzled matmul_ogs weights: an independent route to the same dense weight."""
    values = p.ckpt.values.transpose(-2, -1)  # [E, K/2, N], stride 1 along K
    scales = p.ckpt.scales.transpose(-2, -1)
    return (
        TensorSpec(values, LayoutSpec(), (EXPERTS, p.k, p.n), FP4),
        TensorSpec(scales, LayoutSpec(), tuple(scales.shape), torch.uint8),
    )


# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", K_VALUES)
def test_swizzles_match_vllm_preparation(tk: ModuleType, k: int, capsys: pytest.CaptureFixture[str]) -> None:
    """moereplay's Hopper swizzles reproduce vLLM's bytes exactly, and invert them."""
    p = prepared(tk, "w13", k)
    values = p.ckpt.values.transpose(-2, -1)
    scales = p.ckpt.scales.transpose(-2, -1)
    w_data, s_data = p.w.storage.data, p.scale.storage.data
    mine_w = swizzle_hopper_values(values, 1)
    mine_s = swizzle_hopper_scales(scales, 1, p.scale_layout.num_warps)
    assert tuple(mine_w.shape) == tuple(w_data.shape) and mine_w.stride() == w_data.stride()
    assert torch.equal(mine_w, w_data.view(torch.uint8))
    assert torch.equal(mine_s, s_data.view(torch.uint8))
    assert torch.equal(unswizzle_hopper_values(w_data, tuple(values.shape), 1), values)
    assert torch.equal(
        unswizzle_hopper_scales(s_data, tuple(scales.shape), 1, p.scale_layout.num_warps), scales
    )
    report(
        capsys,
        f"swizzle   HOPPER_VALUE/HOPPER_SCALE  w13 [E={EXPERTS}, K={k}, N={p.n}]  bit-exact vs {p.source}",
    )


@pytest.mark.parametrize("k", K_VALUES)
def test_gemm1_gather_bias_swiglu(
    tk: ModuleType, routing: Any, k: int, capsys: pytest.CaptureFixture[str]
) -> None:
    routing_data, gather, _ = routing
    p = prepared(tk, "w13", k)
    x = (torch.randn(TOKENS, k, generator=torch.Generator().manual_seed(k)) * 0.5).to("cuda", torch.bfloat16)
    act = swiglu_activation(tk)
    y = torch.empty((1, TOKENS * TOP_K, HIDDEN), device="cuda", dtype=torch.bfloat16)
    with third_party():
        _kernel(tk)(
            x,
            p.w,
            p.ckpt.bias,
            routing_data,
            gather_indx=gather,
            precision_config=p.precision,
            gammas=None,
            fused_activation=act,
            y=y,
        )
    torch.cuda.synchronize()
    ref, seconds = _timed_reference(
        x=x,
        w=p.w,
        bias=p.ckpt.bias,
        routing_data=routing_data,
        gather_indx=gather,
        precision_config=p.precision,
        fused_activation=act,
    )
    w_plain, s_plain = _strided_specs(p)
    independent = reference_matmul_ogs(
        x,
        w_plain,
        p.ckpt.bias,
        routing_data,
        gather_indx=gather,
        precision_config=PrecisionSpec(weight_scale=s_plain),
        fused_activation=act,
    )
    assert torch.equal(ref.output, independent.output), (
        "reference differs between swizzled and checkpoint weights"
    )
    result = compare(y[0], ref.output, rows_mask=ref.row_map.written)
    report(
        capsys,
        f"matmul_ogs mxfp4 x bf16 gemm1 gather+bias+swiglu  M={TOKENS}x{TOP_K} K={k} N={p.n}->{HIDDEN}  "
        f"max_rel={result.max_rel:.2e} rms_rel={result.rms_rel:.2e}  {'ok' if result.ok else 'DISAGREE'}  "
        f"(reference {seconds * 1e3:.0f} ms)",
    )
    judge(result, y[0], ref, p, k, swiglu=True)


def test_gemm1_gather_bias_no_activation(
    tk: ModuleType, routing: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM's unfused Triton path: gemm1 without the fused activation (output N = 2·2880)."""
    routing_data, gather, _ = routing
    k = 2880
    p = prepared(tk, "w13", k)
    x = (torch.randn(TOKENS, k, generator=torch.Generator().manual_seed(7)) * 0.5).to("cuda", torch.bfloat16)
    y = torch.empty((1, TOKENS * TOP_K, p.n), device="cuda", dtype=torch.bfloat16)
    with third_party():
        _kernel(tk)(x, p.w, p.ckpt.bias, routing_data, gather_indx=gather, precision_config=p.precision, y=y)
    torch.cuda.synchronize()
    ref, seconds = _timed_reference(
        x=x,
        w=p.w,
        bias=p.ckpt.bias,
        routing_data=routing_data,
        gather_indx=gather,
        precision_config=p.precision,
    )
    result = compare(y[0], ref.output, rows_mask=ref.row_map.written)
    report(
        capsys,
        f"matmul_ogs mxfp4 x bf16 gemm1 gather+bias         M={TOKENS}x{TOP_K} K={k} N={p.n}  "
        f"max_rel={result.max_rel:.2e} rms_rel={result.rms_rel:.2e}  {'ok' if result.ok else 'DISAGREE'}  "
        f"(reference {seconds * 1e3:.0f} ms)",
    )
    judge(result, y[0], ref, p, k, swiglu=False)


@pytest.mark.parametrize("k", K_VALUES)
def test_gemm2_scatter_bias_gammas(
    tk: ModuleType, routing: Any, k: int, capsys: pytest.CaptureFixture[str]
) -> None:
    routing_data, _, scatter = routing
    p = prepared(tk, "w2", k)
    x = (torch.randn(TOKENS * TOP_K, k, generator=torch.Generator().manual_seed(k + 1)) * 0.5).to(
        "cuda", torch.bfloat16
    )
    y = torch.empty((1, TOKENS, HIDDEN), device="cuda", dtype=torch.bfloat16)
    with third_party():
        _kernel(tk)(
            x,
            p.w,
            p.ckpt.bias,
            routing_data,
            scatter_indx=scatter,
            precision_config=p.precision,
            gammas=routing_data.gate_scal,
            y=y,
        )
    torch.cuda.synchronize()
    ref, seconds = _timed_reference(
        x=x,
        w=p.w,
        bias=p.ckpt.bias,
        routing_data=routing_data,
        scatter_indx=scatter,
        precision_config=p.precision,
        gammas=routing_data.gate_scal,
    )
    result = compare(y[0], ref.output, rows_mask=ref.row_map.written)
    report(
        capsys,
        f"matmul_ogs mxfp4 x bf16 gemm2 scatter+bias+gammas M={TOKENS}x{TOP_K}->{TOKENS} K={k} N={HIDDEN}  "
        f"max_rel={result.max_rel:.2e} rms_rel={result.rms_rel:.2e}  {'ok' if result.ok else 'DISAGREE'}  "
        f"(reference {seconds * 1e3:.0f} ms)",
    )
    judge(result, y[0], ref, p, k, swiglu=False)


def _describe_difference(a: torch.Tensor, b: torch.Tensor, experts_by_row: torch.Tensor) -> str:
    same = a.view(torch.int16) == b.view(torch.int16)
    if bool(same.all()):
        return "bit-identical"
    rows, cols = torch.nonzero(~same, as_tuple=True)
    experts = sorted({int(e) for e in experts_by_row[rows.cpu()].tolist()})
    return (
        f"{int((~same).sum())} elements differ: rows {int(rows.min())}..{int(rows.max())} "
        f"(experts {experts if experts != [-1] else 'summed'}), columns {int(cols.min())}..{int(cols.max())}"
    )


@pytest.mark.parametrize(("which", "k"), [("w13", 2880), ("w13", 3072), ("w2", 2880)])
def test_scale_fill_past_the_end(
    tk: ModuleType, routing: Any, which: str, k: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """Does the output depend on the bytes right after the swizzled scale tensor? Reported, not asserted."""
    routing_data, gather, scatter = routing
    p = prepared(tk, which, k)
    matmul = _kernel(tk)
    gemm1 = which == "w13"
    rows = TOKENS if gemm1 else TOKENS * TOP_K
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(3)) * 0.5).to("cuda", torch.bfloat16)
    act = swiglu_activation(tk) if gemm1 else None
    outputs = {}
    for fill in (0x00, 0xFF):
        scale = scale_in_filled_buffer(tk, p.scale, fill)
        precision = precision_config(tk, p.flex, scale)
        if gemm1:
            y = torch.empty((1, TOKENS * TOP_K, HIDDEN), device="cuda", dtype=torch.bfloat16)
            kwargs: dict[str, Any] = dict(gather_indx=gather, fused_activation=act)
        else:
            y = torch.empty((1, TOKENS, HIDDEN), device="cuda", dtype=torch.bfloat16)
            kwargs = dict(scatter_indx=scatter, gammas=routing_data.gate_scal)
        with third_party():
            matmul(x, p.w, p.ckpt.bias, routing_data, precision_config=precision, y=y, **kwargs)
        torch.cuda.synchronize()
        outputs[fill] = y[0].clone()
    ref = reference_matmul_ogs(x, p.w, p.ckpt.bias, routing_data, precision_config=p.precision, **kwargs)
    assert bool(torch.isfinite(ref.output).all()), "the reference must be finite"
    overrun = scale_overrun(p.n, k, num_warps=p.scale_layout.num_warps)
    predicted_cols = overrun.last_row_columns
    if gemm1 and predicted_cols:
        predicted_cols = tuple(sorted({c // 2 for c in predicted_cols}))
    prediction = f"predicted: {overrun.overrun} B/row read past each scale row; " + (
        f"expert {EXPERTS - 1} output columns {predicted_cols[0]}..{predicted_cols[-1]} read past the tensor end"
        if overrun.overrun and predicted_cols
        else "no visible output reads past the tensor end"
    )
    difference = _describe_difference(outputs[0x00], outputs[0xFF], ref.row_map.expert)
    verdicts = []
    for fill, out in outputs.items():
        result = compare(out, ref.output, rows_mask=ref.row_map.written)
        verdicts.append(
            f"fill 0x{fill:02x}: nan={result.nan_actual} max_rel={result.max_rel:.2e} "
            f"{'ok' if result.ok else 'DISAGREE'}"
        )
    report(
        capsys,
        f"scale-fill {which} K={k} N={p.n}: 0xff vs 0x00 {difference} | {'; '.join(verdicts)} | {prediction}",
    )
