"""The step-by-step driver every strategy shares, and :func:`run_to_end`.

A strategy is written as one generator (``_run``) that yields probes and receives observations; :class:`Search`
wraps it as a state machine a caller drives one step at a time — ``current`` is the probe to decide, ``observe``
answers it — so the CLI, the TUI or a person typing good / bad / skip can all drive the same search, like
``git bisect``. A search is deterministic: the same observations in the same order give the same probes, which is
what lets a session resume from its log by replaying the recorded observations.

Observations are cached by probe key, so a strategy that asks twice about one probe (ddmin does) asks only once.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Generator, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from moereplay.bisect.errors import BisectError
from moereplay.bisect.observation import Observation, Outcome, Signature, SignatureMatch, classify
from moereplay.bisect.probes import Probe, key_json
from moereplay.errors import InvalidMutationError, ReferenceError_


class Report(Protocol):
    """What every strategy result offers: a status word, plain JSON, and lines for people."""

    @property
    def status(self) -> str: ...

    def to_json(self) -> dict[str, Any]: ...

    def lines(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class Progress:
    """Where a running search stands, for people (``line``) and for displays (``data``, plain JSON values)."""

    line: str = ""
    data: Mapping[str, Any] = field(default_factory=dict)


P = TypeVar("P", bound=Probe)
R = TypeVar("R", bound=Report)
_ProbeT = TypeVar("_ProbeT")
_ValueT = TypeVar("_ValueT")

Asking = Generator[_ProbeT, Observation, _ValueT]
"""A (sub-)generator of a strategy: yields probes, receives their observations, returns a value."""


class Search(abc.ABC, Generic[P, R]):
    """A bisect strategy as a state machine over probes of type ``P`` with a result of type ``R``.

    ``target`` is the signature of the bug being hunted (``None``: adopt the signature of the first failure the
    search confirms at its starting point). ``match`` says how closely another failure must resemble it.
    ``settings``: what else decides the answer but lies outside the search — how its predicate judges a probe (the
    call, mutations applied to every probe, the backend …), as JSON data. The search never reads them; they are part
    of :meth:`config`, so a session log resumes only under equal settings.
    """

    kind: ClassVar[str]

    def __init__(
        self, *, target: Signature | None, match: SignatureMatch, settings: Mapping[str, Any] | None = None
    ) -> None:
        self._target = target
        self.match = match
        try:
            self.settings: dict[str, Any] = key_json(dict(settings or {}))
        except (TypeError, ValueError) as error:
            raise BisectError(f"search settings must be JSON data: {error}") from error
        self._initial_target = target
        self._cache: dict[Hashable, Observation] = {}
        self._generator: Asking[P, R] | None = None
        self._current: P | None = None
        self._result: R | None = None
        self._done = False
        self._probes_asked = 0
        self._progress = Progress()

    # ---------------------------------------------------------------------------------------------- driving

    @property
    def current(self) -> P | None:
        """The probe waiting for an observation; ``None`` once the search is done."""
        self._start()
        return self._current

    def observe(self, observation: Observation) -> None:
        """Answer the current probe and advance to the next one (or to the result)."""
        self._start()
        if self._done or self._current is None:
            raise BisectError(f"the {self.kind} search is finished; nothing to observe")
        self._cache[self._current.key] = observation
        self._probes_asked += 1
        self._advance(observation)

    @property
    def done(self) -> bool:
        self._start()
        return self._done

    @property
    def result(self) -> R:
        """The strategy's result; only once :attr:`done`."""
        self._start()
        if not self._done:
            raise BisectError(f"the {self.kind} search is not finished")
        return self._result  # type: ignore[return-value]

    @property
    def target(self) -> Signature | None:
        """The signature being hunted (adopted from the starting probe when none was given)."""
        return self._target

    @property
    def probes_asked(self) -> int:
        return self._probes_asked

    @property
    def progress(self) -> Progress:
        """The current interval, candidate set or shape: what a live display shows beside the current probe."""
        self._start()
        return self._progress

    def observation_for(self, probe: P) -> Observation | None:
        """The observation recorded for ``probe`` (or an equal one), if any."""
        return self._cache.get(probe.key)

    # ---------------------------------------------------------------------------------------------- configuration

    def config(self) -> dict[str, Any]:
        """JSON-able description of the search as constructed and its :attr:`settings`; a resumed log must have been
        written for an equal one."""
        own = {
            "strategy": self.kind,
            "target": None if self._initial_target is None else self._initial_target.to_json(),
            "match": self.match.value,
            **self._config(),
        }
        clashing = sorted(set(own) & set(self.settings))
        if clashing:
            raise BisectError(f"search settings may not redefine {', '.join(clashing)}")
        return {**own, **self.settings}

    @abc.abstractmethod
    def _config(self) -> dict[str, Any]:
        """Strategy-specific part of :meth:`config`."""

    # ---------------------------------------------------------------------------------------------- for strategies

    @abc.abstractmethod
    def _run(self) -> Asking[P, R]:
        """The strategy: yield probes, receive observations, return the result."""

    def _ask(self, probe: P) -> Asking[P, Observation]:
        """Observe ``probe``, from the cache when it was observed before."""
        cached = self._cache.get(probe.key)
        if cached is not None:
            return cached
        observation = yield probe
        return observation

    def _ask_outcome(self, probe: P) -> Asking[P, Outcome]:
        """Observe ``probe`` and classify it against the target (a different failure is unresolved)."""
        observation = yield from self._ask(probe)
        return self.classify(observation)

    def classify(self, observation: Observation) -> Outcome:
        """The outcome this search acts on for ``observation`` (a failure of another signature is unresolved)."""
        return classify(observation, self._target, self.match)

    def _adopt_target(self, observation: Observation) -> None:
        """Take the starting point's failure as the target when none was given."""
        if self._target is None and observation.outcome is Outcome.BAD:
            self._target = observation.signature

    def _set_progress(self, line: str, **data: Any) -> None:
        """Strategies call this as they narrow down (see :attr:`progress`)."""
        self._progress = Progress(line, data)

    def _remember(self, probe: P, observation: Observation) -> None:
        """Record an observation the strategy decided without asking (e.g. a shape it knows is illegal)."""
        self._cache[probe.key] = observation

    # ---------------------------------------------------------------------------------------------- internals

    def _start(self) -> None:
        if self._generator is None:
            self._generator = self._run()
            self._advance(None)

    def _advance(self, observation: Observation | None) -> None:
        assert self._generator is not None
        try:
            if observation is None:
                self._current = next(self._generator)
            else:
                self._current = self._generator.send(observation)
        except StopIteration as stop:
            self._current = None
            self._result = stop.value
            self._done = True
            self._progress = Progress(f"done: {stop.value.status}", {"status": stop.value.status})


Predicate = Callable[[P], Observation]
"""Judges one probe. It should report crashes and invalid variants as observations rather than raise."""


def call_predicate(predicate: Callable[[P], Observation], probe: P) -> Observation:
    """Run ``predicate`` on ``probe``; a variant outside the op's domain or beyond the reference is unresolved.

    Only :class:`~moereplay.errors.InvalidMutationError` and :class:`~moereplay.errors.ReferenceError_` are turned
    into observations (they speak about this probe); every other error propagates.
    """
    try:
        return predicate(probe)
    except (InvalidMutationError, ReferenceError_) as error:
        return Observation.unresolved(f"{type(error).__name__.rstrip('_')}: {error}")


def run_to_end(search: Search[P, R], predicate: Callable[[P], Observation]) -> R:
    """Drive ``search`` with ``predicate`` until it is done, and return its result (no log, no person)."""
    while (probe := search.current) is not None:
        search.observe(call_predicate(predicate, probe))
    return search.result
