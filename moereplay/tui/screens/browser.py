"""The call browser: every call of the capture in a lazy table, a filter line, verdicts as replays finish."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from textual import work
from textual.app import ComposeResult
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, Input, Static
from textual.worker import Worker, get_current_worker

from moereplay.errors import MoereplayError
from moereplay.tui.bindings import Area, bindings_for
from moereplay.tui.catalog import CallCatalog, CallSummary
from moereplay.tui.filters import FAILING, CallFilter
from moereplay.tui.replays import ReplayOutcome, ReplayRequest, run_replay
from moereplay.tui.text import as_text
from moereplay.tui.widgets.browser.call_table import CallTable

if TYPE_CHECKING:
    from moereplay.tui.app import MoereplayApp

FILTER_DELAY_S = 0.2
"""Typing pauses this long before the filter runs."""


def replayable_ops() -> frozenset[str]:
    from moereplay.ops import known_op_names

    return frozenset(known_op_names())


class BrowserScreen(Screen[None]):
    """Lists the calls of one capture; Enter opens the call view."""

    BINDINGS = bindings_for("browser")
    HELP_AREAS: tuple[Area, ...] = ("browser", "table")

    def __init__(self, catalog: CallCatalog) -> None:
        super().__init__()
        self.catalog = catalog
        self.query_filter = CallFilter()
        self.status = ""
        self.replay_errors: dict[int, str] = {}
        self._filter_timer: Timer | None = None
        self._replays: Worker[None] | None = None
        self._replayable = replayable_ops()

    @property
    def moe(self) -> MoereplayApp:
        return cast("MoereplayApp", self.app)

    # ------------------------------------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield Static(id="browser-title", classes="title-bar")
        yield CallTable(self.catalog, self.moe.verdicts.get, id="calls")
        yield Static(id="call-detail", classes="detail-line")
        yield Input(
            placeholder="/ filter: op:marlin* layer:3 step:10-12 verdict:bad words…",
            id="filter",
            classes="filter-line",
        )
        yield Footer()

    def on_mount(self) -> None:
        self._show_title()
        self.table.focus()

    @property
    def table(self) -> CallTable:
        return self.query_one(CallTable)

    def _show_title(self) -> None:
        catalog = self.catalog
        shown = len(self.table.rows)
        total = len(catalog)
        noun = "call" if total == 1 else "calls"
        count = f"{total:,} {noun}" if shown == total else f"{shown:,} of {total:,} {noun}"
        parts = [f"[b]{catalog.path.name}[/b]", count]
        if catalog.rank is not None:
            parts.append(f"rank {catalog.rank}")
        if not catalog.recovery.complete:
            parts.append(f"[$warning]{as_text(catalog.recovery.message)}[/]")
        if self.status:
            parts.append(self.status)
        self.query_one("#browser-title", Static).update(" · ".join(parts))

    def _set_status(self, text: str) -> None:
        self.status = text
        self._show_title()

    def on_call_table_highlighted(self, message: CallTable.Highlighted) -> None:
        detail = self.query_one("#call-detail", Static)
        if message.index is None:
            detail.update("no calls match" if not self.query_filter.empty else "the capture holds no calls")
            return
        summary = self.catalog.summary(message.index)
        detail.update(self._detail(summary))

    def _detail(self, summary: CallSummary) -> str:
        parts = [f"#{summary.index}"]
        if summary.site:
            parts.append(f"site {as_text(summary.site)}")
        parts.append(f"{summary.tensors} tensors")
        if summary.op not in self._replayable:
            parts.append("not replayable (no ops module)")
        error = self.replay_errors.get(summary.index)
        if error:
            parts.append(f"[$error]{as_text(error)}[/]")
        return " · ".join(parts)

    def on_call_table_selected(self, message: CallTable.Selected) -> None:
        self.open_call(message.index)

    # ------------------------------------------------------------------------------------------ actions

    def open_call(self, index: int) -> None:
        from moereplay.tui.screens.call import CallScreen

        self.app.push_screen(CallScreen(self.catalog, index))

    def action_open_call(self) -> None:
        index = self.table.current
        if index is not None:
            self.open_call(index)

    def action_focus_filter(self) -> None:
        self.query_one("#filter", Input).focus()

    def action_clear_filter(self) -> None:
        field = self.query_one("#filter", Input)
        field.value = ""
        if self._filter_timer is not None:
            self._filter_timer.stop()
        self.apply_filter("")
        self.table.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id != "filter":
            return
        if self._filter_timer is not None:
            self._filter_timer.stop()
        self._filter_timer = self.set_timer(FILTER_DELAY_S, lambda: self.apply_filter(event.value))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "filter":
            if self._filter_timer is not None:
                self._filter_timer.stop()
            self.apply_filter(event.value)
            self.table.focus()

    def apply_filter(self, text: str) -> None:
        query = CallFilter.parse(text)
        if query == self.query_filter:
            return
        self.query_filter = query
        if query.empty:
            self.workers.cancel_group(self, "filter")
            self._show_rows(list(self.catalog.indices), query)
            return
        self._filter(query)

    @work(thread=True, exclusive=True, group="filter")
    def _filter(self, query: CallFilter) -> None:
        worker = get_current_worker()
        catalog = self.catalog
        verdicts = dict(self.moe.verdicts)
        total = len(catalog)
        matches: list[int] = []
        for number, index in enumerate(catalog.indices, start=1):
            if worker.is_cancelled:
                return
            if query.matches(catalog.summary(index), verdicts.get(index)):
                matches.append(index)
            if number % 2000 == 0 and number < total:
                self.app.call_from_thread(self._set_status, f"filtering {number:,}/{total:,}…")
        if not worker.is_cancelled:
            self.app.call_from_thread(self._show_rows, matches, query)

    def _show_rows(self, rows: list[int], query: CallFilter) -> None:
        if query != self.query_filter:
            return
        self.table.set_rows(rows, keep=self.table.current)
        problems = "; ".join(query.problems)
        self._set_status(f"[$warning]{as_text(problems)}[/]" if problems else "")

    def action_next_failure(self) -> None:
        self._jump_to_failure(1)

    def action_previous_failure(self) -> None:
        self._jump_to_failure(-1)

    def _jump_to_failure(self, direction: int) -> None:
        table = self.table
        verdicts = self.moe.verdicts
        rows = table.rows
        position = table.cursor + direction
        while 0 <= position < len(rows):
            if verdicts.get(rows[position]) in FAILING:
                table.cursor = position
                return
            position += direction
        self.notify("no failing call that way (replay calls first: r, R)", severity="warning")

    # ------------------------------------------------------------------------------------------ replays

    def action_replay_selected(self) -> None:
        index = self.table.current
        if index is not None:
            self._start_replays([index])

    def action_replay_visible(self) -> None:
        self._start_replays(list(self.table.rows))

    def action_stop_replays(self) -> None:
        if self._replays is not None and self._replays.is_running:
            self._replays.cancel()
            self._set_status("stopping replays…")

    def _start_replays(self, calls: list[int]) -> None:
        if self._replays is not None and self._replays.is_running:
            self.notify("replays are running; x stops them", severity="warning")
            return
        wanted = [index for index in calls if self.catalog.summary(index).op in self._replayable]
        if not wanted:
            self.notify("no replayable call selected", severity="warning")
            return
        self._replays = self._replay_calls(wanted)

    @work(thread=True, group="replays")
    def _replay_calls(self, calls: list[int]) -> None:
        worker = get_current_worker()
        app = self.moe
        backend = app.backend
        failures = 0
        for number, index in enumerate(calls, start=1):
            if worker.is_cancelled:
                break
            app.call_from_thread(self._replay_started, index, number, len(calls))
            request = ReplayRequest(self.catalog.path, index, (), backend, tensors=False)
            try:
                outcome = run_replay(request)
            except MoereplayError as error:
                failures += 1
                app.call_from_thread(self._replay_failed, index, str(error))
                continue
            app.call_from_thread(self._replay_done, outcome)
        app.call_from_thread(self._replays_finished, calls, failures, worker.is_cancelled)

    def _replay_started(self, index: int, number: int, total: int) -> None:
        self.moe.verdicts[index] = "running"
        self._set_status(f"replaying {number:,}/{total:,} (x stops)" if total > 1 else f"replaying #{index}")
        self.table.refresh_call(index)

    def _replay_done(self, outcome: ReplayOutcome) -> None:
        index = outcome.request.call
        self.moe.verdicts[index] = outcome.report.headline.verdict.value
        self.replay_errors.pop(index, None)
        self.table.refresh_call(index)
        if self.table.current == index:
            self.query_one("#call-detail", Static).update(self._detail(self.catalog.summary(index)))

    def _replay_failed(self, index: int, message: str) -> None:
        self.moe.verdicts[index] = "error"
        self.replay_errors[index] = message
        self.table.refresh_call(index)
        if self.table.current == index:
            self.query_one("#call-detail", Static).update(self._detail(self.catalog.summary(index)))

    def _replays_finished(self, calls: list[int], failures: int, cancelled: bool) -> None:
        for index, verdict in list(self.moe.verdicts.items()):
            if verdict == "running":
                del self.moe.verdicts[index]
        self.table.refresh()
        done = "stopped" if cancelled else "done"
        self._set_status(f"replays {done}" + (f", {failures} could not run" if failures else ""))
        if failures and len(calls) == 1:
            message = self.replay_errors.get(calls[0], "")
            self.notify(message, title="replay failed", severity="error")

    # ------------------------------------------------------------------------------------------ bisect

    def action_bisect(self) -> None:
        from moereplay.tui.screens.dialogs import BisectDialog

        index = self.table.current
        self.app.push_screen(
            BisectDialog(self.catalog.path, call=index, strategy="calls", backend=self.moe.backend),
            self.moe.start_bisect,
        )
