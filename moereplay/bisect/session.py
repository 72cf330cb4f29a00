"""A bisect session: a search, a predicate, the person at the keyboard, and the log.

The session asks the search for its current probe and settles it either automatically (the predicate's
observation) or by a person's decision — good, bad or skip — exactly like ``git bisect good/bad/skip``; a person may
first look at what the predicate says (:meth:`Session.evaluate`) and then override it. Every settled step is
appended to the log (in the state directory), and :meth:`Session.resume` rebuilds a session from its log by feeding the
recorded observations back to a freshly built, equal search, without running the predicate again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic

from moereplay.bisect.errors import BisectError, BisectLogError
from moereplay.bisect.log import LoggedSession, LogWriter, Step, now, read_log
from moereplay.bisect.observation import Decider, Observation, Outcome, Signature
from moereplay.bisect.probes import key_json
from moereplay.bisect.search import P, R, Search, call_predicate


@dataclass(frozen=True)
class SessionSummary(Generic[R]):
    """Where a session stands: counts of its steps, the target signature, and the result once done."""

    strategy: str
    done: bool
    steps: int
    auto_steps: int
    person_steps: int
    unresolved_steps: int
    target: Signature | None
    result: R | None
    log_path: Path | None

    @property
    def status(self) -> str:
        return "running" if self.result is None else self.result.status

    def to_json(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "done": self.done,
            "status": self.status,
            "steps": self.steps,
            "auto_steps": self.auto_steps,
            "person_steps": self.person_steps,
            "unresolved_steps": self.unresolved_steps,
            "target": None if self.target is None else self.target.to_json(),
            "result": None if self.result is None else self.result.to_json(),
            "log": None if self.log_path is None else str(self.log_path),
        }

    def lines(self) -> tuple[str, ...]:
        head = (
            f"bisect {self.strategy}: {self.status} after {self.steps} step{'' if self.steps == 1 else 's'} "
            f"({self.auto_steps} auto, {self.person_steps} by a person, {self.unresolved_steps} unresolved)"
        )
        body = () if self.result is None else self.result.lines()
        tail = () if self.log_path is None else (f"log: {self.log_path}",)
        return (head, *body, *tail)


class Session(Generic[P, R]):
    """Drives ``search`` step by step with ``predicate`` (optional: a person may decide every step).

    With ``log_path`` a new log is started there (an existing one is refused unless ``overwrite``).
    """

    def __init__(
        self,
        search: Search[P, R],
        predicate: Callable[[P], Observation] | None = None,
        *,
        log_path: Path | None = None,
        capture: str | None = None,
        overwrite: bool = False,
    ) -> None:
        self.search = search
        self.predicate = predicate
        self._steps: list[Step] = []
        self._pending: tuple[Any, Observation, float] | None = None  # (probe key, observation, seconds)
        self._summary_logged = False
        self._writer = (
            None
            if log_path is None
            else LogWriter.create(
                log_path, search.kind, search.config(), capture=capture, overwrite=overwrite
            )
        )

    # ---------------------------------------------------------------------------------------------- resuming

    @classmethod
    def resume(
        cls,
        search: Search[P, R],
        log_path: Path,
        predicate: Callable[[P], Observation] | None = None,
    ) -> Session[P, R]:
        """Rebuild a session from its log; ``search`` must be constructed as the logged one was.

        The recorded observations are fed to ``search`` in order (the predicate is not run); each recorded probe
        must be the one the search asks for, else the log belongs to another search and is refused. Later steps
        append to the same log.
        """
        logged = read_log(log_path)
        _check_same_search(logged, search)
        session = cls(search, predicate)
        for step in logged.steps:
            probe = search.current
            if probe is None:
                raise BisectLogError(f"{log_path}: step {step.number} follows the end of the search")
            if key_json(probe.key) != step.probe_key:
                raise BisectLogError(
                    f"{log_path}: step {step.number} decided {step.label!r} but the search asks about "
                    f"{probe.label!r}; the log was written for another search"
                )
            search.observe(step.observation)
            session._steps.append(step)
        session._writer = LogWriter.reopen(logged)
        session._summary_logged = logged.summary is not None
        session._log_summary_if_done()
        return session

    # ---------------------------------------------------------------------------------------------- state

    @property
    def current(self) -> P | None:
        """The probe to settle next; ``None`` when the search is done."""
        return self.search.current

    @property
    def done(self) -> bool:
        return self.search.done

    @property
    def steps(self) -> tuple[Step, ...]:
        return tuple(self._steps)

    @property
    def log_path(self) -> Path | None:
        return None if self._writer is None else self._writer.path

    @property
    def pending(self) -> Observation | None:
        """What the predicate said about the current probe, if it ran and nobody has settled the step yet."""
        probe = self.search.current
        if probe is None or self._pending is None or self._pending[0] != probe.key:
            return None
        return self._pending[1]

    # ---------------------------------------------------------------------------------------------- settling steps

    def evaluate(self) -> Observation:
        """Run the predicate on the current probe without settling it (once; later calls reuse the answer)."""
        probe = self._require_current()
        pending = self.pending
        if pending is not None:
            return pending
        if self.predicate is None:
            raise BisectError("this session has no predicate: decide each step as good, bad or skip")
        start = time.perf_counter()
        observation = call_predicate(self.predicate, probe)
        self._pending = (probe.key, observation, time.perf_counter() - start)
        return observation

    def step(self) -> Step:
        """Settle the current probe with the predicate's observation."""
        observation = self.evaluate()
        assert self._pending is not None
        return self._settle(observation, Decider.AUTO, None, self._pending[2])

    def decide(self, outcome: Outcome, note: str = "") -> Step:
        """A person settles the current probe: ``GOOD``, ``BAD`` (the target bug) or ``UNRESOLVED`` (skip).

        If the predicate already ran on this probe its observation is kept in the log beside the decision.
        """
        self._require_current()
        auto = self.pending
        seconds = self._pending[2] if auto is not None and self._pending is not None else None
        if outcome is Outcome.BAD:
            # "Bad" means the bug being hunted; before a target exists, the predicate's failure (if it ran) is it.
            signature = self.search.target
            if signature is None and auto is not None and auto.outcome is not Outcome.GOOD:
                signature = auto.signature
            observation = Observation.bad(signature, note or "marked bad by a person")
        elif outcome is Outcome.GOOD:
            observation = Observation.good(note or "marked good by a person")
        else:
            observation = Observation.unresolved(note or "skipped by a person")
        return self._settle(observation, Decider.PERSON, auto, seconds)

    def run_to_end(self, max_steps: int | None = None) -> SessionSummary[R]:
        """Settle automatically until the search is done (or ``max_steps`` more steps were taken)."""
        taken = 0
        while not self.search.done and (max_steps is None or taken < max_steps):
            self.step()
            taken += 1
        return self.summary()

    def summary(self) -> SessionSummary[R]:
        counts = {decider: 0 for decider in Decider}
        unresolved = 0
        for step in self._steps:
            counts[step.decided_by] += 1
            if self.search.classify(step.observation) is Outcome.UNRESOLVED:
                unresolved += 1
        return SessionSummary(
            strategy=self.search.kind,
            done=self.search.done,
            steps=len(self._steps),
            auto_steps=counts[Decider.AUTO],
            person_steps=counts[Decider.PERSON],
            unresolved_steps=unresolved,
            target=self.search.target,
            result=self.search.result if self.search.done else None,
            log_path=self.log_path,
        )

    # ---------------------------------------------------------------------------------------------- internals

    def _require_current(self) -> P:
        probe = self.search.current
        if probe is None:
            raise BisectError(f"the {self.search.kind} search is finished")
        return probe

    def _settle(
        self, observation: Observation, decided_by: Decider, auto: Observation | None, seconds: float | None
    ) -> Step:
        probe = self._require_current()
        step = Step(
            number=len(self._steps) + 1,
            probe_key=key_json(probe.key),
            label=probe.label,
            observation=observation,
            decided_by=decided_by,
            auto_observation=auto,
            seconds=seconds,
            time=now(),
        )
        self.search.observe(observation)
        self._pending = None
        self._steps.append(step)
        if self._writer is not None:
            self._writer.append_step(step)
        self._log_summary_if_done()
        return step

    def _log_summary_if_done(self) -> None:
        if self._writer is not None and self.search.done and not self._summary_logged:
            self._writer.append_summary(self.summary().to_json())
            self._summary_logged = True


def _check_same_search(logged: LoggedSession, search: Search[Any, Any]) -> None:
    if logged.strategy != search.kind:
        raise BisectLogError(f"{logged.path}: a {logged.strategy} session log, not a {search.kind} one")
    expected = key_json(search.config())
    recorded = dict(logged.config)
    if recorded != expected:
        differing = sorted(
            name for name in set(recorded) | set(expected) if recorded.get(name) != expected.get(name)
        )
        raise BisectLogError(
            f"{logged.path}: the log was written for a different {search.kind} search "
            f"(differs in {', '.join(differing)}); start afresh with --fresh (replaces that log) or keep it with "
            "--log OTHER.jsonl"
        )
