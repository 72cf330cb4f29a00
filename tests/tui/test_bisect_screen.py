"""The bisect screen: a real first-bad-call bisect through the replay engine, person overrides, the log, resuming,
predicate failures and the export-repro action."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from textual.widgets import DataTable
from tui_helpers import Notes, make_app, run_async, settle

from moereplay.bisect import FirstBadSearch, Observation, Session, Signature
from moereplay.bisect.log import default_log_path
from moereplay.bisect.observation import Decider
from moereplay.bisect.probes import ItemProbe
from moereplay.errors import ReplayError
from moereplay.tui.app import MoereplayApp
from moereplay.tui.bisect_sessions import BisectLaunch, call_to_export
from moereplay.tui.repro import repro_root
from moereplay.tui.screens.bisect import BisectScreen
from moereplay.tui.screens.dialogs import BisectDialog

TARGET = Signature("corrupt", frozenset({"corrupt_rows"}))


async def start_calls_bisect(pilot, app: MoereplayApp) -> BisectScreen:  # type: ignore[no-untyped-def]
    await pilot.press("end", "b")
    assert isinstance(app.screen, BisectDialog)
    await pilot.click("#bisect-start")
    await settle(pilot)
    screen = app.screen
    assert isinstance(screen, BisectScreen)
    return screen


@run_async
async def test_first_bad_call_of_a_real_stream(stream_capture: Path) -> None:
    app = make_app(stream_capture)
    notes = Notes(app)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await start_calls_bisect(pilot, app)
        session = screen.session
        assert session.search.kind == "calls" and not session.done
        await pilot.press("p")
        await settle(pilot)
        assert session.done
        result = session.search.result
        assert result.status == "found"
        assert call_to_export(screen.launch) == 6  # layers 5.. are bad; call #6 is layer 5
        steps = screen.query_one("#bisect-steps", DataTable)
        assert steps.row_count == len(session.steps) >= 3
        assert all(step.decided_by is Decider.AUTO for step in session.steps)
        assert screen.query_one("#bisect-summary").display
        log = screen.session.log_path
        assert log is not None and log == default_log_path(stream_capture, "calls")
        records = [json.loads(line) for line in log.read_text().splitlines()]
        assert records[0]["record"] == "session" and records[-1]["record"] == "summary"
        await pilot.press("x")
        await settle(pilot)
        assert "repro export is not available yet" in notes or "repro of call #6 written to" in notes
        assert f"into {repro_root()}/" in str(screen.query_one("#bisect-current").render())
        assert not [path for path in stream_capture.resolve().parent.iterdir() if "repro" in path.name]
        await pilot.press("escape")
        assert not isinstance(app.screen, BisectScreen)

    again = make_app(stream_capture)
    async with again.run_test(size=(80, 24)) as pilot:
        screen = await start_calls_bisect(pilot, again)
        assert screen.launch.resumed_steps == len(session.steps)
        assert screen.session.done
        assert "resumed" in str(screen.query_one("#bisect-log").render())


def synthetic_launch(log: Path, first_bad: int, calls: list[int], fail_at: int | None = None) -> BisectLaunch:
    def predicate(probe: ItemProbe[int]) -> Observation:
        calls.append(probe.index)
        if probe.index == fail_at:
            raise ReplayError("the worker died")
        return Observation.bad(TARGET, "rows bad") if probe.index >= first_bad else Observation.good()

    search = FirstBadSearch(list(range(32)), labels=[f"call {n}" for n in range(32)])
    session = Session(search, predicate, log_path=log, capture="synthetic.moe.zst")
    return BisectLaunch(session, "32 synthetic calls")


@run_async
async def test_a_person_overrules_the_predicate_and_the_log_says_so(workdir: Path) -> None:
    calls: list[int] = []
    log = workdir / "synthetic.moe.zst.bisect-calls.jsonl"
    app = MoereplayApp(bisect=synthetic_launch(log, first_bad=20, calls=calls))
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.screen
        assert isinstance(screen, BisectScreen)
        session = screen.session
        await pilot.press("e")  # ask the predicate about the known-bad end, without settling
        await settle(pilot)
        assert session.pending is not None and len(session.steps) == 0
        assert "predicate says" in str(screen.query_one("#bisect-current").render())
        await pilot.press("space")  # accept it
        await settle(pilot)
        assert [step.decided_by for step in session.steps] == [Decider.AUTO]
        probe = session.current
        assert probe is not None and probe.index == 15
        await pilot.press("b")  # the predicate would say good at 15; the person says bad
        assert session.steps[-1].decided_by is Decider.PERSON
        assert session.steps[-1].observation.outcome.value == "bad"
        await pilot.press("s")  # skip the next one
        assert session.steps[-1].observation.outcome.value == "unresolved"
        await pilot.press("p")
        await settle(pilot)
        assert session.done
        assert session.search.result.first_bad is not None and session.search.result.first_bad <= 15
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        deciders = [line["decided_by"] for line in lines if line["record"] == "step"]
        assert deciders[:3] == ["auto", "person", "person"]
        assert str(screen.query_one("#bisect-log").render()).startswith("log: " + log.name)
        await pilot.press("escape")  # no browser behind it: leaving ends the app
    assert app.return_code == 0


@run_async
async def test_one_resumed_step_is_said_in_the_singular(workdir: Path) -> None:
    launch = synthetic_launch(workdir / "synthetic.moe.zst.bisect-calls.jsonl", first_bad=20, calls=[])
    app = MoereplayApp(bisect=dataclasses.replace(launch, resumed_steps=1))
    notes = Notes(app)
    async with app.run_test(size=(120, 24)) as pilot:
        await settle(pilot)
        assert "resumed 1 step from" in notes and "1 steps" not in notes, notes.messages
        shown = str(app.screen.query_one("#bisect-log").render())
        assert shown.endswith("resumed 1 step"), shown


@run_async
async def test_a_failing_predicate_stops_the_run_and_asks_the_person(workdir: Path) -> None:
    calls: list[int] = []
    launch = synthetic_launch(workdir / "x.jsonl", first_bad=20, calls=calls, fail_at=15)
    app = MoereplayApp(bisect=launch)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.screen
        assert isinstance(screen, BisectScreen)
        await pilot.press("p")
        await settle(pilot)
        assert not screen.playing
        assert screen.error is not None and "the worker died" in screen.error
        assert len(screen.session.steps) == 1  # the known-bad end; 15 is not settled
        await pilot.press("g")
        assert screen.session.steps[-1].decided_by is Decider.PERSON
        assert screen.error is None or screen.session.current is not None


@run_async
async def test_bisect_that_cannot_start_says_why(stream_capture: Path) -> None:
    app = make_app(stream_capture)
    notes = Notes(app)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("b")
        dialog = app.screen
        assert isinstance(dialog, BisectDialog)
        dialog.query_one("#bisect-strategy").value = "packs"  # type: ignore[attr-defined]
        await pilot.click("#bisect-start")
        assert app.screen is dialog
        assert "at least two --pack" in str(dialog.query_one("#bisect-error").render())
        dialog.query_one("#bisect-strategy").value = "calls"  # type: ignore[attr-defined]
        dialog.query_one("#bisect-call").focus()
        await pilot.press("ctrl+u", "0", "enter")  # enter in a field submits the dialog
        await settle(pilot)
        # call #0 is the enclosing fused_marlin_moe call: not in the stream of replayable calls
        assert any("--call 0 is not among the selected calls (" in message for message in notes.messages)
        assert not isinstance(app.screen, BisectScreen)


@run_async
async def test_the_dialog_asks_for_nonfinite_on_calls_only(stream_capture: Path) -> None:
    """The dialog's NaN/Inf box is ``bisect --nonfinite``: on for a calls bisect, never sent with another
    strategy (the request would refuse it)."""
    app = make_app(stream_capture)
    async with app.run_test(size=(100, 40)) as pilot:
        await pilot.press("b")
        dialog = app.screen
        assert isinstance(dialog, BisectDialog)
        assert dialog.choice().request.nonfinite is False
        dialog.query_one("#bisect-nonfinite").value = True  # type: ignore[attr-defined]
        dialog.query_one("#bisect-strategy").value = "calls"  # type: ignore[attr-defined]
        await settle(pilot)
        assert dialog.choice().request.nonfinite is True
        dialog.query_one("#bisect-strategy").value = "shape"  # type: ignore[attr-defined]
        await settle(pilot)
        assert dialog.choice().request.nonfinite is False
