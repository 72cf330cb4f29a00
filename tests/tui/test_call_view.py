"""The call view over real Marlin calls replayed with the reference backend: the matrix, mutations, the diff view,
the heat map, the argument tree with contract violations, the findings and their suggestions."""

from __future__ import annotations

from pathlib import Path

from textual.widgets import TabbedContent
from tui_helpers import Notes, make_app, run_async, settle, until_focused

from moereplay.tui.screens.call import CallScreen
from moereplay.tui.screens.dialogs import MutationDialog
from moereplay.tui.widgets.call.argument_tree import ArgumentTree
from moereplay.tui.widgets.call.diff_view import DiffView
from moereplay.tui.widgets.call.findings_panel import FindingsPanel
from moereplay.tui.widgets.call.heat_map import HeatMap
from moereplay.tui.widgets.call.variant_matrix import VariantMatrix


async def open_call(pilot, rows_down: int = 0) -> CallScreen:  # type: ignore[no-untyped-def]
    for _ in range(rows_down):
        await pilot.press("down")
    await pilot.press("enter")
    await settle(pilot)
    screen = pilot.app.screen
    assert isinstance(screen, CallScreen)
    return screen


@run_async
async def test_opening_a_call_replays_it_and_fills_every_tab(marlin_capture: Path) -> None:
    app = make_app(marlin_capture)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_call(pilot)
        assert screen.outcome is not None
        report = screen.outcome.report
        assert report.recorded is not None and report.recorded.verdict.value == "corrupt"
        assert report.recorded.bad_rows == 1
        assert report.baseline.verdict.value == "needs-kernel"  # offline: nothing replays
        matrix = screen.query_one(VariantMatrix)
        assert matrix.labels == ("recorded", "baseline")
        assert screen.variant == "recorded"
        kinds = {finding.kind.value for finding in screen.query_one(FindingsPanel).findings}
        assert {"corrupt_rows", "diagnosis"} <= kinds
        heat = screen.query_one(HeatMap)
        grid = heat.grid
        assert grid is not None
        row_max = grid.row_maximum()
        assert float(row_max[1]) > grid.tolerance  # the tripled row
        assert all(float(row_max[row]) <= grid.tolerance for row in range(grid.rows) if row != 1)
        assert screen.violations == ()
        assert app.verdicts[0] == "corrupt"


@run_async
async def test_add_rerun_and_remove_mutations(marlin_capture: Path) -> None:
    app = make_app(marlin_capture)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_call(pilot)
        await pilot.press("a")
        assert isinstance(app.screen, MutationDialog)
        await until_focused(pilot, "mutation-value")
        await pilot.press(*"no_such_flag", "enter")
        assert isinstance(app.screen, MutationDialog)  # refused, with the engine's reason
        assert "no argument 'no_such_flag'" in str(app.screen.query_one("#mutation-error").render())
        await pilot.press(*(["backspace"] * 12), *"mul_topk_weights", "enter")
        assert app.screen is screen
        assert screen.mutations == ["flip mul_topk_weights"]
        assert screen.query_one(VariantMatrix).labels == ("recorded", "baseline", "flip mul_topk_weights")
        screen.add_mutation("sweep moe_block_size=8,32")
        assert screen.query_one(VariantMatrix).labels[-2:] == (
            "set moe_block_size=8",
            "set moe_block_size=32",
        )
        await pilot.press("r")
        await settle(pilot)
        assert screen.outcome is not None
        verdicts = {result.label: result.verdict.value for result in screen.outcome.report.results}
        assert verdicts == {
            "recorded": "corrupt",
            "baseline": "needs-kernel",
            "flip mul_topk_weights": "corrupt",  # the recorded output is not what the flipped call computes
            "set moe_block_size=8": "needs-kernel",  # a launch setting: only a kernel run can answer
            "set moe_block_size=32": "needs-kernel",
        }
        matrix = screen.query_one(VariantMatrix)
        matrix.focus()
        matrix.move_cursor(row=2)
        await pilot.pause()
        assert screen.variant == "flip mul_topk_weights"
        await pilot.press("d")
        assert screen.mutations == ["sweep moe_block_size=8,32"]
        assert matrix.labels == ("recorded", "baseline", "set moe_block_size=8", "set moe_block_size=32")
        matrix.move_cursor(row=0)
        await pilot.pause()
        await pilot.press("d")
        assert screen.mutations == ["sweep moe_block_size=8,32"]  # the recorded row stays


@run_async
async def test_diff_window_moves_and_jumps_to_the_first_bad_element(marlin_capture: Path) -> None:
    app = make_app(marlin_capture)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_call(pilot)
        await pilot.press("3")
        diff = screen.query_one(DiffView)
        assert screen.query_one(TabbedContent).active == "diff"
        assert diff.has_focus
        assert diff.panes is not None and diff.panes.label == "recorded"
        rows, cols = diff.window
        assert cols >= 2
        assert diff.origin == (0, 0)
        await pilot.press("right", "right")
        assert diff.origin == (0, 2 * cols)
        await pilot.press("end")  # not bound: nothing moves
        await pilot.press("f")
        first = diff.panes.variant_errors.first_bad()
        assert first is not None and first[0] == 1
        assert diff.origin[1] <= first[1] < diff.origin[1] + cols
        assert diff.origin[0] <= 1 < diff.origin[0] + rows


@run_async
async def test_heat_map_cell_opens_in_the_diff_view(marlin_capture: Path) -> None:
    app = make_app(marlin_capture)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_call(pilot)
        await pilot.press("4")
        heat = screen.query_one(HeatMap)
        assert heat.has_focus
        await pilot.press("down", "right", "right")
        assert heat.cursor == (1, 2)
        assert "max rel" in heat.describe_cursor()
        grid = heat.grid
        assert grid is not None
        await pilot.press("enter")
        await pilot.pause()
        assert screen.query_one(TabbedContent).active == "diff"
        diff = screen.query_one(DiffView)
        assert diff.origin[1] <= grid.columns(2)[0] < diff.origin[1] + diff.window[1]


@run_async
async def test_contract_violation_is_flagged_and_its_suggestion_added(violation_capture: Path) -> None:
    app = make_app(violation_capture)
    notes = Notes(app)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_call(pilot)
        assert screen.violations is not None
        assert [(v.arg, v.aspect) for v in screen.violations] == [("topk_weights", "dtype")]
        tree = screen.query_one(ArgumentTree)
        assert tree.flagged == ("topk_weights",)
        await pilot.press("5")
        panel = screen.query_one(FindingsPanel)
        assert panel.has_focus
        position = next(
            number
            for number, finding in enumerate(panel.findings)
            if finding.kind.value == "contract_violation"
        )
        panel.highlighted = position
        await pilot.press("enter")
        await pilot.pause()
        assert screen.mutations == ["cast topk_weights=float32"]
        assert screen.query_one(TabbedContent).active == "variants"
        assert "added cast topk_weights=float32; r reruns" in notes


@run_async
async def test_rows_the_replay_adds_on_its_own_are_shown_and_stay(violation_capture: Path) -> None:
    """The bf16 routing weights' contract predicts reads past their end: the replay runs the guard fills that test
    it unasked (offline: needs-kernel rows), and the matrix shows them beside the rows the user asked for."""
    app = make_app(violation_capture)
    notes = Notes(app)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_call(pilot)
        matrix = screen.query_one(VariantMatrix)
        assert matrix.labels == ("recorded", "baseline", "fill 0xff", "fill 0x00")
        assert screen.outcome is not None
        verdicts = {result.label: result.verdict.value for result in screen.outcome.report.results}
        assert verdicts["fill 0xff"] == verdicts["fill 0x00"] == "needs-kernel"
        assert screen.outcome.report.headline.verdict.value == "ok"  # needs-kernel rows fail nothing
        matrix.move_cursor(row=matrix.labels.index("fill 0xff"))
        await pilot.press("d")
        await pilot.pause()
        assert matrix.labels == ("recorded", "baseline", "fill 0xff", "fill 0x00")
        assert "run by the replay itself" in notes


@run_async
async def test_the_matrix_draws_new_rows_whole_before_the_table_goes_idle(marlin_capture: Path) -> None:
    """A line drawn between ``show`` and the table's next idle keeps every cell whole: the columns are sized from
    the rows as they are shown (Textual's own sizing, run when idle, left the lines drawn before it cut)."""
    app = make_app(marlin_capture)
    async with app.run_test(size=(160, 24)) as pilot:
        screen = await open_call(pilot)
        assert screen.outcome is not None
        matrix = screen.query_one(VariantMatrix)
        results = screen.outcome.report.results
        label = "set moe_block_size=64 with a label wider than any shown before"
        matrix.show(results, ("baseline", label))
        lines = [matrix.render_line(y).text for y in range(1 + len(matrix.labels))]  # no pause: not idle yet
        assert label in lines[-1]
        recorded = next(result for result in results if result.label == "recorded")
        assert f"{recorded.max_rel:.2e}" in lines[1]


@run_async
async def test_call_of_an_unknown_op_is_shown_without_replaying(stream_capture: Path) -> None:
    app = make_app(stream_capture)
    notes = Notes(app)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_call(pilot, rows_down=0)  # #0 fused_marlin_moe
        assert screen.op is None and screen.outcome is None
        assert [node.name for node in screen.query_one(ArgumentTree).nodes_shown] == ["top_k"]
        await pilot.press("r")
        assert "cannot replay fused_marlin_moe" in notes
