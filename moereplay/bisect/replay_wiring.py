"""The default wiring of ``moereplay bisect``: searches over a capture file, predicates over the replay engine.

Everything about *what* to search is here: the stream of replayable calls of a capture, ordered by (step, layer,
index); the failing call; the candidate mutations; the packs; the shape dimensions. *Judging* a probe — replaying
one call with some mutations on some backend and turning the verdict and findings into an
:class:`~moereplay.bisect.observation.Observation` — goes through a :class:`Judge`. :func:`replay_judge` binds one to
``moereplay.replay``; while that engine is missing, preparing a search raises
:class:`~moereplay.bisect.errors.ReplayUnavailableError` ("replay engine unavailable"), which the CLI prints as one
line. Heavy modules (the capture reader, torch, the engine) are imported only when a search is prepared.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from moereplay.bisect.ddmin import MutationSearch
from moereplay.bisect.errors import BisectError, ReplayUnavailableError
from moereplay.bisect.observation import Observation, Signature
from moereplay.bisect.packs import PackSearch
from moereplay.bisect.probes import ItemProbe, ShapeProbe, SubsetProbe
from moereplay.bisect.shape import Dimension, ShapeSearch
from moereplay.bisect.stream import FirstBadSearch
from moereplay.bisect.wiring import BisectRequest, Prepared
from moereplay.wording import row_ranges

UNAVAILABLE = "replay engine unavailable"

NOT_SIGNATURE_KINDS = frozenset({"diagnosis", "sanitizer", "contract_violation", "fidelity"})
"""Finding kinds left out of a failure signature: a diagnosis restates the others, a sanitizer report varies from
run to run, a contract violation describes the inputs rather than the failure, and fidelity compares the replay
with the recording rather than judging it."""
MEMORY_DEPENDENT_KIND = "memory_dependent"

MAX_CHOICES_SHOWN = 12
"""How many call numbers the "needs --call" error lists before it says how many there are in all."""
"""Part of a signature only when it is the verdict's own reason (verdict ``memory-dependent``)."""


# --------------------------------------------------------------------------------------------------------------
# verdicts and findings → observations
# --------------------------------------------------------------------------------------------------------------


def _experts_in(evidence: Mapping[str, Any]) -> set[int]:
    """Experts a finding names: ``evidence["experts"]`` (a list) or the keys of ``evidence["by_expert"]``
    (expert id as text → count); negative ids (rows of no expert) are left out."""
    found: set[int] = set()
    listed = evidence.get("experts", ())
    if isinstance(listed, (list, tuple, set, frozenset)):
        found |= {expert for expert in listed if isinstance(expert, int) and not isinstance(expert, bool)}
    counted = evidence.get("by_expert", {})
    if isinstance(counted, Mapping):
        for key in counted:
            try:
                found.add(int(key))
            except (TypeError, ValueError):
                continue
    return {expert for expert in found if expert >= 0}


def signature_of(result: Any, findings: Iterable[Any], inherited: Iterable[Any] = ()) -> Signature:
    """The signature of one variant's failure: its verdict, the kinds of its findings, the experts they name.

    ``result`` is a replay ``VariantResult`` (``label``, ``verdict``); ``findings`` the report's findings, of which
    those about this variant count (``finding.variant == result.label``). Affected experts come from each finding's
    evidence (``experts`` / ``by_expert``, as the replay's localisation writes them). ``inherited`` findings count
    whatever variant they name (see :meth:`ReplayJudge.__call__`).
    """
    kinds: set[str] = set()
    experts: set[int] = set()
    own = [finding for finding in findings if finding.variant == result.label]
    memory_dependent = result.verdict.value == "memory-dependent"
    for finding in [*own, *inherited]:
        kind = finding.kind.value
        if kind in NOT_SIGNATURE_KINDS:
            continue
        if kind == MEMORY_DEPENDENT_KIND and not memory_dependent:
            continue  # beside a worse verdict it needs the guard fills, which a mutated probe does not run
        kinds.add(kind)
        experts |= _experts_in(finding.evidence)
    return Signature(result.verdict.value, frozenset(kinds), frozenset(experts))


NONFINITE_OUTPUT = "nonfinite-output"
"""The verdict part of the signature of an ``ok`` call whose output holds NaN/Inf (``--nonfinite``)."""


def observation_of(
    result: Any, findings: Iterable[Any], inherited: Iterable[Any] = (), *, nonfinite: bool = False
) -> Observation:
    """A variant's verdict as an observation: ``ok`` is good, ``invalid`` and ``needs-kernel`` (not judged)
    unresolved, anything else bad — ``memory-dependent`` too: an output that changes with bytes outside the call's
    tensors is a failure, whose signature (verdict, the ``memory_dependent`` finding, the experts it names) keeps a
    search from drifting to a call that fails another way. ``nonfinite``: any output holding NaN or Inf is bad —
    an ``ok`` one too (the exact reference makes them: the call was given them) — with the one signature
    :data:`NONFINITE_OUTPUT`, whatever made them, so the search finds where they first appear."""
    verdict = result.verdict.value
    holds = bool(getattr(result, "nan", 0) or getattr(result, "inf", 0))
    if nonfinite and holds and verdict not in ("invalid", "needs-kernel"):
        # one signature for every output holding NaN/Inf, made by the kernel or given to it: the search looks for
        # where they first appear, not for one way of failing
        made = "the exact reference makes them too" if verdict == "ok" else f"verdict {verdict}"
        return Observation.bad(
            Signature(NONFINITE_OUTPUT), f"{result.nan} NaN, {result.inf} Inf in the output; {made}"
        )
    if verdict == "ok":
        return Observation.good()
    if verdict in ("invalid", "needs-kernel"):
        return Observation.unresolved(f"{verdict}: {result.reason}" if result.reason else verdict)
    note = f"{result.bad_rows}/{result.rows} rows bad" if getattr(result, "rows", 0) else ""
    if result.reason:
        note = f"{note}; {result.reason}" if note else result.reason
    return Observation.bad(signature_of(result, findings, inherited), note)


# --------------------------------------------------------------------------------------------------------------
# the stream of calls
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallRef:
    """A call of the capture, as the ``calls`` strategy orders and labels it."""

    index: int
    op: str
    step: int | None
    layer: int | None

    @property
    def label(self) -> str:
        where = []
        if self.step is not None:
            where.append(f"step {self.step}")
        if self.layer is not None:
            where.append(f"layer {self.layer}")
        return f"#{self.index} {self.op}" + (f" ({', '.join(where)})" if where else "")

    @property
    def order(self) -> tuple[int, int, int]:
        return (
            -1 if self.step is None else self.step,
            -1 if self.layer is None else self.layer,
            self.index,
        )


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def stream_of_calls(capture: Path, *, op: str | None = None, layer: int | None = None) -> list[CallRef]:
    """The capture's replayable calls ordered by (step, layer, index); ``op`` is a glob as in ``moereplay ls``.

    Without ``op`` only calls of ops some ops module declares are kept (enclosing calls such as
    ``fused_marlin_moe`` are context, not kernels to replay). Reads call records only, never tensor bytes.
    """
    from moereplay.format.reader import CaptureReader
    from moereplay.ops import known_op_names

    replayable = set(known_op_names())
    with CaptureReader(capture) as reader:
        refs = [
            CallRef(
                record.index, record.op, _int_or_none(record.context.get("step")), _int_or_none(record.layer)
            )
            for record in reader.select(op=op, layer=layer)
            if op is not None or record.op in replayable
        ]
    return sorted(refs, key=lambda ref: ref.order)


# --------------------------------------------------------------------------------------------------------------
# judging probes
# --------------------------------------------------------------------------------------------------------------


class Judge(Protocol):
    """Replays call ``call`` of the capture with ``mutations`` (spec strings) on ``backend`` (``None``: default),
    shrunk to ``shape`` when given, and says what happened."""

    def __call__(
        self, call: int, mutations: Sequence[str], backend: str | None, shape: Mapping[str, int] | None
    ) -> Observation: ...


ShapeSource = Callable[[Path, int], tuple[Sequence[Dimension], Callable[[Mapping[str, int]], bool] | None]]
"""The shrinkable dimensions of one call (and a legal-shape rule across them)."""


JUDGE_DEFAULTS: Mapping[str, Any] = {"explain_fidelity": False, "localise_reads": False}
"""``replay()`` options every probe gets unless told otherwise: a probe's observation needs neither why a replay is
not bit-exact with the recording nor which bytes an over-read reaches (both cost kernel runs); the guard fills that
follow a contract's prediction still run for a probe of the call as captured, so a memory-dependent call is seen."""


def replay_judge(capture: Path, **options: Any) -> ReplayJudge:
    """A judge over ``moereplay.replay``; raises :class:`ReplayUnavailableError` when the engine cannot be loaded.

    ``options`` go to every ``replay()`` call (``device``, ``isolate``, ``repeat``, ``timeout_s`` …), over
    :data:`JUDGE_DEFAULTS`.
    """
    try:
        engine = importlib.import_module("moereplay.replay")
        replay = engine.replay
        load_call = engine.load_call
    except (ImportError, AttributeError) as error:
        raise ReplayUnavailableError(UNAVAILABLE) from error
    return ReplayJudge(capture, replay, load_call, {**JUDGE_DEFAULTS, **options})


@dataclass(frozen=True)
class _InMemoryCall:
    """What ``replay()`` accepts beside ``args`` for a call that exists only in memory (a shrunk one)."""

    op: str


def _dimension(item: Any) -> Dimension:
    return Dimension.of(item)


class ReplayJudge:
    """Judges probes by replaying one call with ``moereplay.replay.replay``.

    A probe with mutations becomes *one* variant holding all of them (a ddmin subset is applied together); the
    observation comes from that variant's verdict and findings, or from the baseline's for a probe without
    mutations. The last loaded call is kept (mutation and pack searches replay one call many times). Each probe
    is one ``replay()``: the engine runs the baseline beside a variant and, for kernel backends, starts its worker
    process, so a probe costs about two kernel runs plus the worker's start.

    Shapes: the call's op declares ``shape_dimensions(args)`` → dimensions (:class:`Dimension` or ``(name, legal
    values, original)``), ``shrink(args, shape)`` → the arguments of a call of that shape, and optionally
    ``shape_legal(shape)``; a shrunk call is replayed from memory (compared with the reference only).
    """

    def __init__(
        self,
        capture: Path,
        replay: Callable[..., Any],
        load_call: Callable[..., Any],
        options: Mapping[str, Any] | None = None,
    ) -> None:
        self.capture = capture
        self._replay = replay
        self._load_call = load_call
        self.options = dict(options or {})
        self._loaded: tuple[int, Any] | None = None
        self.nonfinite = False  # an ok call whose output holds NaN/Inf is bad (``bisect --nonfinite``)

    def loaded(self, call: int) -> Any:
        """The call's ``LoadedCall`` (arguments decoded, on the device the engine will use)."""
        if self._loaded is None or self._loaded[0] != call:
            device = self.options.get("device")
            if device is None:
                import torch

                device = "cuda" if torch.cuda.is_available() else "cpu"
            self._loaded = None  # free the previous call's tensors before loading the next
            self._loaded = (call, self._load_call(self.capture, call, device))
        return self._loaded[1]

    def op_of(self, call: int) -> Any:
        """The call's op, from its record alone (no tensor decoded, no recipe expanded: a typo in a mutation is
        refused in well under a second); an op this process does not know yet (a ``python:`` backend registers its
        own when it loads) comes from the loaded call."""
        from moereplay.errors import ReplayError
        from moereplay.format import CaptureReader
        from moereplay.ops import get_op

        if self._loaded is not None and self._loaded[0] == call:
            return self._loaded[1].op
        with CaptureReader(self.capture) as reader:
            name = reader.call(call).op
        try:
            return get_op(name)
        except ReplayError:
            return self.loaded(call).op

    def variant(self, call: int, mutations: Sequence[str]) -> Any:
        """One replay ``Variant`` applying every mutation of ``mutations``; malformed specs raise
        ``InvalidMutationError`` and a spec that makes several variants (a sweep) is refused."""
        from moereplay.replay.engine import parse_variants
        from moereplay.replay.mutations import Variant

        op = self.op_of(call)
        parts: list[Any] = []
        for spec in mutations:
            variants = parse_variants(op, [spec])
            if len(variants) != 1:
                raise BisectError(
                    f"mutation {spec!r} makes {len(variants)} variants; bisect needs single changes"
                )
            parts.extend(variants[0].mutations)
        return Variant(tuple(parts), "; ".join(mutations))

    def flag_flips(self, call: int) -> tuple[str, ...]:
        """``flip ARG`` for every flag the call's op declares mutable: the default ddmin candidates."""
        from moereplay.ops.base import ArgKind, argument_spec

        op = self.loaded(call).op
        return tuple(
            f"flip {mutable.name}"
            for mutable in op.mutable
            if argument_spec(op, mutable.name).kind is ArgKind.FLAG
        )

    def shapes(
        self, capture: Path, call: int
    ) -> tuple[tuple[Dimension, ...], Callable[[Mapping[str, int]], bool] | None]:
        """The call's shrinkable dimensions and legal-shape rule, as its op declares them."""
        loaded = self.loaded(call)
        op = loaded.op
        declare = getattr(op, "shape_dimensions", None)
        if declare is None or getattr(op, "shrink", None) is None:
            raise BisectError(
                f"op {op.name} declares no shrinkable dimensions (shape_dimensions / shrink); "
                "--strategy shape cannot run on it"
            )
        return tuple(_dimension(item) for item in declare(loaded.args)), getattr(op, "shape_legal", None)

    def __call__(
        self, call: int, mutations: Sequence[str], backend: str | None, shape: Mapping[str, int] | None
    ) -> Observation:
        loaded = self.loaded(call)
        options: dict[str, Any] = {**self.options, "backend": backend or "auto"}
        source: Any = loaded
        if shape is not None:
            dimensions, _ = self.shapes(self.capture, call)
            full = {dimension.name: dimension.original for dimension in dimensions}
            options["args"] = loaded.op.shrink(loaded.args, {**full, **shape})
            source = _InMemoryCall(loaded.op.name)
        if not mutations:  # the call as captured: its headline, the worse of recorded and replayed
            report = self._replay(source, **options)
            return observation_of(report.headline.result, report.findings, nonfinite=self.nonfinite)
        # the probe is the variant: the fills that test the call as captured would only cost runs here
        options.setdefault("follow_evidence", False)
        report = self._replay(source, mutations=[self.variant(call, mutations)], **options)
        result = report.variants[0]
        # The engine leaves out of a variant the findings the row it is set beside (the baseline; offline the
        # recorded row) already reported word for word, so a variant failing like it inherits those findings.
        inherited: list[Any] = []
        peer = report.as_captured
        if result.verdict == peer.verdict:
            inherited = [finding for finding in report.findings if finding.variant == peer.label]
        return observation_of(result, report.findings, inherited, nonfinite=self.nonfinite)


class ReplayWiring:
    """Prepares each strategy over a capture file.

    ``judge`` / ``shapes`` replace the engine-backed defaults; ``replay_options`` go to every ``replay()`` call of
    the default judge (e.g. ``device="cpu", isolate=False``).
    """

    def __init__(
        self,
        judge: Judge | None = None,
        shapes: ShapeSource | None = None,
        replay_options: Mapping[str, Any] | None = None,
    ) -> None:
        self._judge = judge
        self._shapes = shapes
        self._replay_options = dict(replay_options or {})

    def _settings(self, **settings: Any) -> dict[str, Any]:
        """A search's settings (:attr:`~moereplay.bisect.search.Search.settings`): what its predicate's answers depend
        on beyond the search — given per strategy — and the replay options when the default judge is used."""
        if self._judge is None and self._replay_options:
            settings["replay_options"] = json.loads(
                json.dumps(self._replay_options, default=repr, sort_keys=True)
            )
        return settings

    def prepare(self, request: BisectRequest) -> Prepared:
        judge = (
            self._judge if self._judge is not None else replay_judge(request.capture, **self._replay_options)
        )
        if request.strategy == "calls":
            return self._calls(request, judge)
        call = self._failing_call(request)
        if request.strategy in ("mutations", "shape") and self._judge is None:
            self._require_kernels(request)
        if request.strategy == "mutations":
            return self._mutations(request, judge, call)
        if request.strategy == "packs":
            return self._packs(request, judge, call)
        return self._shape(request, judge, call)

    @staticmethod
    def _require_kernels(request: BisectRequest) -> None:
        """Offline a shrunk or mutated call has no output to judge (the captured one answers for the call as
        captured only): say so before any probe runs, instead of a search that ends "not reproduced"."""
        from moereplay.replay.backends import parse_backend

        spec = parse_backend(request.backend or "auto")
        if not spec.runs_kernels:
            probe = "shrunk call" if request.strategy == "shape" else "mutated call"
            raise BisectError(
                f"--strategy {request.strategy} needs a kernel backend: with --backend {spec.text} no kernel runs, "
                f"and the captured output only answers for the call as captured, not for a {probe} (run it where "
                "--backend vllm, pack:DIR or python:MODULE works; offline, `moereplay run` judges the recorded call)"
            )

    @staticmethod
    def _failing_call(request: BisectRequest) -> int:
        """``--call``, else the capture's one replayable call; with several, one line naming them."""
        if request.call is not None:
            return request.call
        refs = stream_of_calls(request.capture, op=request.op, layer=request.layer)
        if len(refs) == 1:
            return refs[0].index
        if not refs:
            raise BisectError(f"{request.capture}: no replayable calls match the selection")
        numbers = sorted(ref.index for ref in refs)
        shown = ", ".join(str(number) for number in numbers[:MAX_CHOICES_SHOWN])
        more = f" … ({len(numbers)} in all)" if len(numbers) > MAX_CHOICES_SHOWN else ""
        raise BisectError(
            f"--strategy {request.strategy} needs --call N (the failing call): "
            f"{request.capture.name} holds calls {shown}{more}"
        )

    def _calls(self, request: BisectRequest, judge: Judge) -> Prepared:
        refs = stream_of_calls(request.capture, op=request.op, layer=request.layer)
        if not refs:
            raise BisectError(f"{request.capture}: no replayable calls match the selection")
        positions = {ref.index: position for position, ref in enumerate(refs)}

        def position_of(index: int | None, option: str) -> int | None:
            if index is None:
                return None
            if index not in positions:
                raise BisectError(
                    f"{option} {index} is not among the selected calls ({row_ranges(positions)}; see "
                    "`moereplay ls`)"
                )
            return positions[index]

        good, bad = position_of(request.good, "--good"), position_of(request.call, "--call")
        if good is not None and good >= (len(refs) - 1 if bad is None else bad):
            raise BisectError(
                f"--good {request.good} must come before the known-bad call "
                f"{request.call if request.call is not None else refs[-1].index} in the stream"
            )
        search = FirstBadSearch(
            refs,
            labels=[ref.label for ref in refs],
            numbers=[ref.index for ref in refs],
            noun="call",
            known_good=good,
            known_bad=bad,
            match=request.match,
            settings=self._settings(
                mutations=list(request.mutations),
                backend=request.backend or "auto",
                **({"nonfinite": True} if request.nonfinite else {}),
            ),
        )
        always = request.mutations
        if always and isinstance(judge, ReplayJudge):
            judge.variant(refs[search.known_bad].index, always)
        if isinstance(judge, ReplayJudge):
            judge.nonfinite = request.nonfinite
        elif request.nonfinite:
            raise BisectError("--nonfinite needs moereplay's own replay judge")
        backend = request.backend

        def predicate(probe: ItemProbe[CallRef]) -> Observation:
            return judge(probe.item.index, always, backend, None)

        calls = "1 call" if len(refs) == 1 else f"{len(refs)} calls"
        described = f"{calls} of {request.capture.name} by step and layer"
        if request.nonfinite:
            described += "; an output holding NaN or Inf is bad"
        return Prepared(search, predicate, described)

    def _mutations(self, request: BisectRequest, judge: Judge, call: int) -> Prepared:
        candidates = request.mutations
        if isinstance(judge, ReplayJudge):
            if not candidates:
                candidates = judge.flag_flips(call)
            for spec in candidates:
                judge.variant(call, [spec])  # a typo must stop here, not turn every probe unresolved
        if not candidates:
            raise BisectError("--strategy mutations needs candidate mutations (--mutations 'flip ARG' …)")
        search = MutationSearch(
            list(candidates),
            match=request.match,
            settings=self._settings(call=call, backend=request.backend or "auto"),
        )
        backend = request.backend

        def predicate(probe: SubsetProbe[str]) -> Observation:
            return judge(call, probe.items, backend, None)

        return Prepared(search, predicate, f"call #{call}, {len(candidates)} candidate mutations", call)

    def _packs(self, request: BisectRequest, judge: Judge, call: int) -> Prepared:
        always = request.mutations
        if always and isinstance(judge, ReplayJudge):
            judge.variant(call, always)
        labels = [Path(pack).name or pack for pack in request.packs]
        search = PackSearch(
            list(request.packs),
            labels=labels,
            match=request.match,
            # the labels are the directories' names only; two folders may hold packs of one name
            settings=self._settings(
                call=call,
                mutations=list(always),
                packs=[str(Path(pack).expanduser().resolve()) for pack in request.packs],
            ),
        )

        def predicate(probe: ItemProbe[str]) -> Observation:
            return judge(call, always, f"pack:{probe.item}", None)

        return Prepared(search, predicate, f"call #{call} on {len(request.packs)} kernel packs", call)

    def _shape(self, request: BisectRequest, judge: Judge, call: int) -> Prepared:
        if self._shapes is not None:
            dimensions, legal = self._shapes(request.capture, call)
        elif isinstance(judge, ReplayJudge):
            dimensions, legal = judge.shapes(request.capture, call)
        else:
            raise BisectError("--strategy shape needs a source of shrinkable dimensions")
        if request.dimensions:
            known = {dimension.name for dimension in dimensions}
            unknown = sorted(set(request.dimensions) - known)
            if unknown:
                raise BisectError(
                    f"unknown dimension(s) {', '.join(unknown)} (the op declares {', '.join(sorted(known))})"
                )
            dimensions = [dimension for dimension in dimensions if dimension.name in request.dimensions]
        always = request.mutations
        if always and isinstance(judge, ReplayJudge):
            judge.variant(call, always)
        search = ShapeSearch(
            dimensions,
            legal=legal,
            match=request.match,
            settings=self._settings(call=call, mutations=list(always), backend=request.backend or "auto"),
        )
        backend = request.backend

        def predicate(probe: ShapeProbe) -> Observation:
            return judge(call, always, backend, probe.shape)

        names = ", ".join(dimension.name for dimension in dimensions)
        return Prepared(search, predicate, f"call #{call}, shrinking {names}", call)
