"""The findings panel: what the replay learned, one entry per finding, worst kinds first; Enter on a finding with
suggested mutations adds them to the variant matrix."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.text import Text
from textual.message import Message
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from moereplay.format.text import printable
from moereplay.replay.findings import Finding, FindingKind, row_ranges

KIND_STYLES: dict[FindingKind, str] = {
    FindingKind.DIAGNOSIS: "bold reverse cyan",
    FindingKind.MEMORY_DEPENDENT: "bold reverse dark_orange",
    FindingKind.FIDELITY: "yellow",
    FindingKind.CRASH: "bold reverse red",
    FindingKind.OOB_WRITE: "bold red",
    FindingKind.OOB_READ: "bold red",
    FindingKind.NONFINITE: "bold magenta",
    FindingKind.CORRUPT_ROWS: "bold red",
    FindingKind.WRONG_COEFFICIENT: "bold yellow",
    FindingKind.CONTRACT_VIOLATION: "bold yellow",
    FindingKind.NONDETERMINISM: "yellow",
    FindingKind.UNEXPLAINED: "yellow",
    FindingKind.SANITIZER: "red",
}
ORDER = (
    FindingKind.DIAGNOSIS,
    FindingKind.MEMORY_DEPENDENT,
    FindingKind.CRASH,
    FindingKind.OOB_WRITE,
    FindingKind.OOB_READ,
    FindingKind.CONTRACT_VIOLATION,
    FindingKind.NONFINITE,
    FindingKind.WRONG_COEFFICIENT,
    FindingKind.CORRUPT_ROWS,
    FindingKind.UNEXPLAINED,
    FindingKind.FIDELITY,
    FindingKind.NONDETERMINISM,
    FindingKind.SANITIZER,
)


def ordered(findings: Sequence[Finding]) -> list[Finding]:
    rank = {kind: position for position, kind in enumerate(ORDER)}
    return sorted(
        findings, key=lambda finding: (rank.get(finding.kind, len(ORDER)), finding.variant != "baseline")
    )


def finding_text(finding: Finding) -> Text:
    text = Text()
    text.append(f" {finding.kind.value} ", style=KIND_STYLES.get(finding.kind, "bold"))
    text.append(f" {printable(finding.variant)}", style="italic")
    if finding.confidence < 1.0:
        text.append(f"  confidence {finding.confidence:.0%}", style="dim")
    text.append("\n")
    text.append(printable(finding.message))
    where = []
    if finding.rows:
        where.append(f"rows {row_ranges(finding.rows, limit=6)}")
    if finding.columns is not None:
        where.append(f"cols {finding.columns[0]}–{finding.columns[1]}")
    if where:
        text.append("\n" + "; ".join(where), style="dim")
    if finding.suggestions:
        text.append("\ntry: " + printable("; ".join(finding.suggestions)) + "  (enter adds)", style="cyan")
    return text


class FindingsPanel(OptionList):
    """One option per finding (see :func:`finding_text`); notes of the report come last."""

    DEFAULT_CSS = """
    FindingsPanel { height: 1fr; }
    """

    @dataclass
    class SuggestionsChosen(Message):
        panel: FindingsPanel
        mutations: tuple[str, ...]

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.findings: tuple[Finding, ...] = ()

    def show(
        self, findings: Sequence[Finding], notes: Sequence[str] = (), empty: str = "no findings"
    ) -> None:
        self.clear_options()
        self.findings = tuple(ordered(findings))
        options: list[Option] = [
            Option(finding_text(finding), id=f"finding-{number}")
            for number, finding in enumerate(self.findings)
        ]
        options += [Option(Text(f"note: {note}", style="dim italic"), disabled=True) for note in notes]
        if not options:
            options = [Option(Text(empty, style="dim italic"), disabled=True)]
        self.add_options(options)

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        option_id = event.option.id or ""
        if not option_id.startswith("finding-"):
            return
        finding = self.findings[int(option_id.removeprefix("finding-"))]
        if finding.suggestions:
            self.post_message(self.SuggestionsChosen(self, finding.suggestions))
        else:
            self.notify("this finding suggests no mutation")
