"""The call view: one call's arguments and contracts, its variant matrix, diff view, heat map and findings.

Opening it replays the call as captured (unless the app still holds a replay of it); mutations added to the matrix
run on ``r``. Everything slow — loading arguments for the contract check, the replay, per-element errors — runs in
thread workers; the screen only draws what they return.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from textual import work
from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static, TabbedContent, TabPane

from moereplay.errors import MoereplayError
from moereplay.replay.results import RECORDED, VariantResult
from moereplay.tui.arguments import argument_nodes, contract_violations
from moereplay.tui.bindings import Area, bindings_for
from moereplay.tui.catalog import CallCatalog
from moereplay.tui.error_grid import ErrorField
from moereplay.tui.replays import ReplayOutcome, ReplayRequest, mutable_arguments, mutation_labels, run_replay
from moereplay.tui.text import as_text
from moereplay.tui.widgets.call.argument_tree import ArgumentTree
from moereplay.tui.widgets.call.diff_view import DiffPanes, DiffView
from moereplay.tui.widgets.call.findings_panel import FindingsPanel
from moereplay.tui.widgets.call.heat_map import HeatMap
from moereplay.tui.widgets.call.variant_matrix import VariantMatrix

if TYPE_CHECKING:
    from moereplay.ops.base import ContractViolation, OpSpec
    from moereplay.tui.app import MoereplayApp

TABS = ("arguments", "variants", "diff", "heatmap", "findings")
FOCUS = {
    "arguments": ArgumentTree,
    "variants": VariantMatrix,
    "diff": DiffView,
    "heatmap": HeatMap,
    "findings": FindingsPanel,
}


def _op_or_none(name: str) -> OpSpec | None:
    from moereplay.ops import get_op

    try:
        return get_op(name)
    except MoereplayError:
        return None


def default_variant(results: tuple[VariantResult, ...]) -> str:
    """The row the diff view opens on: the first failing one with rows (recorded, baseline, then the variants),
    else the baseline when it was judged (offline it is not: the recorded row)."""
    for result in results:
        if result.failed and result.rows:
            return result.label
    judged = {result.label for result in results if result.judged and result.rows}
    return "baseline" if "baseline" in judged or RECORDED not in judged else RECORDED


class CallScreen(Screen[None]):
    """Everything about call ``index`` of a capture."""

    BINDINGS = bindings_for("call")
    HELP_AREAS: tuple[Area, ...] = ("call", "diff", "heatmap")

    def __init__(self, catalog: CallCatalog, index: int) -> None:
        super().__init__()
        self.catalog = catalog
        self.index = index
        self.record = catalog.record(index)
        self.op = _op_or_none(self.record.op)
        self.mutations: list[str] = []
        self.mutation_variants: dict[str, tuple[str, ...]] = {}
        self.outcome: ReplayOutcome | None = None
        self.violations: tuple[ContractViolation, ...] | None = None
        self.variant = "baseline"
        self.errors: dict[str, ErrorField] = {}
        self.replaying = False

    @property
    def moe(self) -> MoereplayApp:
        return cast("MoereplayApp", self.app)

    # ------------------------------------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield Static(self._title(), id="call-title", classes="title-bar")
        yield Static("", id="call-status", classes="detail-line")
        with TabbedContent(initial="variants", id="call-tabs"):
            with TabPane("1 Arguments", id="arguments"):
                yield ArgumentTree(id="argument-tree")
            with TabPane("2 Variants", id="variants"):
                yield VariantMatrix(id="variant-matrix")
            with TabPane("3 Diff", id="diff"):
                yield DiffView(id="diff-view")
            with TabPane("4 Heat map", id="heatmap"):
                yield HeatMap(id="heat-map")
            with TabPane("5 Findings", id="findings"):
                yield FindingsPanel(id="findings-panel")
        yield Footer()

    def _title(self) -> str:
        record = self.record
        parts = [f"[b]#{record.index} {as_text(record.op)}[/b]"]  # file text: escaped, never markup
        if record.layer is not None:
            parts.append(f"layer {as_text(record.layer)}")
        step = record.context.get("step")
        if step is not None:
            parts.append(f"step {as_text(step)}")
        parts.append(as_text(record.status))
        parts.append(f"backend {as_text(self.moe.backend)}")
        return " · ".join(parts)

    def on_mount(self) -> None:
        tree = self.query_one(ArgumentTree)
        if self.op is None:
            tree.show(argument_nodes(self.record, None), note="no ops module declares this op: no contracts")
            self._set_status(
                f"[$warning]moereplay cannot replay {as_text(self.record.op)}: no ops module declares it[/]"
            )
            self.query_one(VariantMatrix).show(())
            self._show_findings()
            return
        tree.show(argument_nodes(self.record, self.op), note="checking contracts…")
        self._check_contracts()
        cached = self.moe.outcomes.get(self.index)
        if cached is not None and cached.request.backend == self.moe.backend:
            self.mutations = list(cached.request.mutations)
            for text in self.mutations:
                self.mutation_variants[text] = mutation_labels(self.record.op, text)
            self._show_outcome(cached)
        else:
            self.query_one(VariantMatrix).show((), ("baseline",))
            self.rerun()
        self.query_one(VariantMatrix).focus()

    def _set_status(self, text: str) -> None:
        self.query_one("#call-status", Static).update(text)

    # ------------------------------------------------------------------------------------------ contracts

    @work(thread=True, exclusive=True, group="contracts")
    def _check_contracts(self) -> None:
        try:
            violations = contract_violations(self.catalog.path, self.index)
        except MoereplayError as error:
            self.app.call_from_thread(self._contracts_failed, str(error))
            return
        self.app.call_from_thread(self._contracts_checked, violations)

    def _contracts_checked(self, violations: tuple[ContractViolation, ...]) -> None:
        self.violations = violations
        count = len(violations)
        note = (
            f"{count} contract violation{'s' if count != 1 else ''}: "
            "what the kernel reads differs from what was passed"
            if violations
            else "every argument matches the op's contracts"
        )
        self.query_one(ArgumentTree).show(argument_nodes(self.record, self.op, violations), note=note)

    def _contracts_failed(self, message: str) -> None:
        self.query_one(ArgumentTree).show(
            argument_nodes(self.record, self.op), note=f"contracts not checked: {message}"
        )

    # ------------------------------------------------------------------------------------------ replays

    def action_rerun(self) -> None:
        self.rerun()

    def rerun(self) -> None:
        if self.op is None:
            self.notify(f"cannot replay {self.record.op}", severity="warning")
            return
        if self.replaying:
            self.notify("a replay is running", severity="warning")
            return
        self.replaying = True
        count = len(self.pending_labels())
        self._set_status(
            f"replaying baseline + {count - 1} variant(s) on {self.moe.backend}…"
            if count > 1
            else "replaying…"
        )
        self._replay(ReplayRequest(self.catalog.path, self.index, tuple(self.mutations), self.moe.backend))

    @work(thread=True, exclusive=True, group="replay")
    def _replay(self, request: ReplayRequest) -> None:
        try:
            outcome = run_replay(request)
        except MoereplayError as error:
            self.app.call_from_thread(self._replay_failed, str(error))
            return
        self.app.call_from_thread(self._replay_done, outcome)

    def _replay_failed(self, message: str) -> None:
        self.replaying = False
        self._set_status(f"[$error]replay failed: {as_text(message)}[/]")
        self.notify(message, title="replay failed", severity="error", timeout=8)

    def _replay_done(self, outcome: ReplayOutcome) -> None:
        self.replaying = False
        self.moe.remember(outcome)
        self._show_outcome(outcome)

    def pending_labels(self) -> list[str]:
        labels = ["baseline"]
        for text in self.mutations:
            labels.extend(self.mutation_variants.get(text, ()))
        return labels

    def _show_outcome(self, outcome: ReplayOutcome) -> None:
        self.outcome = outcome
        self.errors = {}
        report = outcome.report
        variants = len(report.variants)
        failing = sum(result.failed for result in report.variants)
        headline = report.headline
        parts = [f"verdict [b]{headline.verdict.value}[/b] ({headline.source})"]
        if variants:
            parts.append(f"{variants} variant{'s' if variants != 1 else ''}, {failing} not ok")
        parts.append(f"{len(report.findings)} finding{'s' if len(report.findings) != 1 else ''}")
        parts.append(f"{report.backend} on {report.device}")
        status = " · ".join(parts)
        if outcome.tensors_note:
            status += f" · [$warning]{as_text(outcome.tensors_note)}[/]"
        self._set_status(status)
        self.variant = default_variant(report.results)
        self._refresh_matrix()
        self._show_findings()
        self._show_variant()

    def _refresh_matrix(self, keep: str | None = None) -> None:
        """Results of the last replay for the variants still in the matrix — with the rows the replay added on its
        own (fills that follow the evidence, the fidelity check's variants) — then those not run yet."""
        wanted = self.pending_labels()
        results = self.outcome.report.results if self.outcome is not None else ()
        asked = {"baseline"}
        if self.outcome is not None:
            for text in self.outcome.request.mutations:
                asked.update(self.mutation_variants.get(text, ()))
        shown = [
            result
            for result in results
            if result.label in wanted or result.label == RECORDED or result.label not in asked
        ]
        self.query_one(VariantMatrix).show(shown, wanted, keep=keep or self.variant)

    def _show_findings(self) -> None:
        panel = self.query_one(FindingsPanel)
        if self.outcome is None:
            panel.show((), empty="no replay yet")
            return
        panel.show(self.outcome.report.findings, self.outcome.report.notes)

    # ------------------------------------------------------------------------------------------ variants shown

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if not isinstance(event.data_table, VariantMatrix) or event.row_key.value is None:
            return
        label = str(event.row_key.value)
        if label != self.variant:
            self.variant = label
            self._show_variant()

    def action_cycle_variant(self, step: int) -> None:
        if self.outcome is None or not self.outcome.tensors:
            return
        labels = list(self.outcome.tensors)
        position = labels.index(self.variant) if self.variant in labels else -step
        self.variant = labels[(position + step) % len(labels)]
        self._show_variant()
        self.notify(f"showing {self.variant}", timeout=1.5)

    def _show_variant(self) -> None:
        diff, heat = self.query_one(DiffView), self.query_one(HeatMap)
        outcome = self.outcome
        if outcome is None:
            diff.show(None, "no replay yet")
            heat.show(None, None, note="no replay yet")
            return
        tensors = outcome.tensors.get(self.variant)
        if tensors is None:
            note = (
                outcome.tensors_note or f"{self.variant}: no output to draw (see its verdict in the matrix)"
            )
            diff.show(None, note)
            heat.show(None, None, note=note)
            return
        peer = "baseline" if "baseline" in outcome.tensors else RECORDED  # offline: no replayed baseline
        wanted = [label for label in (self.variant, peer) if label not in self.errors]
        wanted = [label for label in wanted if label in outcome.tensors]
        if wanted:
            diff.show(None, f"{self.variant}: measuring errors…")
            heat.show(None, None, note=f"{self.variant}: measuring errors…")
            self._measure(outcome, tuple(wanted))
            return
        baseline = outcome.tensors.get(peer)
        panes = DiffPanes(
            self.variant,
            tensors,
            self.errors[self.variant],
            baseline,
            self.errors.get(peer) if baseline is not None else None,
            peer,
        )
        diff.show(panes)
        heat.show(self.errors[self.variant], tensors, self.variant)

    @work(thread=True, exclusive=True, group="errors")
    def _measure(self, outcome: ReplayOutcome, labels: tuple[str, ...]) -> None:
        measured = {label: ErrorField.of(outcome.tensors[label]) for label in labels}
        self.app.call_from_thread(self._measured, outcome, measured)

    def _measured(self, outcome: ReplayOutcome, measured: dict[str, ErrorField]) -> None:
        if outcome is not self.outcome:
            return
        self.errors.update(measured)
        self._show_variant()

    def on_heat_map_cell_chosen(self, message: HeatMap.CellChosen) -> None:
        self.query_one(DiffView).show_element(message.row, message.first_column)
        self.action_show_tab("diff")

    # ------------------------------------------------------------------------------------------ mutations

    def action_add_mutation(self) -> None:
        from moereplay.tui.screens.dialogs import MutationDialog

        if self.op is None:
            self.notify(f"cannot mutate {self.record.op}: no ops module declares it", severity="warning")
            return
        self.app.push_screen(
            MutationDialog(self.op.name, mutable_arguments(self.op.name)), self._mutation_chosen
        )

    def _mutation_chosen(self, text: str | None) -> None:
        self.add_mutation(text)

    def add_mutation(self, text: str | None) -> bool:
        """Add a mutation text (already parsed by the engine) to the matrix; ``False`` if it cannot be added."""
        if text is None:
            return False
        try:
            labels = mutation_labels(self.record.op, text)
        except MoereplayError as error:
            self.notify(str(error), severity="error")
            return False
        if text in self.mutations:
            self.notify(f"{text} is already in the matrix")
            return False
        self.mutations.append(text)
        self.mutation_variants[text] = labels
        self._refresh_matrix(keep=labels[0] if labels else None)
        self.notify(f"added {text}; r reruns", timeout=2)
        return True

    def action_remove_mutation(self) -> None:
        label = self.query_one(VariantMatrix).current_label
        if label is None or label in ("baseline", RECORDED):
            self.notify(f"the {label or 'baseline'} row stays", severity="warning")
            return
        for text, labels in self.mutation_variants.items():
            if label in labels and text in self.mutations:
                self.mutations.remove(text)
                self._refresh_matrix(keep="baseline")
                self.notify(f"removed {text}", timeout=2)
                return
        self.notify(
            f"{label} was run by the replay itself (following the evidence): it stays", severity="warning"
        )

    def on_findings_panel_suggestions_chosen(self, message: FindingsPanel.SuggestionsChosen) -> None:
        added = [text for text in message.mutations if self.add_mutation(text)]
        if added:
            self.action_show_tab("variants")

    # ------------------------------------------------------------------------------------------ navigation

    def action_show_tab(self, tab: str) -> None:
        if tab not in TABS:
            return
        self.query_one(TabbedContent).active = tab
        self.query_one(FOCUS[tab]).focus()

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        pane = event.pane.id or ""
        if pane in FOCUS:
            self.query_one(FOCUS[pane]).focus()

    def action_back(self) -> None:
        self.app.pop_screen()

    def action_bisect(self) -> None:
        from moereplay.tui.screens.dialogs import BisectDialog

        strategy = "mutations" if self.mutations else "shape"
        self.app.push_screen(
            BisectDialog(
                self.catalog.path,
                call=self.index,
                strategy=strategy,
                backend=self.moe.backend,
                mutations=self.mutations,
            ),
            self.moe.start_bisect,
        )
