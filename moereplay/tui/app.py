"""The Textual app: one screen per workflow over the headless core.

- :class:`~moereplay.tui.screens.browser.BrowserScreen`: the capture's calls (lazy, filterable), verdicts as replays
  finish;
- :class:`~moereplay.tui.screens.call.CallScreen`: one call — arguments and contracts, the variant matrix, diff view,
  heat map, findings;
- :class:`~moereplay.tui.screens.bisect.BisectScreen`: a bisect session, step by step, with person overrides;
- :class:`~moereplay.tui.screens.help.HelpScreen`: every binding, from :mod:`moereplay.tui.bindings`.

The app holds what outlives a screen: the catalog, the backend, the verdicts known so far and the last replay of each
recently opened call. Replays, contract checks and bisect steps run in Textual workers (threads), never in handlers.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from textual import work
from textual.app import App

from moereplay.errors import MoereplayError
from moereplay.tui.bindings import bindings_for
from moereplay.tui.bisect_sessions import BisectLaunch, WiringFactory, default_wiring, open_session
from moereplay.tui.catalog import CallCatalog
from moereplay.tui.replays import ReplayOutcome
from moereplay.tui.screens.dialogs import BisectChoice
from moereplay.wording import plural

OUTCOMES_KEPT = 8
"""Replays (with their tensors) kept for recently opened calls."""


class MoereplayApp(App[None]):
    """``moereplay tui FILE``; or, with ``bisect`` and no catalog, a bisect session alone (``moereplay bisect``)."""

    CSS_PATH = "app.tcss"
    TITLE = "moereplay"
    BINDINGS = bindings_for("global")
    ENABLE_COMMAND_PALETTE = False

    def __init__(
        self,
        catalog: CallCatalog | None = None,
        *,
        backend: str = "auto",
        wiring_factory: WiringFactory = default_wiring,
        bisect: BisectLaunch | None = None,
    ) -> None:
        super().__init__()
        if catalog is None and bisect is None:
            raise ValueError("the app needs a capture or a bisect session")
        self.catalog = catalog
        self.backend = backend
        self.wiring_factory = wiring_factory
        self.initial_bisect = bisect
        self.verdicts: dict[int, str] = {}
        self.outcomes: OrderedDict[int, ReplayOutcome] = OrderedDict()
        if catalog is not None:
            self.sub_title = catalog.path.name

    @classmethod
    def for_capture(
        cls, path: str | Path, *, backend: str = "auto", wiring_factory: WiringFactory = default_wiring
    ) -> MoereplayApp:
        """Open ``path`` (raises ``CaptureFileError`` before any terminal work) and build the app over it."""
        return cls(CallCatalog(path), backend=backend, wiring_factory=wiring_factory)

    def on_mount(self) -> None:
        from moereplay.tui.screens.browser import BrowserScreen

        if self.catalog is not None:
            self.push_screen(BrowserScreen(self.catalog))
        if self.initial_bisect is not None:
            self.show_bisect(self.initial_bisect)

    def on_unmount(self) -> None:
        if self.catalog is not None:
            self.catalog.close()

    # ------------------------------------------------------------------------------------------ shared state

    def remember(self, outcome: ReplayOutcome) -> None:
        """Keep a call's latest replay and its headline verdict (the worse of recorded and replayed)."""
        call = outcome.request.call
        self.outcomes[call] = outcome
        self.outcomes.move_to_end(call)
        while len(self.outcomes) > OUTCOMES_KEPT:
            self.outcomes.popitem(last=False)
        self.verdicts[call] = outcome.report.headline.verdict.value

    # ------------------------------------------------------------------------------------------ bisect

    def start_bisect(self, choice: BisectChoice | None) -> None:
        """Open (or resume) the session a bisect dialog asked for, then show it (the wiring runs in a worker)."""
        if choice is None:
            return
        self.notify(f"preparing the {choice.request.strategy} bisect…", timeout=2)
        self._open_bisect(choice)

    @work(thread=True, exclusive=True, group="bisect-open")
    def _open_bisect(self, choice: BisectChoice) -> None:
        try:
            launch = open_session(choice.request, self.wiring_factory(), fresh=choice.fresh)
        except MoereplayError as error:
            self.call_from_thread(self.notify, str(error), title="cannot bisect", severity="error", timeout=8)
            return
        self.call_from_thread(self.show_bisect, launch)

    def show_bisect(self, launch: BisectLaunch) -> None:
        from moereplay.tui.screens.bisect import BisectScreen

        self.push_screen(BisectScreen(launch))
        if launch.resumed_steps:
            self.notify(f"resumed {plural(launch.resumed_steps, 'step')} from {launch.session.log_path}")

    def action_help(self) -> None:
        from moereplay.tui.screens.help import HelpScreen

        if isinstance(self.screen, HelpScreen):
            self.pop_screen()
            return
        areas = getattr(self.screen, "HELP_AREAS", ())
        self.push_screen(HelpScreen(areas))
