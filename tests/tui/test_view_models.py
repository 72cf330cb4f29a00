"""What the widgets draw, without a screen: call rows, filters, element errors and the heat map grid, the argument
tree, replay outcomes with tensors, the repro lookup."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tui_captures import marlin_call

from moereplay.errors import InvalidMutationError
from moereplay.ops import get_op
from moereplay.tui.arguments import argument_nodes, contract_violations
from moereplay.tui.catalog import CallCatalog
from moereplay.tui.error_grid import LARGE_RELATIVE_ERROR, ErrorField
from moereplay.tui.filters import CallFilter
from moereplay.tui.replays import ReplayRequest, VariantTensors, mutation_labels, run_replay
from moereplay.tui.repro import ReproUnavailable, default_repro_dir, export_repro, repro_root


def test_catalog_reads_the_index_first_and_rows_on_demand(synthetic_capture: Path) -> None:
    catalog = CallCatalog(synthetic_capture)
    try:
        assert len(catalog) == 300 and catalog.decoded == 0
        row = catalog.summary(25)
        assert catalog.decoded == 1
        assert (row.op, row.layer, row.step, row.rank, row.status) == ("matmul_ogs", 1, 1, 0, "completed")
        assert row.shapes == "input=bf16[4,16] b_qweight=i32[4,8,4]"
        assert catalog.summary(29).status == "inputs_saved"
        assert catalog.record(25).index == 25
    finally:
        catalog.close()


def test_filter_terms() -> None:
    query = CallFilter.parse("op:moe_* layer:2-4 step:7 verdict:bad status:comp marlin")
    assert query.op == "moe_*" and query.status == "comp" and query.verdict == "bad"
    assert query.words == ("marlin",)
    assert set(query.numbers) == {"layer", "step"}
    assert CallFilter.parse("layer:two").problems == ("layer: 'two' is not a number or a range a-b",)
    assert CallFilter.parse("").empty


def test_filter_matches_rows_and_verdicts(synthetic_capture: Path) -> None:
    catalog = CallCatalog(synthetic_capture)
    try:
        row = catalog.summary(48)  # moe_wna16_marlin_gemm, layer 0, step 2, site synthetic:3
        assert CallFilter.parse("op:moe_* layer:0 step:1-2 synthetic:3").matches(row, None)
        assert not CallFilter.parse("layer:1").matches(row, None)
        assert CallFilter.parse("verdict:none").matches(row, None)
        assert CallFilter.parse("verdict:bad").matches(row, "nonfinite")
        assert not CallFilter.parse("verdict:bad").matches(row, "ok")
        assert CallFilter.parse("verdict:corr").matches(row, "corrupt")
    finally:
        catalog.close()


def tensors(
    output: torch.Tensor, reference: torch.Tensor, written: list[bool] | None = None
) -> VariantTensors:
    rows = reference.shape[0]
    mask = torch.tensor(written if written is not None else [True] * rows)
    return VariantTensors(output, reference, mask)


def test_error_field_marks_bad_nan_inf_and_large_elements() -> None:
    reference = torch.ones(4, 10)
    output = reference.clone()
    output[0, 3] = 1.5  # over the fp32 tolerance
    output[1, 7] = math.nan
    output[2, 0] = math.inf
    output[3, 9] = 1.0 + 2 * LARGE_RELATIVE_ERROR
    errors = ErrorField.of(tensors(output, reference))
    assert errors.tolerance_name == "fp32"
    assert errors.first_bad() == (0, 3)
    assert [errors.marker(*position) for position in ((0, 3), (1, 7), (2, 0), (3, 9))] == [
        None,
        "nan",
        "inf",
        "large",
    ]
    grid = errors.grid(4)
    assert (grid.rows, grid.blocks) == (4, 3)
    assert grid.columns(2) == (8, 9)
    assert float(grid.maximum[0, 0]) == pytest.approx(0.5)
    assert float(grid.maximum[0, 1]) == 0.0
    assert [grid.marker(1, 1), grid.marker(2, 0), grid.marker(3, 2), grid.marker(0, 0)] == [
        "nan",
        "inf",
        "large",
        None,
    ]
    assert int(grid.nan.sum()) == 1 and int(grid.inf.sum()) == 1


def test_rows_not_written_count_nowhere() -> None:
    reference = torch.ones(2, 4)
    output = torch.full((2, 4), 5.0)
    errors = ErrorField.of(tensors(output, reference, written=[False, True]))
    assert float(errors.relative[0].max()) == 0.0
    assert float(errors.relative[1].max()) == pytest.approx(4.0)
    assert errors.first_bad() == (1, 0)


def test_argument_nodes_follow_the_schema_and_carry_violations(violation_capture: Path) -> None:
    catalog = CallCatalog(violation_capture)
    try:
        record = catalog.record(0)
    finally:
        catalog.close()
    op = get_op(record.op)
    violations = contract_violations(violation_capture, 0)
    nodes = argument_nodes(record, op, violations)
    names = [node.name for node in nodes]
    assert names == [spec.name for spec in op.arguments if spec.name in record.args]
    by_name = {node.name: node for node in nodes}
    weights = by_name["topk_weights"]
    assert weights.kind == "tensor" and weights.flagged
    assert ("dtype", "bfloat16") in weights.details
    assert [violation.aspect for violation in weights.violations] == ["dtype"]
    assert "mutable" in by_name["mul_topk_weights"].tags
    assert "derived" in by_name["sorted_token_ids"].tags
    assert not by_name["input"].flagged


def test_mutation_labels_come_from_the_engine() -> None:
    assert mutation_labels("moe_wna16_marlin_gemm", "sweep moe_block_size=16,64") == (
        "set moe_block_size=16",
        "set moe_block_size=64",
    )
    with pytest.raises(InvalidMutationError):
        mutation_labels("moe_wna16_marlin_gemm", "flip size_m")


def test_replay_outcome_holds_the_tensors_the_diff_view_draws(marlin_capture: Path) -> None:
    outcome = run_replay(ReplayRequest(marlin_capture, 0, ("flip mul_topk_weights",), "reference"))
    labels = ["recorded", "baseline", "flip mul_topk_weights"]
    assert [result.label for result in outcome.report.results] == labels
    assert set(outcome.tensors) == {"recorded", "flip mul_topk_weights"}  # offline the baseline never runs
    recorded = outcome.tensors["recorded"]
    assert recorded.shape == (8, 64) and recorded.output.dtype == torch.bfloat16
    assert recorded.describe_row(1).startswith("row 1 (token 0")
    field = ErrorField.of(recorded)
    bad_rows = sorted({row for row, _ in torch.nonzero(field.bad()).tolist()})
    assert bad_rows == [1]  # the row the capture tripled, as the engine's verdict says
    assert outcome.report.recorded is not None and outcome.report.recorded.bad_rows == 1
    quick = run_replay(ReplayRequest(marlin_capture, 0, (), "reference", tensors=False))
    assert quick.tensors == {} and quick.report.headline.text == "corrupt (recorded)"


def test_repro_export_writes_in_the_state_directory_and_replaces_on_re_export(
    marlin_capture: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    monkeypatch.setenv("MOEREPLAY_STATE_DIR", str(state))
    first = export_repro(marlin_capture, 0)
    assert isinstance(first, Path), first
    assert first.parent == state / "repro" == repro_root()
    assert first.name.startswith(f"{marlin_capture.name}-") and first.name.endswith(".repro-call0")
    assert not marlin_capture.with_name(
        f"{marlin_capture.name}.repro-call0"
    ).exists()  # never beside the capture
    assert not [path for path in marlin_capture.resolve().parent.iterdir() if "repro" in path.name]
    assert (first / "repro.py").is_file()
    again = export_repro(marlin_capture, 0)  # the TUI may export the same call twice
    assert again == first and (again / "repro.py").is_file()


def test_repro_export_of_a_missing_call_says_why(marlin_capture: Path) -> None:
    result = export_repro(marlin_capture, 99)
    assert isinstance(result, ReproUnavailable)
    assert result.reason.startswith("repro export failed:") and "99" in result.reason


def test_error_field_judges_beyond_the_rounding_allowance_as_the_replay_does() -> None:
    reference = torch.ones(3, 8)
    output = reference.clone()
    output[0, 1] = 1.04  # 0.04 off: inside a 0.05 allowance
    output[1, 2] = 1.30  # 0.30 off: 0.25 beyond it
    allowance = torch.full((3, 8), 0.05)
    plain = ErrorField.of(tensors(output, reference))
    allowed = ErrorField.of(
        VariantTensors(output, reference, torch.ones(3, dtype=torch.bool), None, allowance, "atomic add")
    )
    assert bool(plain.bad()[0, 1]) and bool(plain.bad()[1, 2])
    assert not bool(allowed.bad()[0, 1]) and float(allowed.relative[0, 1]) == 0.0
    assert bool(allowed.bad()[1, 2]) and float(allowed.relative[1, 2]) == pytest.approx(0.25, rel=1e-4)
    assert allowed.tolerance_name == "fp32+atomic add" and allowed.first_bad() == (1, 2)
    wrong_shape = VariantTensors(
        output, reference, torch.ones(3, dtype=torch.bool), None, torch.zeros(2, 2), "x"
    )
    assert ErrorField.of(wrong_shape).tolerance_name == "fp32"  # an allowance of another view is not used


def test_a_variant_judged_beyond_a_rounding_bound_hands_it_to_the_heat_map(tmp_path: Path) -> None:
    """A call launched with atomics, judged offline: its recorded output is judged beyond the rounding bound of
    that launch, and the heat map gets the bound."""
    from moereplay.format import CaptureWriter

    args, output = marlin_call(0)
    args["use_atomic_add"] = True
    path = tmp_path / "atomic.moe.zst"
    with CaptureWriter(path) as writer:
        index = writer.begin_call("moe_wna16_marlin_gemm", args)
        writer.complete_call(index, {"output": output, "return": output})
    outcome = run_replay(ReplayRequest(path, 0, (), "reference"))
    atomic = outcome.tensors["recorded"]
    assert atomic.allowance is not None and atomic.allowance.shape == atomic.reference.shape
    assert atomic.allowance_label and bool((atomic.allowance >= 0).all())
    assert ErrorField.of(atomic).tolerance_name.endswith("+" + atomic.allowance_label)


def test_repro_directory_without_a_state_variable_is_under_the_working_directory(tmp_path: Path) -> None:
    capture = tmp_path / "bundled" / "x.moe.zst"
    other = tmp_path / "elsewhere" / "x.moe.zst"
    folder = default_repro_dir(capture, 3, environ={})
    assert folder.parent == Path("moereplay-captures") / "repro"
    assert folder.name.startswith("x.moe.zst-") and folder.name.endswith(".repro-call3")
    assert default_repro_dir(other, 3, environ={}) != folder  # two captures of one name do not share it
    assert default_repro_dir(capture, 3, environ={"MOEREPLAY_STATE_DIR": "/s"}).parent == Path("/s/repro")


def test_argument_nodes_show_a_recipe_tensor_by_its_dtype_and_shape() -> None:
    """A weight stored as a seeded recipe reads as the tensor it stands for, not as ``<TensorRecipe>``."""
    capture = Path(__file__).resolve().parents[2] / "captures" / "marlin-nvfp4-report.moe.zst"
    catalog = CallCatalog(capture)
    try:
        record = catalog.record(0)
    finally:
        catalog.close()
    by_name = {node.name: node for node in argument_nodes(record, get_op(record.op))}
    weights = by_name["b_qweight"]
    assert weights.kind == "tensor" and weights.value == "int32[32,184,5760] (recipe)"
    details = dict(weights.details)
    assert details["dtype"] == "int32" and details["shape"].startswith("(32, ")
    assert details["stored as"].endswith("recipe, expanded when loaded")
    assert "static" in weights.tags and not weights.children
