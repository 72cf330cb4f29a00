"""Small modal dialogs: add a mutation to the variant matrix; start a bisect session."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from textual.app import ComposeResult
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label, Select, Static

from moereplay.bisect.observation import SignatureMatch
from moereplay.bisect.wiring import BisectRequest
from moereplay.errors import MoereplayError
from moereplay.tui.bindings import bindings_for
from moereplay.tui.replays import MutableArgument, mutation_labels
from moereplay.tui.text import as_text

MUTATION_KINDS: tuple[tuple[str, str], ...] = (
    ("flip", "flip FLAG"),
    ("set", "set ARG=VALUE[+ARG=VALUE]"),
    ("cast", "cast TENSOR=DTYPE"),
    ("fill", "fill 0xff | 0xfe | 0x00 | nan"),
    ("sweep", "sweep ARG=v1,v2,…"),
)
"""Mutation kinds and how their value is written (the replay engine's mutation syntax)."""


class MutationDialog(ModalScreen[str | None]):
    """Asks for one mutation; dismisses with its text (``"flip mul_topk_weights"``) once the engine parses it."""

    BINDINGS = bindings_for("modal")

    def __init__(self, op_name: str, arguments: Sequence[MutableArgument]) -> None:
        super().__init__()
        self.op_name = op_name
        self.arguments = tuple(arguments)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="mutation-dialog"):
            yield Static(
                f"[b]Add a mutation[/b] to this {as_text(self.op_name)} call", classes="dialog-title"
            )
            with Horizontal(classes="dialog-row"):
                yield Select(
                    [(label, kind) for kind, label in MUTATION_KINDS],
                    value="flip",
                    allow_blank=False,
                    id="mutation-kind",
                )
                yield Input(placeholder="mul_topk_weights", id="mutation-value", classes="compact")
            yield Static("", id="mutation-error", classes="dialog-error")
            with VerticalScroll(id="mutation-arguments"):
                lines = [f"[b]{argument.name}[/b] {argument.domain}" for argument in self.arguments]
                yield Static(
                    "\n".join(lines) or "this op declares no mutable arguments (cast and fill still work)"
                )
            with Horizontal(classes="dialog-buttons"):
                yield Button("Add", variant="primary", id="mutation-add")
                yield Button("Cancel", id="mutation-cancel")

    def on_mount(self) -> None:
        self.query_one("#mutation-value", Input).focus()

    @property
    def text(self) -> str:
        kind = self.query_one("#mutation-kind", Select).value
        value = self.query_one("#mutation-value", Input).value.strip()
        return f"{kind} {value}"

    def submit(self) -> None:
        text = self.text
        try:
            mutation_labels(self.op_name, text)
        except MoereplayError as error:
            self.query_one("#mutation-error", Static).update(str(error))
            return
        self.dismiss(text)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.submit()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "mutation-add":
            self.submit()
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)


@dataclass(frozen=True)
class BisectChoice:
    """What the bisect dialog asks for: a request for the bisect engine and whether to ignore an existing log."""

    request: BisectRequest
    fresh: bool


STRATEGY_CHOICES = (
    ("calls: first bad call", "calls"),
    ("mutations: minimal fix (ddmin)", "mutations"),
    ("shape: minimal failing shape", "shape"),
    ("packs: first pack that changes", "packs"),
)
MATCH_CHOICES = (
    ("kinds: verdict + finding kinds", "kinds"),
    ("exact: and the same experts", "exact"),
    ("verdict only", "verdict"),
    ("any failure", "any"),
)


def _optional_int(text: str, what: str) -> int | None:
    text = text.strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError as error:
        raise ValueError(f"{what}: {text!r} is not a call index") from error


def _items(text: str, separator: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(separator) if item.strip())


class BisectDialog(ModalScreen[BisectChoice | None]):
    """Chooses a strategy and its options; dismisses with a :class:`BisectChoice` the bisect engine accepted."""

    BINDINGS = bindings_for("modal")

    def __init__(
        self,
        capture: Path,
        *,
        call: int | None,
        strategy: str,
        backend: str | None,
        mutations: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self.capture = capture
        self.call = call
        self.strategy = strategy
        self.backend = backend
        self.mutations = tuple(mutations)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="bisect-dialog"):
            yield Static(f"[b]Bisect[/b] {as_text(self.capture.name)}", classes="dialog-title")
            with Grid(id="bisect-form"):
                yield Label("strategy")
                yield Select(STRATEGY_CHOICES, value=self.strategy, allow_blank=False, id="bisect-strategy")
                yield Label("call")
                yield Input(
                    "" if self.call is None else str(self.call),
                    placeholder="failing call (calls: known-bad end; default last)",
                    id="bisect-call",
                    classes="compact",
                )
                yield Label("good call")
                yield Input(placeholder="calls: a call known good", id="bisect-good", classes="compact")
                yield Label("mutations")
                yield Input(
                    "; ".join(self.mutations),
                    placeholder="mutations: flip A; set B=64; …",
                    id="bisect-mutations",
                    classes="compact",
                )
                yield Label("dimensions")
                yield Input(
                    placeholder="shape: experts, tokens… (all)", id="bisect-dimensions", classes="compact"
                )
                yield Label("packs")
                yield Input(
                    placeholder="packs: DIR, DIR, … oldest first", id="bisect-packs", classes="compact"
                )
                yield Label("same bug if")
                yield Select(MATCH_CHOICES, value="kinds", allow_blank=False, id="bisect-match")
            yield Checkbox("calls: any NaN/Inf output is bad (--nonfinite)", id="bisect-nonfinite")
            yield Checkbox("start afresh (ignore an existing session log)", id="bisect-fresh")
            yield Static("", id="bisect-error", classes="dialog-error")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Start", variant="primary", id="bisect-start")
                yield Button("Cancel", id="bisect-cancel")

    def _value(self, name: str) -> str:
        return self.query_one(f"#bisect-{name}", Input).value

    def choice(self) -> BisectChoice:
        """The request as filled in; raises ``MoereplayError`` / ``ValueError`` with a one-line reason."""
        strategy = str(self.query_one("#bisect-strategy", Select).value)
        match = SignatureMatch(str(self.query_one("#bisect-match", Select).value))
        request = BisectRequest(
            capture=self.capture,
            strategy=strategy,  # type: ignore[arg-type]  # checked by BisectRequest
            call=_optional_int(self._value("call"), "call"),
            good=_optional_int(self._value("good"), "good call") if strategy == "calls" else None,
            mutations=_items(self._value("mutations"), ";") if strategy == "mutations" else (),
            packs=_items(self._value("packs"), ",") if strategy == "packs" else (),
            dimensions=_items(self._value("dimensions"), ",") if strategy == "shape" else (),
            backend=self.backend,
            match=match,
            nonfinite=self.query_one("#bisect-nonfinite", Checkbox).value and strategy == "calls",
        )
        return BisectChoice(request, self.query_one("#bisect-fresh", Checkbox).value)

    def submit(self) -> None:
        try:
            choice = self.choice()
        except (MoereplayError, ValueError) as error:
            self.query_one("#bisect-error", Static).update(str(error))
            return
        self.dismiss(choice)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.submit()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "bisect-start":
            self.submit()
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)
