"""The shape bisection of a ``matmul_ogs`` call on CPU: the op's real dimensions and shrinker, judged by predicates
that stand for what the Hopper kernel does (the reference executor has no over-read to find).

- a synthetic predicate that fails iff K % 128 != 0;
- a model of the unmasked scale over-read (:mod:`moereplay.reference.hopper_mxfp4`) read off each *shrunk* call's own
  tensors — the bytes its swizzled scale rows hold against the bytes a K loop of whole 128-wide tiles reads, the
  weight columns whose scales sit in the last swizzled row, and whether the last expert has rows — under the fill the
  bisect applies (``-m "fill 0xff"``), driven through ``moereplay bisect`` itself;
- the real replay engine with the reference backend: a shrunk call has no captured output to judge, so the bisect
  says it needs a kernel backend before any probe runs — never "passes", never "does not fail".
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ogs_calls
import pytest
import torch
from typer.testing import CliRunner

from moereplay.bisect import Observation, ShapeSearch, Signature, run_to_end
from moereplay.bisect.probes import ShapeProbe
from moereplay.bisect.replay_wiring import ReplayWiring
from moereplay.cli import app, bisect_cmd
from moereplay.ops import get_op
from moereplay.ops.matmul_ogs import plain_args, problem_of, scale_bytes_read
from moereplay.reference.hopper_mxfp4 import scale_overrun

OP = get_op("matmul_ogs")
EXPERTS, K, N, TOKENS, TOP_K = 8, 320, 640, 6, 4
SIGNATURE = Signature("corrupt", frozenset({"corrupt_rows", "oob_read"}), frozenset({EXPERTS - 1}))


@pytest.fixture(scope="module")
def w13() -> dict[str, Any]:
    return ogs_calls.w13_call(ogs_calls.logical(EXPERTS, K, N, TOKENS, TOP_K, seed=5))


def shrunk_and_checked(args: Mapping[str, Any], shape: Mapping[str, int]) -> tuple[dict[str, Any], Any]:
    """The shrunk call and its reference (a call the reference cannot compute would raise)."""
    dimensions = {d.name: d.original for d in OP.shape_dimensions(args)}  # type: ignore[attr-defined]
    shrunk = OP.shrink(args, {**dimensions, **shape})  # type: ignore[attr-defined]
    return shrunk, OP.reference(shrunk)


def over_read_fails(args: Mapping[str, Any], reference: Any, fill: int) -> bool:
    """Whether the Hopper kernel's output would change under ``fill``: bytes past the scale allocation are read
    (the rows are shorter than the K loop reads), they are scales of real weight columns, the last expert computes
    rows, and the fill byte decodes to Inf (0xff)."""
    plain = plain_args(args)
    storage = plain["precision_config"].weight_scale.storage
    row_bytes = int(storage.shape[-2])  # a transposed view of [E, N_pad / 32, row bytes]
    problem = problem_of(args)
    read = scale_bytes_read(args)
    columns = scale_overrun(problem.n, problem.k).last_row_columns
    last_expert_rows = bool((reference.rows.expert == problem.experts - 1).any())
    return fill == 0xFF and read is not None and read > row_bytes and bool(columns) and last_expert_rows


def test_a_synthetic_misaligned_k_failure_is_reported_by_alignment(w13: dict[str, Any]) -> None:
    def predicate(probe: ShapeProbe) -> Observation:
        shape = dict(probe.shape)
        shrink_and_reference = shrunk_and_checked(w13, shape)
        assert shrink_and_reference[1].output.shape[0] == shape["tokens"] * shape["top_k"]
        return Observation.bad(SIGNATURE) if shape["K"] % 128 else Observation.good()

    result = run_to_end(ShapeSearch(OP.shape_dimensions(w13)), predicate)  # type: ignore[attr-defined]
    # N keeps its residue (640 % 256 = 128) while it shrinks (N = 128 does not compile with 8 warps); its residue
    # probes then show that the residue does not matter here
    assert dict(result.minimal) == {"experts": 1, "K": 64, "N": 384, "tokens": 1, "top_k": 1}
    reports = {report.name: report for report in result.dimensions}
    assert reports["K"].by_alignment and reports["K"].role == "matters"
    assert reports["K"].alignment is not None
    assert reports["K"].alignment.failing_residues == (32, 64, 96)
    assert reports["K"].alignment.passing_residues == (0,)
    assert {name: reports[name].role for name in ("experts", "N", "tokens", "top_k")} == dict.fromkeys(
        ("experts", "N", "tokens", "top_k"), "free"
    )
    assert not reports["N"].by_alignment
    text = "\n".join(result.lines())
    assert "K: matters by alignment — fails when K % 128 is 32, 64 or 96" in text
    assert "N % 256 does not matter" in text


class OverReadModel:
    """A :class:`~moereplay.bisect.replay_wiring.Judge` that loads the captured call, shrinks it with the op,
    computes its reference, and judges it with :func:`over_read_fails` under the fill of the mutations given."""

    def __init__(self, capture: Path) -> None:
        self.capture = capture
        self.seen: list[tuple[tuple[str, ...], Mapping[str, int] | None]] = []
        self._args: dict[str, Any] | None = None

    def args(self, call: int) -> dict[str, Any]:
        if self._args is None:
            from moereplay.replay import load_call

            self._args = dict(load_call(self.capture, call, "cpu").args)
        return self._args

    def shapes(self, capture: Path, call: int) -> tuple[tuple[Any, ...], None]:
        return tuple(OP.shape_dimensions(self.args(call))), None  # type: ignore[attr-defined]

    def __call__(
        self, call: int, mutations: Sequence[str], backend: str | None, shape: Mapping[str, int] | None
    ) -> Observation:
        from moereplay.replay.engine import parse_variants

        self.seen.append((tuple(mutations), shape))
        fills = [variant.fill.byte for variant in parse_variants(OP, list(mutations))]
        args, reference = shrunk_and_checked(self.args(call), shape or {})
        if over_read_fails(args, reference, fills[-1] if fills else 0x00):
            return Observation.bad(SIGNATURE, "model: 0xff past the scale allocation")
        return Observation.good()


@pytest.fixture
def capture(tmp_path: Path, w13: dict[str, Any]) -> Path:
    from moereplay.format import CaptureWriter

    path = tmp_path / "ogs.moe.zst"
    with CaptureWriter(path) as writer:
        index = writer.begin_call("matmul_ogs", w13, site="tests.ogs", context={"gemm": "w13"})
        writer.complete_call(index, {"y": torch.zeros_like(w13["y"])})
    return path


def bisect(monkeypatch: pytest.MonkeyPatch, wiring: ReplayWiring, *args: str) -> tuple[int, dict[str, Any]]:
    monkeypatch.setattr(bisect_cmd, "wiring_factory", lambda: wiring)
    result = CliRunner().invoke(
        app, ["bisect", *args, "--strategy", "shape", "--call", "0", "--no-tui", "--json", "--fresh"]
    )
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, json.loads(result.output)


def test_the_over_read_model_under_fill_0xff_shrinks_to_a_tiny_call_and_k_matters_by_alignment(
    capture: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = OverReadModel(capture)
    code, document = bisect(
        monkeypatch, ReplayWiring(judge=model, shapes=model.shapes), str(capture), "-m", "fill 0xff"
    )
    assert code == 0, document
    result = document["summary"]["result"]
    assert result["status"] == "shrunk"
    assert result["minimal"] == {"experts": 1, "K": 64, "N": 384, "tokens": 1, "top_k": 1}
    reports = {report["name"]: report for report in result["dimensions"]}
    k = reports["K"]
    assert k["role"] == "matters" and k["by_alignment"]
    # the truth of the mechanism: rows of 32 · ceil_even(K / 32) bytes, 128-byte K tiles read whole
    assert k["alignment"]["failing_residues"] == [32, 64]
    assert k["alignment"]["passing_residues"] == [0, 96]
    # the over-read lands on real columns only when the last swizzled N slab reaches column 112
    assert reports["N"]["by_alignment"] and reports["N"]["alignment"]["passing_residues"] == [64]
    assert reports["N"]["alignment"]["failing_residues"] == [0, 128, 192]
    assert {name: reports[name]["role"] for name in ("experts", "tokens", "top_k")} == dict.fromkeys(
        ("experts", "tokens", "top_k"), "free"
    )
    assert all(mutations == ("fill 0xff",) for mutations, _ in model.seen)  # every probe under the fill


def test_without_the_fill_the_call_does_not_fail_and_nothing_is_shrunk(
    capture: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = OverReadModel(capture)
    code, document = bisect(monkeypatch, ReplayWiring(judge=model, shapes=model.shapes), str(capture))
    assert code == 1
    assert document["summary"]["result"]["status"] == "not_reproduced"
    assert len(model.seen) == 1


def test_through_the_replay_engine_offline_the_shape_strategy_needs_a_kernel_backend(
    capture: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offline a shrunk call has no captured output to judge: the bisect says it needs a kernel backend before any
    probe runs (it used to end "not reproduced: the original shape does not fail"), and writes no log."""
    wiring = ReplayWiring(replay_options={"device": "cpu", "isolate": False})
    monkeypatch.setattr(bisect_cmd, "wiring_factory", lambda: wiring)
    for strategy in ("shape", "mutations"):
        args = ["bisect", str(capture), "-s", strategy, "--call", "0", "--backend", "reference", "--no-tui"]
        result = CliRunner().invoke(app, [*args, "-m", "fill 0xff"])
        assert result.exit_code != 0
        message = str(result.exception)
        assert f"--strategy {strategy} needs a kernel backend" in message, message
        assert "does not fail" not in result.output
