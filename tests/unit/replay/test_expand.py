"""``moereplay expand`` on CPU: stand-in vLLM modules (real torch math) under the real patch table.

The stand-ins live where vLLM's do (``vllm._custom_ops.moe_wna16_marlin_gemm``, ``…experts.marlin_moe.
fused_marlin_moe``), so the capture session wraps them through the real ``TARGETS`` and expand imports the parent by
the recorded site, as it does on the GPU with a kernel pack. The layer function allocates its scratch buffers when
given ``None``, takes an enum (``activation``), a function with a default (``activation_func``) and a dataclass
(``quant_config``), and reads process state outside its arguments (``STATE``: a scale and NaN rows), which is how a
re-run can differ from the recorded call.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from moereplay.capture import session as session_module
from moereplay.capture.device_ring import byte_fingerprint
from moereplay.capture.flight_layer import largest_magnitude, unkept_marker
from moereplay.cli import app, main
from moereplay.errors import ReplayError, SettingsError
from moereplay.format import CaptureReader, CaptureWriter, Unsupported
from moereplay.replay.expand import ExpandVerdict, compare_bytes, expand_capture
from moereplay.trim import trim_capture

runner = CliRunner()

OPS = "vllm._custom_ops"
ACTIVATION = "vllm.model_executor.layers.fused_moe.activation"
MARLIN = "vllm.model_executor.layers.fused_moe.experts.marlin_moe"
REPO = Path(__file__).resolve().parents[3]
LAYER_CAPTURE = REPO / "captures" / "marlin-nvfp4-layer.moe.zst"

STATE: dict[str, Any] = {"scale": 1.0, "nan_rows": 0}
"""Process state the stand-in kernel reads outside its arguments."""

MoEActivation = enum.Enum("MoEActivation", ["SILU", "SWIGLUOAI"], module=ACTIVATION)  # type: ignore[misc]


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    scale: float
    bias: torch.Tensor | None = None


QuantConfig.__module__ = ACTIVATION


def apply_moe_activation(activation: Any, output: torch.Tensor, x: torch.Tensor) -> None:
    gate, up = x.chunk(2, dim=-1)
    if activation is MoEActivation.SILU:
        torch.mul(torch.nn.functional.silu(gate), up, out=output)
    elif activation is MoEActivation.SWIGLUOAI:
        torch.mul(gate * torch.sigmoid(1.702 * gate), up + 1, out=output)
    else:
        raise ValueError(f"unknown activation {activation!r}")


def moe_wna16_marlin_gemm(
    input: torch.Tensor,
    output: torch.Tensor | None,
    b_qweight: torch.Tensor,
    workspace: torch.Tensor,
    topk_weights: torch.Tensor,
    top_k: int,
    mul_topk_weights: bool,
    scale: float = 1.0,
) -> torch.Tensor:
    """A GEMM with the kernel's calling convention: writes ``output`` (allocated when None) and the workspace."""
    if output is None:
        output = torch.empty(input.shape[0], b_qweight.shape[1], dtype=input.dtype)
    torch.matmul(input, b_qweight, out=output)
    if mul_topk_weights:
        output.mul_(topk_weights.reshape(-1, 1))
    output.mul_(scale * STATE["scale"])
    if STATE["nan_rows"]:
        output[: STATE["nan_rows"]] = float("nan")
    workspace.add_(1)
    return output


def fused_marlin_moe(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    quant_type_id: int,
    activation: Any = MoEActivation.SILU,
    activation_func: Callable[..., None] = apply_moe_activation,
    quant_config: QuantConfig | None = None,
    workspace: torch.Tensor | None = None,
    intermediate_cache13: torch.Tensor | None = None,
    intermediate_cache2: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
) -> torch.Tensor:
    """A layer calling the kernel twice through ``vllm._custom_ops``, as vLLM's does."""
    ops = sys.modules[OPS]
    tokens = hidden_states.shape[0]
    workspace = torch.zeros(4, dtype=torch.int32) if workspace is None else workspace
    cache13 = torch.empty(tokens, w1.shape[1]) if intermediate_cache13 is None else intermediate_cache13
    cache2 = torch.empty(tokens, w1.shape[1] // 2) if intermediate_cache2 is None else intermediate_cache2
    first = ops.moe_wna16_marlin_gemm(hidden_states, cache13, w1, workspace, topk_weights, 1, False)
    activation_func(activation, cache2, first)
    output = torch.empty(tokens, w2.shape[1]) if output is None else output
    scale = 1.0 if quant_config is None else quant_config.scale
    ops.moe_wna16_marlin_gemm(cache2, output, w2, workspace, topk_weights, 1, True, scale=scale)
    if quant_config is not None and quant_config.bias is not None:
        output.add_(quant_config.bias)
    return output


@pytest.fixture
def fake_vllm(stand_in_module: Callable[..., types.ModuleType]) -> Iterator[types.ModuleType]:
    """The stand-in vLLM modules (removed at teardown, after any session is disarmed); STATE reset."""
    package = stand_in_module("vllm")
    package.__path__ = []  # type: ignore[attr-defined]
    stand_in_module(OPS, moe_wna16_marlin_gemm=moe_wna16_marlin_gemm)
    stand_in_module(
        ACTIVATION,
        MoEActivation=MoEActivation,
        QuantConfig=QuantConfig,
        apply_moe_activation=apply_moe_activation,
    )
    marlin = stand_in_module(MARLIN, fused_marlin_moe=fused_marlin_moe)
    STATE.update(scale=1.0, nan_rows=0)
    try:
        yield marlin
    finally:
        session_module.disarm()
        STATE.update(scale=1.0, nan_rows=0)


def layer_inputs(tokens: int = 6, hidden: int = 8, inner: int = 6, seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(tokens, hidden, generator=generator),
        "w1": torch.randn(hidden, 2 * inner, generator=generator),
        "w2": torch.randn(inner, hidden, generator=generator),
        "topk_weights": torch.rand(tokens, generator=generator),
        "quant_type_id": 7,
    }


def full_capture(directory: Path, marlin: types.ModuleType, calls: int = 1, **extra: Any) -> Path:
    """Record ``calls`` layer calls with the capture session (always mode): parents with their kernel calls."""
    session = session_module.arm({"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_DIR": str(directory)})
    assert session is not None
    try:
        for seed in range(calls):
            inputs = layer_inputs(seed=seed)
            output = torch.empty(inputs["hidden_states"].shape)
            marlin.fused_marlin_moe(**inputs, output=output, **extra)
        assert session.flush()
    finally:
        session_module.disarm()
    return session.path


def test_a_layer_call_without_kernel_calls_is_expanded_bit_exactly(fake_vllm, tmp_path: Path) -> None:
    full = full_capture(tmp_path / "cap", fake_vllm, activation=MoEActivation.SWIGLUOAI)
    layer_only = trim_capture(full, [0], tmp_path / "layer.moe.zst").path
    report = expand_capture(layer_only, tmp_path / "out.moe.zst", backend="vllm", device="cpu")

    (call,) = report.calls
    assert call.verdict is ExpandVerdict.BIT_EXACT and call.bit_exact is True
    assert (call.parent, call.kernel_calls, call.recorded_kernel_calls) == (0, (1, 2), ())
    assert call.line("out.moe.zst") == (
        "call 0 fused_marlin_moe: re-run bit-exact with the recorded output; kernel calls 1, 2 in out.moe.zst"
    )
    assert any("activation_func was recorded by name only" in note for note in report.notes)
    with CaptureReader(report.output) as out, CaptureReader(full) as original:
        records = list(out.calls())
        assert [(r.op, r.parent) for r in records] == [
            ("fused_marlin_moe", None),
            ("moe_wna16_marlin_gemm", 0),
            ("moe_wna16_marlin_gemm", 0),
        ]
        assert records[0].context["expanded_from"] == {"file": "layer.moe.zst", "call": 0, "bit_exact": True}
        assert records[1].context["expanded_from"]["recorded_child"] is None
        assert out.header["expand"]["source"] == "layer.moe.zst" and out.header["expand"]["calls"] == [0]
        for new, old in ((1, 1), (2, 2)):  # the regenerated kernel calls are the originally captured ones
            regenerated = out.load_outputs(new)
            for name, value in original.load_outputs(old).items():
                assert torch.equal(regenerated[name].view(torch.uint8), value.view(torch.uint8)), name
            assert out.call(new).arg_tensors.keys() == original.call(old).arg_tensors.keys()


def test_a_full_capture_compares_the_kernel_calls_too(fake_vllm, tmp_path: Path) -> None:
    config = QuantConfig(0.5, torch.linspace(-1, 1, 8))
    full = full_capture(tmp_path / "cap", fake_vllm, calls=2, quant_config=config)
    report = expand_capture(full, tmp_path / "out.moe.zst", calls=[3], backend="vllm", device="cpu")
    (call,) = report.calls
    assert call.verdict is ExpandVerdict.BIT_EXACT
    assert call.recorded_kernel_calls == (4, 5) and call.kernel_calls == (1, 2)
    assert [(pair.rerun, pair.recorded, pair.bit_exact) for pair in call.kernel_comparisons] == [
        (1, 4, True),
        (2, 5, True),
    ]
    assert "(1 vs recorded 4 bit-exact; 2 vs recorded 5 bit-exact)" in call.line("out.moe.zst")
    with CaptureReader(report.output) as out:
        assert out.call(2).context["expanded_from"] == {
            "file": full.name,
            "call": 3,
            "child": 1,
            "recorded_child": 5,
            "bit_exact": True,
        }


def test_state_outside_the_arguments_makes_the_rerun_differ(fake_vllm, tmp_path: Path) -> None:
    STATE.update(nan_rows=2)
    full = full_capture(tmp_path / "cap", fake_vllm)
    STATE.update(nan_rows=0, scale=1.0)
    report = expand_capture(full, tmp_path / "out.moe.zst", backend="vllm", device="cpu")
    (call,) = report.calls
    assert call.verdict is ExpandVerdict.DIFFERS and call.bit_exact is False
    (output,) = call.outputs
    assert (output.name, output.elements) == ("output", 48)
    assert (output.recorded_nonfinite, output.rerun_nonfinite) == (16, 0)
    assert output.differing == 16  # NaN rows only: the rest is bit-exact
    assert (output.rows, output.total_rows, output.max_abs) == (2, 6, None)  # only NaN vs finite differ
    line = call.line("out.moe.zst")
    assert line.startswith(
        "call 0 fused_marlin_moe: re-run differs from the recorded output: 16/48 elements in 2 of 6 rows, "
        "recorded non-finite 16 "
        "vs re-run 0 — the failure did not reproduce in a fresh process"
    )
    assert "with --fill 0xff: moereplay run out.moe.zst --call 1 --fill 0xff" in line
    assert "1 vs recorded 1 differs in output" in line and "2 vs recorded 2 differs in output" in line
    with CaptureReader(report.output) as out:
        assert out.call(0).context["expanded_from"]["bit_exact"] is False


def test_a_scale_read_outside_the_arguments_differs_without_nonfinite(fake_vllm, tmp_path: Path) -> None:
    STATE.update(scale=2.0)
    full = full_capture(tmp_path / "cap", fake_vllm)
    STATE.update(scale=1.0)
    layer_only = trim_capture(full, [0], tmp_path / "layer.moe.zst").path
    (call,) = expand_capture(layer_only, tmp_path / "out.moe.zst", backend="vllm", device="cpu").calls
    assert call.verdict is ExpandVerdict.DIFFERS
    assert "recorded non-finite 0 vs re-run 0 — not bit-exact" in call.line("out.moe.zst")


def layer_scope_record(
    path: Path,
    *,
    unsupported: dict[str, Unsupported] | None = None,
    site: str = "",
    magnitude: float | None = 3.5,
    unkept: bool = False,
    fingerprint: str | None = None,
) -> Any:
    """A layer call as the layer-scope flight recorder writes it: no kernel calls, scratch buffers not kept, the
    output buffer among the inputs, the result among the outputs, ``context["flight"]``."""
    inputs = layer_inputs(seed=3)
    expected = fused_marlin_moe(**inputs, activation=MoEActivation.SWIGLUOAI)
    scratch = {
        name: Unsupported("torch.Tensor", f"scratch buffer (6, 12) float32: {name}")
        for name in ("workspace", "intermediate_cache13", "intermediate_cache2")
    }
    args = {
        **inputs,
        "activation": MoEActivation.SWIGLUOAI,
        "activation_func": Unsupported("builtins.function", f"{__name__}.apply_moe_activation"),
        "quant_config": None,
        **scratch,
        "output": expected.clone(),
        **(unsupported or {}),
    }
    context = {
        "layer": 5,
        "step": 12,
        "graph_step": 3,
        "graph_sequence": 8,
        "graph_tokens": 5,
        "graph_batch": 6,
        "flight": {"scope": "layer", "trigger": True, "magnitude": magnitude},
    }
    if fingerprint is not None:
        context["flight"]["fingerprint"] = fingerprint
    with CaptureWriter(path) as writer:
        index = writer.begin_call(
            "fused_marlin_moe",
            args,
            site=site or f"{MARLIN}:fused_marlin_moe",
            context=context,
            static={"w1", "w2"},
        )
        writer.complete_call(index, {"output": unkept_marker(expected) if unkept else expected})
    return expected


def expand_on_cpu(source: Path, tmp_path: Path) -> tuple[Any, Path]:
    """``moereplay expand SOURCE -o out.moe.zst --backend vllm --device cpu --json-out report.json`` (must exit 0):
    the CLI's result and the JSON report's path."""
    json_out = tmp_path / "report.json"
    result = runner.invoke(
        app,
        ["expand", str(source), "-o", str(tmp_path / "out.moe.zst"), "--backend", "vllm", "--device", "cpu",
         "--json-out", str(json_out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return result, json_out


def test_a_layer_scope_record_is_expanded(fake_vllm, tmp_path: Path) -> None:
    source = tmp_path / "flight.moe.zst"
    expected = layer_scope_record(source)
    result, json_out = expand_on_cpu(source, tmp_path)
    assert (
        "call 0 fused_marlin_moe (layer 5, step 12): re-run bit-exact with the recorded output; kernel calls 1, 2 in "
        "out.moe.zst"
    ) in result.stdout
    assert "note: call 0: activation_func was recorded by name only" in result.stdout
    document = json.loads(json_out.read_text())
    assert document["calls"][0]["verdict"] == "bit_exact" and document["calls"][0]["kernel_calls"] == [1, 2]
    with CaptureReader(tmp_path / "out.moe.zst") as out:
        parent, gemm1, gemm2 = out.calls()
        assert parent.context["layer"] == gemm1.context["layer"] == gemm2.context["layer"] == 5
        assert parent.context["step"] == 12
        assert gemm2.context["graph_step"] == 3 and gemm2.context["graph_sequence"] == 8
        # the padded batch's real tokens reach the kernel calls: their replays leave the padding rows unjudged
        assert [(c.context["graph_tokens"], c.context["graph_batch"]) for c in (gemm1, gemm2)] == [(5, 6)] * 2
        args = out.load_args(gemm1.index)
        assert args["workspace"].dtype == torch.int32  # the function allocated its own scratch
        assert torch.equal(out.load_outputs(0)["output"], expected)


@pytest.mark.parametrize("case", ["agrees", "nan", "unread"])
def test_an_output_checked_but_not_kept_is_compared_by_its_magnitude(
    fake_vllm, tmp_path: Path, case: str
) -> None:
    """MOEREPLAY_FLIGHT_OUTPUT_BYTES: the file has no output bytes, only the check's largest magnitude; the re-run's
    is compared with it — never called bit-exact, and a NaN the re-run does not reproduce is said so."""
    source = tmp_path / "flight.moe.zst"
    expected = layer_scope_record(source, unkept=True, magnitude=math.nan)
    if case != "nan":  # the recorded check saw what the re-run computes, or was never read
        layer_scope_record(
            source, unkept=True, magnitude=largest_magnitude(expected) if case == "agrees" else None
        )
    result, json_out = expand_on_cpu(source, tmp_path)
    line = next(line for line in result.stdout.splitlines() if line.startswith("call 0 "))
    assert "the recorded output was checked, not kept (no bytes to compare)" in line
    assert f"{largest_magnitude(expected):.6g} re-run" in line
    if case == "agrees":
        assert "— the check agrees" in line
    elif case == "nan":
        assert (
            "largest |x| nan recorded" in line and "the failure did not reproduce in a fresh process" in line
        )
        assert "--fill 0xff" in line
    else:
        assert "the recorded check never read" in line
    call = json.loads(json_out.read_text())["calls"][0]
    assert call["verdict"] == "not_compared" and call["bit_exact"] is None
    assert call["checked"]["name"] == "output"
    recorded = {"agrees": largest_magnitude(expected), "nan": "nan", "unread": None}[case]
    assert call["checked"]["recorded_magnitude"] == recorded
    assert call["checked"]["agrees"] is {"agrees": True, "nan": False, "unread": None}[case]
    with CaptureReader(tmp_path / "out.moe.zst") as out:
        assert out.call(0).context["expanded_from"]["check_agrees"] is call["checked"]["agrees"]


@pytest.mark.parametrize("case", ["same", "same-bad-check", "other", "nan", "malformed"])
def test_an_output_checked_and_fingerprinted_is_judged_bit_exact_by_its_fingerprint(
    fake_vllm, tmp_path: Path, case: str
) -> None:
    """An output checked but not kept, with the fingerprint of its bytes the recorder reduced in the same pass: the
    re-run's fingerprint (device_ring.byte_fingerprint) equal is a bit-exact verdict, unequal a difference — a NaN
    recorded and not re-run said so —; a value that is not one the recorder writes is no proof (magnitudes only)."""
    source = tmp_path / "flight.moe.zst"
    expected = layer_scope_record(source, unkept=True)
    right = f"{byte_fingerprint(expected):016x}"
    flipped = expected.clone()
    flipped.view(torch.int16).view(-1)[7] ^= 1  # one bit of one element
    printed = {
        "same": right,
        "same-bad-check": right,
        "other": f"{byte_fingerprint(flipped):016x}",
        "nan": f"{byte_fingerprint(flipped):016x}",
        "malformed": right[:15],  # 15 digits: not a value the recorder writes
    }[case]
    magnitude = {"nan": math.nan, "same-bad-check": 123.0}.get(case, largest_magnitude(expected))
    layer_scope_record(source, unkept=True, magnitude=magnitude, fingerprint=printed)
    result, json_out = expand_on_cpu(source, tmp_path)
    line = next(line for line in result.stdout.splitlines() if line.startswith("call 0 "))
    call = json.loads(json_out.read_text())["calls"][0]
    if case.startswith("same"):
        assert (
            f"re-run bit-exact with the recorded output by its fingerprint {right} (checked, not kept" in line
        )
        # the same bytes but another magnitude recorded: the recorder's check, not the re-run, is suspect
        disagrees = (
            "; but the recorded check said largest |x| 123: the flight recorder's check disagrees" in line
        )
        assert disagrees == (case == "same-bad-check"), line
        assert call["verdict"] == "bit_exact" and call["bit_exact"] is True
    elif case == "malformed":
        assert "fingerprint" not in line and "— the check agrees" in line
        assert call["verdict"] == "not_compared" and call["checked"]["recorded_fingerprint"] is None
    else:
        assert (
            f"re-run differs from the recorded output: fingerprint {printed} recorded, {right} re-run" in line
        )
        assert call["verdict"] == "differs" and call["bit_exact"] is False
        assert "--fill 0xff" in line
        if case == "nan":
            assert "the failure did not reproduce in a fresh process" in line
        else:
            assert "— not bit-exact" in line
    if case != "malformed":
        assert call["checked"]["recorded_fingerprint"] == printed
        assert call["checked"]["rerun_fingerprint"] == right
    with CaptureReader(tmp_path / "out.moe.zst") as out:
        assert out.call(0).context["expanded_from"]["bit_exact"] is call["bit_exact"]


def test_arguments_that_cannot_be_passed_are_one_line_errors(fake_vllm, tmp_path: Path) -> None:
    source = tmp_path / "bad.moe.zst"
    layer_scope_record(source, unsupported={"w1": Unsupported("torch.Tensor", "not copied")})
    with pytest.raises(ReplayError, match=r"call 0: argument w1 was not recorded .* has no default for it"):
        expand_capture(source, tmp_path / "out.moe.zst", backend="vllm", device="cpu")
    layer_scope_record(source, unsupported={"bogus": Unsupported("x.Y", "?")})
    with pytest.raises(ReplayError, match=r"argument bogus was recorded, but .* has no such parameter"):
        expand_capture(source, tmp_path / "out.moe.zst", backend="vllm", device="cpu")
    layer_scope_record(source, site="vllm.somewhere_else:fused_marlin_moe")
    with pytest.raises(ReplayError, match="not a patch point moereplay knows"):
        expand_capture(source, tmp_path / "out.moe.zst", backend="vllm", device="cpu")
    assert not (tmp_path / "out.moe.zst").exists()
    assert session_module.current() is None


def test_byte_comparison_counts_elements_nan_payloads_and_shapes() -> None:
    a = torch.tensor([1.0, float("nan"), 0.0, 2.0], dtype=torch.bfloat16)
    b = a.clone()
    assert compare_bytes("x", a, b).bit_exact  # NaN == NaN by bytes
    b.view(torch.int16)[1] ^= 1  # another NaN payload
    b[2] = -0.0
    result = compare_bytes("x", a, b)
    assert (result.differing, result.elements) == (2, 4)
    assert (result.recorded_nonfinite, result.rerun_nonfinite) == (1, 1)
    mismatch = compare_bytes("x", a, a.float())
    assert not mismatch.bit_exact and mismatch.mismatch == "recorded bfloat16[4] vs re-run float32[4]"


# --------------------------------------------------------------------------------------------------------------
# bad input through the command line: one line on stderr, exit 2
# --------------------------------------------------------------------------------------------------------------


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


def test_bad_calls_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "out.moe.zst")
    assert _fails(["expand", str(LAYER_CAPTURE), "--call", "1", "-o", out], capsys).endswith(
        "call 1 is a moe_wna16_marlin_gemm kernel call, not a layer call"
    )
    assert _fails(["expand", str(LAYER_CAPTURE), "--call", "9", "-o", out], capsys).endswith(
        "no call 9 (the file holds calls 0-2)"
    )
    report = REPO / "captures" / "marlin-nvfp4-report.moe.zst"
    assert "no layer call to expand" in _fails(["expand", str(report), "-o", out], capsys)
    reference = ["expand", str(LAYER_CAPTURE), "-o", out, "--backend", "reference", "--device", "cpu"]
    assert "expand needs the real kernels" in _fails(reference, capsys)
    assert "no such file" in _fails(["expand", str(tmp_path / "absent.zst"), "-o", out], capsys)


def test_corrupt_and_truncated_files_are_one_line_errors(
    fake_vllm, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "out.moe.zst")
    garbage = tmp_path / "garbage.zst"
    garbage.write_bytes(b"not a capture at all" * 10)
    assert "not a moereplay capture file" in _fails(["expand", str(garbage), "-o", out], capsys)
    full = full_capture(tmp_path / "cap", fake_vllm)
    cut = tmp_path / "cut.zst"
    data = full.read_bytes()
    cut.write_bytes(data[: len(data) // 3])  # blobs precede their call record: no whole layer call is left
    cpu = ["--backend", "vllm", "--device", "cpu"]
    assert "no layer call to expand" in _fails(["expand", str(cut), "-o", out, *cpu], capsys)
    with CaptureReader(full) as reader:
        storages = reader.raw_documents(0)[0]["storages"].values()
        weight = max(storages, key=lambda storage: storage.length)  # w1's blob frame
    damaged = tmp_path / "damaged.zst"
    flipped = bytearray(data)
    flipped[weight.offset + 48] ^= 0xFF
    damaged.write_bytes(bytes(flipped))
    line = _fails(["expand", str(damaged), "-o", out, *cpu], capsys)
    assert line.startswith(f"moereplay: {damaged}: ") and not Path(out).exists()
    assert session_module.current() is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_no_cuda_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _fails(["expand", str(LAYER_CAPTURE), "-o", str(tmp_path / "o.zst")], capsys)
    assert line == (
        "moereplay: expand re-runs the layer calls with the real kernels on CUDA, and this machine has no CUDA device"
    )


def test_expand_refuses_to_overwrite_its_source(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="overwrite its own source"):
        expand_capture(LAYER_CAPTURE, LAYER_CAPTURE, backend="vllm", device="cpu")


def test_run_and_layout_on_a_layer_call_point_to_its_kernel_calls_or_to_expand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    layer_only = trim_capture(LAYER_CAPTURE, [0], tmp_path / "layer.moe.zst").path
    expand_first = f"run `moereplay expand {layer_only} -o OUT` first"
    for argv in (
        ["run", str(layer_only), "--call", "0", "--backend", "reference"],
        ["run", str(layer_only), "--backend", "reference"],
        ["run", str(layer_only), "--layer", "0", "--backend", "reference"],
        ["layout", str(layer_only), "--call", "0"],
    ):
        assert expand_first in _fails(argv, capsys), argv
    line = _fails(["run", str(LAYER_CAPTURE), "--call", "0", "--backend", "reference"], capsys)
    assert line.endswith(
        "call 0 is a fused_marlin_moe layer call; replay the kernel calls (1-2), e.g. "
        f"moereplay run {LAYER_CAPTURE} --call 1"
    )
