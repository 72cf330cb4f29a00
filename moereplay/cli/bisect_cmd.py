"""``moereplay bisect FILE --strategy calls|mutations|shape|packs``: narrow a failure down, headless or in the TUI.

The command is thin: it turns its options into a :class:`~moereplay.bisect.wiring.BisectRequest`, asks the wiring
(``wiring_factory``, replaceable for tests and other front ends) for a search and a predicate, and drives a
:class:`~moereplay.bisect.session.Session` logged in the state directory (:mod:`moereplay.bisect.log`). An existing log for the same session is
resumed (``--fresh`` starts over). On a terminal (unless ``--no-tui`` or ``--json``) the session goes to the TUI's
bisect screen; headless, each step prints one line as it is settled and the summary follows (``--json``: one JSON
document with the summary and every step). Exit status: 0 when the search reached an answer, 1 when it ended
without one (ambiguous, not reproduced, nothing to minimise …) or stopped at ``--max-steps``, 2 on errors.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from moereplay.cli import app, note_damage

if TYPE_CHECKING:
    from moereplay.bisect.log import Step
    from moereplay.bisect.session import Session
    from moereplay.bisect.wiring import Wiring

CONCLUSIVE = frozenset({"found", "minimised", "shrunk", "no_change"})
"""Result statuses that answer the question asked (exit status 0)."""


def _replay_wiring() -> Wiring:
    from moereplay.bisect.replay_wiring import ReplayWiring

    return ReplayWiring()


wiring_factory: Callable[[], Wiring] = _replay_wiring
"""Builds the wiring the command uses; tests and other front ends may replace it."""


@app.command("bisect")
def bisect_command(
    file: Annotated[Path, typer.Argument(help="A capture file (.zst).", show_default=False)],
    strategy: Annotated[
        str,
        typer.Option(
            "--strategy",
            "-s",
            help="calls: first bad call of the stream; mutations: minimal passing mutation set (ddmin); "
            "shape: minimal failing shape; packs: first kernel pack where the behaviour changes.",
        ),
    ],
    call: Annotated[
        int | None,
        typer.Option(
            "--call",
            help="The failing call (default: the file's only call; for calls: the known-bad end, default the last).",
        ),
    ] = None,
    good: Annotated[int | None, typer.Option("--good", help="calls: a call index known to be good.")] = None,
    op: Annotated[str | None, typer.Option("--op", help="calls: only calls of this op.")] = None,
    layer: Annotated[int | None, typer.Option("--layer", help="calls: only calls of this layer.")] = None,
    mutations: Annotated[
        list[str] | None,
        typer.Option(
            "--mutations",
            "-m",
            help="A mutation as `moereplay run` writes it ('flip mul_topk_weights', 'set moe_block_size=64', "
            "'fill 0xff'); repeat, or separate with ';'. mutations: the candidates (default: flip each flag); "
            "other strategies: applied to every probe.",
        ),
    ] = None,
    packs: Annotated[
        list[str] | None, typer.Option("--pack", help="packs: a kernel pack directory; repeat, oldest first.")
    ] = None,
    dimensions: Annotated[
        list[str] | None,
        typer.Option("--dim", help="shape: only shrink this dimension; repeat. Default: all."),
    ] = None,
    backend: Annotated[
        str | None,
        typer.Option("--backend", help="vllm, pack:DIR, reference or python:MODULE (as `moereplay run`)."),
    ] = None,
    match: Annotated[
        str,
        typer.Option(
            "--match",
            help="How closely another failure must resemble the original to count as the same bug: "
            "exact, kinds (verdict + finding kinds), verdict, any.",
        ),
    ] = "kinds",
    nonfinite: Annotated[
        bool,
        typer.Option(
            "--nonfinite",
            help="calls: a call whose output holds NaN or Inf is bad even when the exact reference makes them too "
            "(find where they first appear; its diagnosis says who made them).",
        ),
    ] = False,
    log: Annotated[
        Path | None,
        typer.Option(
            "--log",
            help="Session log (default: $MOEREPLAY_STATE_DIR/bisect/, else ./moereplay-captures/bisect/).",
        ),
    ] = None,
    fresh: Annotated[
        bool, typer.Option("--fresh", help="Start afresh even if a session log exists.")
    ] = False,
    max_steps: Annotated[
        int | None, typer.Option("--max-steps", min=1, help="Stop after this many new steps (resume later).")
    ] = None,
    no_tui: Annotated[bool, typer.Option("--no-tui", help="Run headless even on a terminal.")] = False,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print one JSON document instead of text.")
    ] = False,
) -> None:
    """Bisect a failing kernel call: first bad call, minimal mutation set, minimal shape, or kernel packs."""
    from moereplay.bisect.errors import BisectError
    from moereplay.bisect.log import default_log_path
    from moereplay.bisect.observation import SignatureMatch
    from moereplay.bisect.session import Session
    from moereplay.bisect.wiring import STRATEGIES, BisectRequest

    if strategy not in STRATEGIES:
        raise BisectError(f"--strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
    try:
        signature_match = SignatureMatch(match)
    except ValueError as error:
        choices = ", ".join(policy.value for policy in SignatureMatch)
        raise BisectError(f"--match must be one of {choices}, not {match!r}") from error
    request = BisectRequest(
        capture=file,
        strategy=strategy,  # checked against STRATEGIES above
        call=call,
        good=good,
        op=op,
        layer=layer,
        mutations=tuple(spec.strip() for text in mutations or () for spec in text.split(";") if spec.strip()),
        packs=tuple(packs or ()),
        dimensions=tuple(dimensions or ()),
        backend=backend,
        match=signature_match,
        nonfinite=nonfinite,
    )
    note_damage(file)
    prepared = wiring_factory().prepare(request)
    request = request.with_call(prepared.call)  # --call left out of a one-call file: that call
    call = request.call
    log_path = log if log is not None else default_log_path(file, strategy, request.log_tag)
    resumed = 0
    if log_path.exists() and not fresh:
        session: Session[Any, Any] = Session.resume(prepared.search, log_path, prepared.predicate)
        resumed = len(session.steps)
        _note(f"resuming {log_path} ({resumed} step{'' if resumed == 1 else 's'} recorded)")
    else:
        session = Session(
            prepared.search, prepared.predicate, log_path=log_path, capture=str(file), overwrite=fresh
        )
    interactive = not no_tui and not json_output and _interactive_terminal()
    call_shown = None if strategy == "calls" else call
    in_tui = interactive and _run_in_tui(session, prepared.description, file, call_shown, resumed)
    if not in_tui:
        if not json_output:
            print(f"bisect {strategy}: {prepared.description}")
            for step in session.steps:
                _print_step(step, resumed=True)
        taken = 0
        while not session.done and (max_steps is None or taken < max_steps):
            step = session.step()
            taken += 1
            if not json_output:
                _print_step(step)

    summary = session.summary()
    if json_output:
        document = {"summary": summary.to_json(), "steps": [step.to_json() for step in session.steps]}
        sys.stdout.write(json.dumps(document, indent=2, allow_nan=False) + "\n")
    else:
        for line in summary.lines():
            print(line)
    if not summary.done or summary.status not in CONCLUSIVE:
        raise typer.Exit(1)


def _print_step(step: Step, *, resumed: bool = False) -> None:
    marker = " (from log)" if resumed else ""
    who = "" if step.decided_by.value == "auto" else f" [{step.decided_by.value}]"
    seconds = "" if step.seconds is None else f" {step.seconds:.2f}s"
    print(f"  step {step.number}: {step.label} -> {step.observation}{who}{seconds}{marker}")


def _interactive_terminal() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


def _note(message: str) -> None:
    print(f"moereplay: note: {message}", file=sys.stderr)


def _run_in_tui(
    session: Session[Any, Any], description: str, capture: Path, call: int | None, resumed: int
) -> bool:
    """Hand the session to the TUI's bisect screen; ``False`` (run headless) when the TUI cannot be loaded."""
    try:
        from moereplay.tui.app import MoereplayApp
        from moereplay.tui.bisect_sessions import BisectLaunch
    except ImportError as error:
        _note(f"the TUI is not available ({error}); running headless")
        return False
    MoereplayApp(bisect=BisectLaunch(session, description, capture, call, resumed)).run()
    return True
