"""The bisect session screen: the search narrowing down live, the person able to overrule any step.

``space`` settles the current probe with the predicate's judgement, ``p`` runs step after step until paused or
done, ``e`` only asks the predicate (its answer is shown, pending), and ``g`` / ``b`` / ``s`` settle the probe as
good, bad or skipped whatever the predicate says — the session logs who decided. The predicate runs in a worker; the
session is only ever changed on the UI thread. Every settled step is already in the log beside the capture, so
leaving and running ``moereplay bisect`` (or this screen) again resumes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from moereplay.bisect.log import Step
from moereplay.bisect.observation import Decider, Observation, Outcome
from moereplay.errors import MoereplayError
from moereplay.tui.bindings import Area, bindings_for
from moereplay.tui.bisect_sessions import BisectLaunch, call_to_export, capture_of
from moereplay.tui.repro import ReproUnavailable, export_repro, repro_root
from moereplay.tui.text import as_text
from moereplay.wording import plural

if TYPE_CHECKING:
    from pathlib import Path

    from moereplay.tui.app import MoereplayApp

OUTCOME_STYLES = {Outcome.GOOD: "bold green", Outcome.BAD: "bold red", Outcome.UNRESOLVED: "yellow"}
DECISIONS = {"good": Outcome.GOOD, "bad": Outcome.BAD, "skip": Outcome.UNRESOLVED}
BAR_WIDTH = 48


def observation_text(observation: Observation) -> Text:
    text = Text(observation.outcome.value, style=OUTCOME_STYLES[observation.outcome])
    if observation.signature is not None:
        text.append(f" {observation.signature}")
    if observation.note:
        text.append(f" ({observation.note})", style="dim")
    return text


def interval_bar(total: int, data: Mapping[str, Any], width: int = BAR_WIDTH) -> Text | None:
    """``━━━━━━████▓▓▓▓`` over ``total`` items: known good, still candidates, known bad (``s``: skipped)."""
    low = data.get("last_good", data.get("last_old"))
    high = data.get("first_known_bad", data.get("first_new"))
    if not isinstance(low, int) or not isinstance(high, int) or total <= 0:
        return None
    skipped = set(data.get("skipped", ()))
    width = max(1, min(width, total))
    text = Text("items ")
    for cell in range(width):
        first = cell * total // width
        last = max(first, (cell + 1) * total // width - 1)
        if any(first <= index <= last for index in skipped):
            text.append("s", style="bold yellow")
        elif last <= low:
            text.append("━", style="green")
        elif first >= high:
            text.append("━", style="red")
        else:
            text.append("█", style="bold yellow")
    text.append(f"  good ≤ {low}, bad ≥ {high}, of {total}", style="dim")
    return text


class BisectScreen(Screen[None]):
    """Drives one :class:`~moereplay.bisect.session.Session`."""

    BINDINGS = bindings_for("bisect")
    HELP_AREAS: tuple[Area, ...] = ("bisect",)

    def __init__(self, launch: BisectLaunch) -> None:
        super().__init__()
        self.launch = launch
        self.session = launch.session
        self.capture = capture_of(launch)
        self.playing = False
        self.evaluating = False
        self.error: str | None = None

    @property
    def moe(self) -> MoereplayApp:
        return cast("MoereplayApp", self.app)

    def compose(self) -> ComposeResult:
        search = self.session.search
        yield Static(f"[b]bisect {search.kind}[/b] · {as_text(self.launch.description)}", classes="title-bar")
        yield Static(id="bisect-log", classes="detail-line")
        yield Static(id="bisect-progress")
        yield Static(id="bisect-current")
        table: DataTable[str | Text] = DataTable(id="bisect-steps", cursor_type="row", zebra_stripes=True)
        yield table
        yield Static(id="bisect-summary")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#bisect-steps", DataTable)
        table.add_columns("#", "by", "probe", "observation", "s")
        for step in self.session.steps:
            self._add_step(step)
        self.refresh_state()
        table.focus()

    # ------------------------------------------------------------------------------------------ drawing

    def _add_step(self, step: Step) -> None:
        table = self.query_one("#bisect-steps", DataTable)
        by = (
            Text("person", style="bold cyan")
            if step.decided_by is Decider.PERSON
            else Text("auto", style="dim")
        )
        seconds = "" if step.seconds is None else f"{step.seconds:.1f}"
        table.add_row(str(step.number), by, step.label, observation_text(step.observation), seconds)
        table.move_cursor(row=table.row_count - 1)

    def refresh_state(self) -> None:
        session = self.session
        self.query_one("#bisect-log", Static).update(self._log_text())
        progress = session.search.progress
        lines: list[Text | str] = [Text(progress.line or "starting", style="bold")]
        items = getattr(session.search, "items", getattr(session.search, "packs", ()))
        room = (self.size.width or 80) - 42  # the legend after the bar takes about 40 cells
        bar = interval_bar(len(items), progress.data, max(8, min(BAR_WIDTH, room)))
        if bar is not None:
            lines.append(bar)
        elif not session.done:
            for key, value in progress.data.items():
                if isinstance(value, (list, tuple)):
                    value = ", ".join(str(item) for item in value) or "—"
                elif isinstance(value, Mapping):
                    value = " ".join(f"{name}={item}" for name, item in value.items())
                lines.append(Text(f"{key}: {value}", style="dim"))
        progress_text = Text("\n").join(Text(line) if isinstance(line, str) else line for line in lines)
        self.query_one("#bisect-progress", Static).update(progress_text)
        self.query_one("#bisect-current", Static).update(self._current_text())
        summary = self.query_one("#bisect-summary", Static)
        if session.done:
            ended = [
                line for line in session.summary().lines() if not line.startswith("log: ")
            ]  # shown above
            summary.update(Text("\n".join(ended), style="bold"))
            summary.display = True
        else:
            summary.display = False

    def _log_text(self) -> str:
        log = self.session.log_path
        if log is None:
            return "log: none (this session is not saved)"
        capture = self.capture
        beside = capture is not None and capture.resolve().parent == log.resolve().parent
        where = " (beside the capture)" if beside else ""
        shown = log.name if where else str(log)
        resumed = (
            f" · resumed {plural(self.launch.resumed_steps, 'step')}" if self.launch.resumed_steps else ""
        )
        return f"log: {shown}{where}{resumed}"

    def _current_text(self) -> Text:
        session = self.session
        probe = session.current
        if probe is None:
            return Text(
                f"done — x exports a repro of the call it points at into {repro_root()}/", style="green"
            )
        text = Text("now: ", style="dim")
        text.append(probe.label, style="bold")
        pending = session.pending
        if self.evaluating:
            text.append("  evaluating…", style="italic cyan")
        elif pending is not None:
            text.append("  predicate says ", style="dim")
            text.append_text(observation_text(pending))
            text.append("  (space accepts; g/b/s overrule)", style="dim")
        else:
            text.append("  (space: judge it, g/b/s: decide it yourself)", style="dim")
        if self.playing:
            text.append("  ▶ running (p pauses)", style="bold cyan")
        if self.error:
            text.append(f"\n{self.error}", style="bold red")
        return text

    # ------------------------------------------------------------------------------------------ stepping

    def action_step(self) -> None:
        if self._refuse_when_busy():
            return
        self._evaluate(settle=True)

    def action_evaluate(self) -> None:
        if self._refuse_when_busy():
            return
        self._evaluate(settle=False)

    def action_toggle_play(self) -> None:
        if self.playing:
            self.playing = False
            self.refresh_state()
            return
        if self.session.done:
            self.notify("the search is finished")
            return
        self.playing = True
        if not self.evaluating:
            self._evaluate(settle=True)
        self.refresh_state()

    def _refuse_when_busy(self) -> bool:
        if self.session.done:
            self.notify("the search is finished")
            return True
        if self.evaluating:
            self.notify("the predicate is running on this probe; wait for it", severity="warning")
            return True
        return False

    def _evaluate(self, *, settle: bool) -> None:
        if self.session.predicate is None:
            self.playing = False
            self.notify("this session has no predicate: decide each step with g / b / s", severity="warning")
            return
        self.evaluating = True
        self.error = None
        self.refresh_state()
        self._run_predicate(settle)

    @work(thread=True, exclusive=True, group="predicate")
    def _run_predicate(self, settle: bool) -> None:
        try:
            self.session.evaluate()
        except MoereplayError as error:
            self.app.call_from_thread(self._predicate_failed, str(error))
            return
        self.app.call_from_thread(self._predicate_done, settle)

    def _predicate_failed(self, message: str) -> None:
        self.evaluating = False
        self.playing = False
        self.error = f"the predicate failed: {message} — decide this step with g / b / s"
        self.refresh_state()

    def _predicate_done(self, settle: bool) -> None:
        self.evaluating = False
        if settle and not self.session.done:
            self._add_step(self.session.step())
        if self.playing and not self.session.done:
            self._evaluate(settle=True)
            return
        self.playing = False
        self.refresh_state()

    def action_decide(self, decision: str) -> None:
        if self._refuse_when_busy():
            return
        outcome = DECISIONS[decision]
        self._add_step(self.session.decide(outcome))
        self.refresh_state()

    # ------------------------------------------------------------------------------------------ the end

    def action_export_repro(self) -> None:
        capture = self.capture
        call = call_to_export(self.launch)
        if capture is None or call is None:
            self.notify(
                "export repro: no call to export yet — the session has not pointed at one", severity="warning"
            )
            return
        self._export(capture, call)

    @work(thread=True, exclusive=True, group="repro")
    def _export(self, capture: Path, call: int) -> None:
        try:
            result = export_repro(capture, call)
        except MoereplayError as error:
            self.app.call_from_thread(self.notify, str(error), title="export repro", severity="error")
            return
        if isinstance(result, ReproUnavailable):
            self.app.call_from_thread(self.notify, result.reason, title="export repro", severity="warning")
        else:
            self.app.call_from_thread(
                self.notify, f"repro of call #{call} written to {result}", title="export repro"
            )

    def action_back(self) -> None:
        if self.playing:
            self.playing = False
        if self.moe.catalog is None:
            self.app.exit()
        else:
            self.app.pop_screen()
