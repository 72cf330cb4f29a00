"""SVG snapshots of every screen at 80×24 (``pytest --snapshot-update`` accepts new ones after a look)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from textual.pilot import Pilot
from textual.widgets import Input
from tui_helpers import make_app, settle, until, until_focused, until_painted

from moereplay.bisect import FirstBadSearch, Observation, Session, Signature
from moereplay.bisect.probes import ItemProbe
from moereplay.tui.app import MoereplayApp
from moereplay.tui.bisect_sessions import BisectLaunch
from moereplay.tui.widgets.call.variant_matrix import VariantMatrix

SIZE = (80, 24)


def steady(run_before: Callable[[Pilot[Any]], Awaitable[None]]) -> Callable[[Pilot[Any]], Awaitable[None]]:
    """``run_before``, then stop every text cursor blinking (shown, steady): a blink timer that fires between the last
    key and the screenshot made the mutation-dialog snapshot fail on a loaded CI machine."""

    async def run(pilot: Pilot[Any]) -> None:
        await run_before(pilot)
        for screen in pilot.app.screen_stack:
            for field in screen.query(Input):
                field.cursor_blink = False
        await pilot.pause()

    return run


async def quiet(pilot: Pilot[Any]) -> None:
    await settle(pilot)
    pilot.app.clear_notifications()
    await pilot.pause()


def test_browser_with_verdicts(snap_compare: Any, stream_capture: Path) -> None:
    async def run_before(pilot: Pilot[Any]) -> None:
        await pilot.press("R")
        await quiet(pilot)
        await pilot.press("home", "n")

    assert snap_compare(make_app(stream_capture), terminal_size=SIZE, run_before=steady(run_before))


def test_browser_filtered(snap_compare: Any, synthetic_capture: Path) -> None:
    async def run_before(pilot: Pilot[Any]) -> None:
        await pilot.press("slash", *"op:matmul* step:1-3")
        await pilot.press("enter")
        await quiet(pilot)

    assert snap_compare(make_app(synthetic_capture), terminal_size=SIZE, run_before=steady(run_before))


async def open_with_variant(pilot: Pilot[Any]) -> None:
    await pilot.press("enter")
    await quiet(pilot)
    pilot.app.screen.add_mutation("flip mul_topk_weights")  # type: ignore[attr-defined]
    await pilot.press("r")
    await quiet(pilot)


def test_call_view_variant_matrix(snap_compare: Any, marlin_capture: Path) -> None:
    assert snap_compare(make_app(marlin_capture), terminal_size=SIZE, run_before=steady(open_with_variant))


def test_call_view_diff(snap_compare: Any, marlin_capture: Path) -> None:
    async def run_before(pilot: Pilot[Any]) -> None:
        await pilot.press("enter")
        await quiet(pilot)
        await pilot.press("3", "f")
        await pilot.pause()

    assert snap_compare(make_app(marlin_capture), terminal_size=SIZE, run_before=steady(run_before))


def test_call_view_heat_map(snap_compare: Any, marlin_capture: Path) -> None:
    async def run_before(pilot: Pilot[Any]) -> None:
        await pilot.press("enter")
        await quiet(pilot)
        await pilot.press("4", "down")
        await pilot.pause()

    assert snap_compare(make_app(marlin_capture), terminal_size=SIZE, run_before=steady(run_before))


def test_call_view_arguments_with_a_violation(snap_compare: Any, violation_capture: Path) -> None:
    async def run_before(pilot: Pilot[Any]) -> None:
        await pilot.press("enter")
        await quiet(pilot)
        await pilot.press("1")
        await pilot.pause()

    assert snap_compare(make_app(violation_capture), terminal_size=SIZE, run_before=steady(run_before))


def test_call_view_findings(snap_compare: Any, marlin_capture: Path) -> None:
    async def run_before(pilot: Pilot[Any]) -> None:
        await pilot.press("enter")
        await quiet(pilot)
        await pilot.press("5")
        await pilot.pause()

    assert snap_compare(make_app(marlin_capture), terminal_size=SIZE, run_before=steady(run_before))


def test_mutation_dialog(snap_compare: Any, marlin_capture: Path) -> None:
    async def run_before(pilot: Pilot[Any]) -> None:
        await pilot.press("enter")
        await quiet(pilot)
        # the matrix beside the dialog shows the replay's rows once its result message is handled, which may come
        # a moment after the worker ended (the long-standing flake: the snapshot caught the matrix still empty)
        screen = pilot.app.screen
        await until(pilot, lambda: getattr(screen, "outcome", None) is not None)
        # ... and the screen must have painted the matrix's rows before the dialog covers it: the screen below a
        # dialog keeps its last paint. (The flake that remained, 3 in 16 under three busy processes, was the matrix
        # itself: Textual sized its columns only when idle and kept lines drawn before, numbers cut; the matrix now
        # sizes its columns as it shows rows — 0 in 24 since.)
        matrix = screen.query_one(VariantMatrix)
        await until(pilot, lambda: bool(matrix.row_count))
        await until_painted(pilot, matrix, lines=1 + matrix.row_count)  # its header and every row, laid out
        await pilot.press("a")
        await until_focused(pilot, "mutation-value")
        await pilot.press(*"mul_topk")
        await pilot.pause()

    assert snap_compare(make_app(marlin_capture), terminal_size=SIZE, run_before=steady(run_before))


def test_bisect_dialog(snap_compare: Any, stream_capture: Path) -> None:
    async def run_before(pilot: Pilot[Any]) -> None:
        await pilot.press("end", "b")
        await pilot.pause()

    assert snap_compare(make_app(stream_capture), terminal_size=SIZE, run_before=steady(run_before))


def test_bisect_session_with_a_person_override(snap_compare: Any, workdir: Path) -> None:
    target = Signature("corrupt", frozenset({"corrupt_rows", "wrong_coefficient"}), frozenset({3}))

    def predicate(probe: ItemProbe[int]) -> Observation:
        return Observation.bad(target, "1/8 rows bad") if probe.index >= 41 else Observation.good()

    labels = [f"#{n + 1} moe_wna16_marlin_gemm (step {n // 24}, layer {n % 24})" for n in range(96)]
    search = FirstBadSearch(list(range(96)), labels=labels)
    log = workdir / "run.moe.zst.bisect-calls.jsonl"
    session = Session(search, predicate, log_path=log, capture="run.moe.zst")
    app = MoereplayApp(bisect=BisectLaunch(session, "96 calls of run.moe.zst by step and layer"))

    async def run_before(pilot: Pilot[Any]) -> None:
        for key in ("space", "space", "b", "space", "e"):
            await pilot.press(key)
            await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=steady(run_before))


def test_help(snap_compare: Any, marlin_capture: Path) -> None:
    assert snap_compare(make_app(marlin_capture), terminal_size=SIZE, press=["question_mark"])
