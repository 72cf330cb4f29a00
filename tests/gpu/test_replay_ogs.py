"""Replay proof, case 2 of issue 6: a gpt-oss ``matmul_ogs`` call on Hopper (MXFP4, K = 2880), fills 0xff / 0x00.

Built exactly the way vLLM 0.25.1 builds it, with vLLM's own code from the kernel pack (``$MOEREPLAY_PACK``, see
``tools/gpu/device_setup.sh``) or an installed vLLM:

- weights: random checkpoint-form MXFP4 (``[E, N, K/2]`` e2m1 bytes, ``[E, N, K/32]`` e8m0 scales in a sane range),
  fp32 biases, prepared by ``mxfp4_utils._swizzle_mxfp4`` (Hopper value/scale layouts, num_warps 8; it also sets the
  process-wide opt_flags constraint ``split_k=1``), wrapped in ``PrecisionConfig`` / ``FlexCtx`` and
  ``mxfp4_w4a16_moe_quant_config`` as ``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format`` does;
- routing: softmax top-4 of random logits, renormalised, through vLLM's ``make_routing_data``;
- the two ``matmul_ogs`` calls of one MoE layer made by vLLM's ``triton_kernel_fused_experts`` itself: w13 (gather,
  bias, fused swiglu, N = 5760) and w2 (scatter, bias, gammas, N = 2880). E = 32, top_k = 4, 64 tokens.

Each call is captured (``CaptureWriter``: arguments through the ops codecs plus the opt_flags constraints in force,
the output after a sync), loaded back (``moereplay.replay.source.load_call``) and replayed with the OpSpec on fresh
buffers where every tensor — including the swizzled storages *inside* the layout-wrapped weight and the precision
config — sits in its own guarded allocation (``moereplay.replay.memory.materialise`` over
``MatmulOgsOp.tensor_leaves``): this harness drives the OpSpec and the engine's guard machinery directly, because
the engine's ``execute`` guarded only top-level tensor arguments when this was written. The engine's own
``moereplay.replay.replay(capture, call=i, fills=["0x00", "0xff"], backend=...)`` table and findings are printed
after it; the two must agree once the engine guards tensors inside opaque arguments.

Printed: fidelity of the replay against the captured output, a verdict table (fills 0x00 / 0xff, and the
variants block_k = 64 and num_warps = 4), and findings: which tensor is over-read (one argument's guard at a time),
how far past its end (guard windows), which rows / experts / columns change, and the contract the call breaks.
Asserted: consistency, not whether the over-read reproduces — outputs that differ between fills must be explained
by an over-read tensor whose contract predicts it, and the explanation must match the predicted extent.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from ogs_inputs import gpt_oss_mxfp4_layer

pytestmark = [
    pytest.mark.filterwarnings("ignore::Warning:vllm.*"),
    pytest.mark.filterwarnings("ignore::Warning:triton.*"),
    pytest.mark.filterwarnings("ignore::Warning:torch.*"),
    pytest.mark.filterwarnings("ignore::Warning:triton_kernels.*"),
]

EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, TOKENS = 32, 4, 2880, 2880, 64
GUARD = 4096


# ---------------------------------------------------------------------------------------------------------------
# backend, inputs, capture
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    """A KernelBackend: imports through the pack (or the installed vLLM), runs on cuda:0."""

    name: str
    device: torch.device
    importer: Callable[[str], Any]

    def module(self, name: str) -> Any:
        return self.importer(name)


@pytest.fixture(scope="module")
def backend() -> Backend:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper (sm_90+) GPU")
    pack_dir = os.environ.get("MOEREPLAY_PACK")
    if pack_dir and Path(pack_dir).exists():
        from moereplay.pack import load_pack

        pack = load_pack(pack_dir)
        return Backend(f"pack:{pack_dir}", torch.device("cuda"), pack.import_module)
    try:
        importlib.import_module("vllm")
    except ImportError:
        pytest.skip("needs a vLLM 0.25.1 kernel pack ($MOEREPLAY_PACK) or an installed vLLM")
    return Backend("vllm", torch.device("cuda"), importlib.import_module)


@pytest.fixture(scope="module")
def capture(backend: Backend, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both matmul_ogs calls of one gpt-oss MoE layer, made by vLLM and captured; returns the capture file."""
    from moereplay.capture.binding import ArgumentBinder
    from moereplay.format import CaptureWriter
    from moereplay.ops.matmul_ogs import process_state

    moe = backend.module("vllm.model_executor.layers.fused_moe.experts.gpt_oss_triton_kernels_moe")
    activation = backend.module("vllm.model_executor.layers.fused_moe.activation")
    opt_flags = backend.module("triton_kernels.matmul_ogs_details.opt_flags")

    g = torch.Generator(device="cuda").manual_seed(2880)
    layer = gpt_oss_mxfp4_layer(backend.module, EXPERTS, HIDDEN, INTERMEDIATE, g)
    w13, w2, quant_config = layer.w13, layer.w2, layer.quant_config
    hidden = (torch.randn(TOKENS, HIDDEN, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    logits = torch.randn(TOKENS, EXPERTS, device="cuda", generator=g)
    topk_weights, topk_ids = torch.topk(torch.softmax(logits, dim=-1), TOP_K, dim=-1)
    topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    routing_data, gather, scatter = moe.make_routing_data(topk_ids, topk_weights, EXPERTS)

    path = tmp_path_factory.mktemp("ogs") / "gpt-oss-layer.moe.zst"
    original = moe.matmul_ogs
    binder = ArgumentBinder.of(original)
    with CaptureWriter(path, header={"purpose": "tests/gpu/test_replay_ogs.py"}) as writer:

        def captured(*args: Any, **kwargs: Any) -> Any:
            bound = binder.bind(args, kwargs)
            index = writer.begin_call(
                "matmul_ogs",
                {**bound, **process_state(opt_flags)},
                site="gpt_oss_triton_kernels_moe.triton_kernel_fused_experts",
                static={"w", "bias", "precision_config"},
            )
            out = original(*args, **kwargs)
            torch.cuda.synchronize()
            writer.complete_call(index, {"return": out, "y": bound["y"]})
            return out

        moe.matmul_ogs = captured
        try:
            output = torch.empty_like(hidden)
            moe.triton_kernel_fused_experts(
                output,
                hidden,
                w13,
                w2,
                routing_data,
                gather,
                scatter,
                topk=TOP_K,
                activation=activation.MoEActivation.SWIGLUOAI,
                quant_config=quant_config,
            )
        finally:
            moe.matmul_ogs = original
        assert writer.calls == 2
    return path


# ---------------------------------------------------------------------------------------------------------------
# replay on guarded buffers
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    status: str  # ran | invalid | rejected
    output: torch.Tensor | None
    damage: tuple[str, ...]
    error: str = ""


def run_guarded(
    op: Any,
    args: Mapping[str, Any],
    backend: Backend,
    fill: int,
    *,
    fills: Mapping[str, int] | None = None,
    windows: tuple[tuple[str, int, int, int], ...] = (),
) -> Outcome:
    """One replay: fresh scratch, every tensor leaf in its own guarded allocation, the real kernel."""
    from moereplay.errors import InvalidMutationError
    from moereplay.replay.memory import GuardWindow, materialise
    from moereplay.replay.mutations import FillPattern

    call = dict(args)
    call.update(op.make_scratch(args, backend.device))
    leaves = op.tensor_leaves(call)
    guarded = materialise(
        leaves,
        backend.device,
        FillPattern(fill),
        guard=GUARD,
        fills={name: FillPattern(byte) for name, byte in (fills or {}).items()},
        windows=[GuardWindow(name, "after", lo, hi, FillPattern(byte)) for name, lo, hi, byte in windows],
    )
    try:
        out = op.run(op.replace_tensor_leaves(call, guarded.args), backend)
        torch.cuda.synchronize()
    except InvalidMutationError as error:
        return Outcome("invalid", None, (), str(error).splitlines()[0])
    return Outcome("ran", out.detach().clone(), tuple(d.describe() for d in guarded.damage()))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def changed_positions(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bool mask of elements whose bits differ (NaN-aware)."""
    size = a.element_size()
    dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return a.contiguous().view(dtype) != b.contiguous().view(dtype)


def ranges(values: list[int]) -> str:
    out: list[str] = []
    for value in sorted(set(values)):
        if out and value == int(out[-1].split("..")[-1]) + 1:
            out[-1] = f"{out[-1].split('..')[0]}..{value}"
        else:
            out.append(str(value))
    shown = ", ".join(out[:8])
    return shown + (f" (+{len(out) - 8} more ranges)" if len(out) > 8 else "")


def furthest_read_after_end(
    op: Any, args: Mapping[str, Any], backend: Backend, leaf: str, base: torch.Tensor
) -> int:
    """Largest byte offset past ``leaf``'s end whose 0xff (others 0x00) changes the output; −1 if none."""

    def changes(start: int) -> bool:
        outcome = run_guarded(op, args, backend, 0x00, windows=((leaf, start, GUARD, 0xFF),))
        assert outcome.output is not None
        return not same_bits(outcome.output, base)

    if not changes(0):
        return -1
    lo, hi = 0, GUARD  # changes(lo) is True; find the largest such lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if changes(mid):
            lo = mid
        else:
            hi = mid
    return lo


def rows_of(reference: Any, mask: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    """(rows, experts, columns) touched by a [rows, cols] change mask."""
    rows = torch.nonzero(mask.any(dim=1)).flatten().cpu().tolist()
    cols = torch.nonzero(mask.any(dim=0)).flatten().cpu().tolist()
    experts = sorted({int(reference.rows.expert[r]) for r in rows if int(reference.rows.expert[r]) >= 0})
    return rows, experts, cols


def verdict(comparison: Any) -> str:
    """ok / nonfinite (NaN or Inf where the reference is finite) / corrupt (rows over tolerance)."""
    if comparison.ok:
        return "ok"
    return "nonfinite" if comparison.nonfinite_mismatch else "corrupt"


# ---------------------------------------------------------------------------------------------------------------
# the proof
# ---------------------------------------------------------------------------------------------------------------

CALLS = {0: "w13: gather + bias + fused swiglu, N=5760", 1: "w2: scatter + bias + gammas, N=2880"}


@pytest.mark.parametrize("index", sorted(CALLS))
def test_replay_case_2_fill_0xff_and_0x00(capture: Path, backend: Backend, index: int) -> None:
    lines: list[str] = []
    try:
        prove_case_2(capture, backend, index, lines)
    finally:
        print("\n".join(lines))


def prove_case_2(capture: Path, backend: Backend, index: int, lines: list[str]) -> None:
    """Replay one captured call; append the table and findings to ``lines``; assert consistency."""
    from moereplay.ops.matmul_ogs import problem_of, scale_bytes_read
    from moereplay.reference.compare import compare
    from moereplay.reference.hopper_mxfp4 import scale_overrun
    from moereplay.replay.source import load_call

    loaded = load_call(capture, index, device="cuda")
    op, args = loaded.op, loaded.args
    problem = problem_of(args)
    lines.append(f"== call {index}: {CALLS[index]} — captured constraints split_k={args.get('split_k')}")
    assert problem.k == HIDDEN and problem.experts == EXPERTS and problem.top_k == TOP_K

    reference = op.reference(args)
    violations = op.check(args)
    for violation in violations:
        lines.append(f"contract: {violation.describe()}")

    # fidelity: the replay with the captured state reproduces the captured output
    fidelity = run_guarded(op, args, backend, 0x00)
    assert fidelity.output is not None and loaded.captured_output is not None
    flags = op.last_flags
    lines.append(
        f"replay vs captured output: {'bit-exact' if same_bits(fidelity.output, loaded.captured_output) else 'DIFFERS'}"
        f"; kernel ran with {flags}"
    )

    variants: list[tuple[str, dict[str, Any], int]] = [
        ("fill 0x00", {}, 0x00),
        ("fill 0xff", {}, 0xFF),
        ("block_k=64 fill 0x00", {"block_k": 64}, 0x00),
        ("block_k=64 fill 0xff", {"block_k": 64}, 0xFF),
        ("num_warps=4 fill 0x00", {"num_warps": 4}, 0x00),
    ]
    outcomes: dict[str, Outcome] = {}
    header = (
        f"{'variant':24} {'verdict':10} {'bad rows':>12} {'max rel':>9} {'rms rel':>9} {'NaN':>6} {'Inf':>6}"
    )
    lines.append(f"{header} {'=captured':>9}  guard")
    for name, changes, fill in variants:
        variant_args = op.rederive({**args, **changes}, frozenset(changes))
        outcome = run_guarded(op, variant_args, backend, fill)
        outcomes[name] = outcome
        if outcome.output is None:
            lines.append(f"{name:24} {'invalid':10} {outcome.error}")
            continue
        c = compare(outcome.output, reference.output, rows_mask=reference.written)
        captured_same = same_bits(outcome.output, loaded.captured_output)
        lines.append(
            f"{name:24} {verdict(c):10} {len(c.bad_rows):>5}/{int(reference.written.sum()):<6} {c.max_rel:>9.2e} "
            f"{c.rms_rel:>9.2e} {c.nan_actual:>6} {c.inf_actual:>6} {('yes' if captured_same else 'no'):>9}  "
            f"{'; '.join(outcome.damage) or 'intact'}"
        )

    zero, ones = outcomes["fill 0x00"].output, outcomes["fill 0xff"].output
    assert zero is not None and ones is not None
    base_cmp = compare(zero, reference.output, rows_mask=reference.written)
    assert base_cmp.ok, f"fill 0x00 replay disagrees with the reference: {base_cmp.summary()}"
    if outcomes["num_warps=4 fill 0x00"].output is not None:
        warps_cmp = compare(
            outcomes["num_warps=4 fill 0x00"].output, reference.output, rows_mask=reference.written
        )
        assert warps_cmp.ok, (
            f"re-swizzled scales (num_warps=4) disagree with the reference: {warps_cmp.summary()}"
        )

    # findings: does the output depend on the guard fill, and if so, which tensor is over-read and how far
    block_k = flags.block_k if flags else 128
    predicted = scale_overrun(problem.n, problem.k, num_warps=problem.scale_warps or 8, block_k=block_k)
    lines.append(
        f"prediction (contract): scale rows of {predicted.row_bytes} bytes, the kernel reads {predicted.bytes_read} "
        f"(over-read {predicted.overrun} bytes/row; per expert, last-row weight columns "
        f"{ranges(list(predicted.last_row_columns)) or 'none < N'}); op says {scale_bytes_read(args)} bytes read"
    )
    differ = changed_positions(zero, ones)
    if not bool(differ.any()):
        lines.append(
            "finding: the output does not depend on the guard fill (no out-of-bounds read reaches it)"
        )
        if predicted.overrun and predicted.last_row_columns:
            lines.append(
                "note: the contract predicts an over-read that reaches real columns; it did not show — check the "
                "chosen flags above (EVEN_K, block_k)"
            )
    else:
        rows, experts, cols = rows_of(reference, differ.reshape(zero.shape[-2], -1))
        lines.append(
            f"finding: the output changes with the fill ⇒ out-of-bounds read; rows {ranges(rows)} "
            f"(experts {ranges(experts)}), columns {ranges(cols)}; NaN in the 0xff run: "
            f"{int(torch.isnan(ones.float()).sum())}"
        )
        leaves = op.tensor_leaves({**args, **op.make_scratch(args, backend.device)})
        culprits = []
        for leaf in leaves:
            outcome = run_guarded(op, args, backend, 0x00, fills={leaf: 0xFF})
            assert outcome.output is not None
            if not same_bits(outcome.output, zero):
                culprits.append(leaf)
        assert culprits, "the output depends on the fill, but no single tensor's guard explains it"
        contract_args = {v.arg for v in violations}
        for leaf in culprits:
            furthest = furthest_read_after_end(op, args, backend, leaf, zero)
            lines.append(
                f"finding: {leaf} is over-read past its end up to byte +{furthest} "
                f"({furthest + 1} bytes); contract violated: {leaf in contract_args}"
            )
            assert leaf in contract_args, f"{leaf} is over-read but no contract predicts it"
            if leaf == "precision_config.weight_scale.storage":
                assert furthest + 1 <= predicted.overrun, (
                    "over-read further than the unmasked scale load explains"
                )
                affected = set(predicted.last_row_columns)
                reduced = {c // problem.reduction_n for c in affected}
                assert set(cols) <= (reduced if problem.reduction_n > 1 else affected) or problem.has_scatter
                assert experts in ([], [EXPERTS - 1]) or problem.has_scatter
        fixed = outcomes["block_k=64 fill 0xff"]
        if fixed.output is not None and outcomes["block_k=64 fill 0x00"].output is not None:
            same = same_bits(fixed.output, outcomes["block_k=64 fill 0x00"].output)
            still = "no longer" if same else "still"
            lines.append(
                f"finding: with block_k=64 (K % 64 == 0, EVEN_K) the fill {still} changes the output"
            )
            if culprits == ["precision_config.weight_scale.storage"]:
                assert same, "block_k=64 reads no scale past a row, yet the output still depends on the fill"
    engine_lines, engine_oob = engine_section(capture, index, backend)
    lines.extend(engine_lines)
    harness_oob = bool(differ.any())
    if engine_oob is not None and engine_oob != harness_oob:
        lines.append(
            f"note: the engine {'reports' if engine_oob else 'does not report'} an out-of-bounds read, the guarded "
            f"harness above {'does' if harness_oob else 'does not'}"
            + (
                ""
                if engine_guards_opaque_tensors()
                else " (the engine guards only top-level tensor arguments)"
            )
        )
        assert not engine_guards_opaque_tensors(), "replay engine and guarded harness disagree"


def engine_section(capture: Path, index: int, backend: Backend) -> tuple[list[str], bool | None]:
    """The replay engine's own verdict table for fills 0x00 / 0xff: (lines, whether it reports an OOB read).

    ``None`` when the engine is not available.
    """
    try:
        from moereplay.replay import replay
    except (ImportError, AttributeError) as error:
        return [f"replay engine: not available ({error})"], None
    report = replay(capture, call=index, fills=["0x00", "0xff"], backend=backend.name, isolate=False)
    lines = [f"replay engine ({report.backend}): {'variant':22} verdict   bad rows   max rel    NaN   guard"]
    for result in report.results:
        lines.append(
            f"  {result.label:40} {result.verdict.value:9} {result.bad_rows:>4}/{result.rows:<5} "
            f"{result.max_rel:>9.2e} {result.nan:>6}   {result.guard.value}"
        )
    oob_read = False
    for finding in report.findings:
        lines.append(f"  finding [{finding.kind.value}] {finding.message}")
        oob_read |= finding.kind.value == "oob_read"
    return lines, oob_read


def engine_guards_opaque_tensors() -> bool:
    """Whether the engine materialises tensors inside opaque arguments (through ``op.tensor_leaves``)."""
    import inspect

    try:
        from moereplay.replay import execution
    except ImportError:
        return False
    return "tensor_leaves" in inspect.getsource(execution)


def test_capture_holds_both_calls_with_their_process_state(capture: Path) -> None:
    from moereplay.format import CaptureReader

    with CaptureReader(capture) as reader:
        records = list(reader.calls())
        assert [r.op for r in records] == ["matmul_ogs", "matmul_ogs"]
        assert all(r.status == "completed" for r in records)
        args = reader.load_args(0)
    assert args["split_k"] == 1  # vLLM pins it process-wide on Hopper (_swizzle_mxfp4)
    assert type(args["precision_config"]).__name__ == "PrecisionSpec"
    assert args["w"].layout.kind == "HOPPER_VALUE"
    assert args["precision_config"].weight_scale.layout.kind == "HOPPER_SCALE"
