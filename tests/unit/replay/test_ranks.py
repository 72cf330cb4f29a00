"""Several ranks' files side by side, and the cross-rank check against the single-GPU fp64 layer output.

The captures are made the way vLLM 0.25.1's ranks see one Marlin layer call (``moereplay.synth.ranks``): TP ranks
hold a slice of every expert's intermediate columns, EP ranks whole experts behind an expert map.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moereplay.errors import SettingsError
from moereplay.format import CaptureReader
from moereplay.ops.layers import get_layer_reference
from moereplay.replay.ranks import ParallelMode, check_ranks, merge_calls
from moereplay.synth.ranks import linear_expert_map, write_rank_captures


@pytest.fixture(scope="module")
def tp_files(tmp_path_factory: pytest.TempPathFactory):
    return write_rank_captures(tmp_path_factory.mktemp("tp"), "tp")


@pytest.fixture(scope="module")
def ep_files(tmp_path_factory: pytest.TempPathFactory):
    return write_rank_captures(tmp_path_factory.mktemp("ep"), "ep", experts=5)


def _sum_of_rank_references(paths: tuple[Path, ...]) -> torch.Tensor:
    layer = get_layer_reference("fused_marlin_moe")
    total = None
    for path in paths:
        with CaptureReader(path) as reader:
            own = layer.reference(reader.load_args(0), reader.call(0).context)
        total = own if total is None else total + own
    assert total is not None
    return total


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_rank_references_sum_to_the_single_gpu_layer(mode: str, tp_files, ep_files) -> None:
    captures = tp_files if mode == "tp" else ep_files
    combined = _sum_of_rank_references(captures.paths)
    torch.testing.assert_close(combined, captures.single_gpu, rtol=1e-9, atol=1e-9)
    one_rank = _sum_of_rank_references(captures.paths[:1])  # one rank alone is not the layer
    assert not torch.allclose(one_rank, captures.single_gpu, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_correct_ranks_pass_the_cross_rank_check(mode: str, tp_files, ep_files) -> None:
    captures = tp_files if mode == "tp" else ep_files
    [result] = check_ranks(captures.paths)
    assert result.mode is ParallelMode(mode)
    assert result.ok, result.to_json()
    assert result.merged.ranks == (0, 1)
    assert set(result.partials) == {0, 1}
    # the combined recording really is the single-GPU output, to bf16 rounding
    with CaptureReader(captures.paths[0]) as a, CaptureReader(captures.paths[1]) as b:
        total = a.load_outputs(0)["return"].double() + b.load_outputs(0)["return"].double()
    assert (total - captures.single_gpu).abs().max() < 0.02 * captures.single_gpu.abs().max()


def test_a_corrupt_partial_fails_and_names_its_rank(tmp_path: Path) -> None:
    captures = write_rank_captures(tmp_path, "tp", corrupt=(1, 3))
    [result] = check_ranks(captures.paths)
    assert not result.ok
    assert not result.combined.ok and result.combined.bad_rows == 1
    assert result.partials[0].ok and not result.partials[1].ok
    assert "3" in (result.partials[1].first_bad or "")


def test_ep_checks_expert_coverage_and_replicated_inputs(tmp_path: Path) -> None:
    captures = write_rank_captures(tmp_path, "ep", experts=4, ranks=2)
    # the same rank file twice under two names is refused (duplicate rank), not silently counted twice
    with pytest.raises(SettingsError, match="both rank 0"):
        check_ranks([captures.paths[0], captures.paths[0]])
    # rank 1 routed differently: a replicated input that differs is a problem of its own
    other = write_rank_captures(tmp_path / "other", "ep", experts=4, ranks=2, seed=1)
    [result] = check_ranks([captures.paths[0], other.paths[1]])
    assert not result.ok
    assert any(problem.startswith("topk_ids: rank 1 differs from rank 0") for problem in result.problems)


def test_linear_expert_map_matches_vllms_rule() -> None:
    # 5 experts over 2 ranks: the first rank takes the remainder (vLLM's determine_expert_map, "linear")
    assert linear_expert_map(5, 2, 0).tolist() == [0, 1, 2, -1, -1]
    assert linear_expert_map(5, 2, 1).tolist() == [-1, -1, -1, 0, 1]


def test_merge_lines_up_ranks_and_filters_by_rank(tp_files) -> None:
    rows = merge_calls(tp_files.paths)
    assert len(rows) == 1 and rows[0].ranks == (0, 1) and rows[0].op == "fused_marlin_moe"
    assert (
        merge_calls(tp_files.paths, rank=1)[0].calls[0].rank == 0
    )  # a row rank 1 took part in, all ranks shown
    assert merge_calls(tp_files.paths, rank=7) == []


def test_one_file_is_not_a_cross_rank_check(tp_files) -> None:
    with pytest.raises(SettingsError, match="two or more"):
        check_ranks(tp_files.paths[:1])


def test_cli_ranks_ls_check_and_ls_rank(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from moereplay.cli import app

    captures = write_rank_captures(tmp_path, "ep", experts=4, corrupt=(0, 2))
    files = [str(path) for path in captures.paths]
    runner = CliRunner()
    listed = runner.invoke(app, ["ranks", "ls", *files])
    assert listed.exit_code == 0, listed.output
    assert listed.output.splitlines()[0].split() == ["step", "layer", "op", "rank0", "rank1"]
    assert "fused_marlin_moe  #0     #0" in listed.output
    checked = runner.invoke(app, ["ranks", "check", *files])
    assert checked.exit_code == 1, checked.output
    assert "[ep × 2] FAILED" in checked.output and "rank 0 (call #0): 1/16 bad rows" in checked.output
    assert "rank 1 (call #0): ok" in checked.output
    document = runner.invoke(app, ["ranks", "check", *files, "--json", "--mode", "ep"])
    assert '"failed": true' in document.output
    bad = runner.invoke(app, ["ranks", "check", *files, "--mode", "pp"])
    assert bad.exit_code != 0 and "--mode must be auto, tp or ep" in str(bad.exception)
    assert runner.invoke(app, ["ls", files[1], "--rank", "1"]).output.count("fused_marlin_moe") == 1
    assert "fused_marlin_moe" not in runner.invoke(app, ["ls", files[1], "--rank", "0"]).output


def test_the_layer_bounds_allow_the_chains_stored_roundings_and_no_more(tp_files) -> None:
    from moereplay.reference.compare import TOLERANCE_BF16, compare

    layer = get_layer_reference("fused_marlin_moe")
    assert layer.roundings == 4
    chained = TOLERANCE_BF16.chained(layer.roundings)
    assert (chained.max_rel, chained.rms_rel) == (4 * TOLERANCE_BF16.max_rel, 4 * TOLERANCE_BF16.rms_rel)
    assert TOLERANCE_BF16.chained(1) is TOLERANCE_BF16
    with CaptureReader(tp_files.paths[0]) as reader:
        args, context = reader.load_args(0), reader.call(0).context
    exact = layer.reference(args, context)
    stored = layer.reference(args, context, store=torch.bfloat16)
    assert not torch.equal(stored, exact)  # the stored chain really differs from the unrounded reference
    assert compare(stored.to(torch.bfloat16), exact, profile=chained).ok
    # a row scaled by 1.1 (a wrong routing weight of similar size) is still caught under the chained bounds
    wrong = stored.clone()
    wrong[2] *= 1.1
    result = compare(wrong.to(torch.bfloat16), exact, profile=chained)
    assert not result.ok and [int(r) for r in result.bad_rows] == [2]


def test_the_reference_device_is_checked_before_any_work(tp_files) -> None:
    with pytest.raises(SettingsError, match="not a torch device"):
        check_ranks(tp_files.paths, device="bogus")
    [result] = check_ranks(tp_files.paths, device="cpu")
    assert result.ok
