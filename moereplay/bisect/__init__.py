"""Bisect: narrow a kernel failure down, over one predicate, without drifting to a different bug.

Plain Python with no heavy imports (predicates may use torch; this package does not). A *predicate* judges one
*probe* and returns an :class:`Observation` — an :class:`Outcome` and the failure's :class:`Signature`. Each strategy
is a :class:`Search` a caller drives step by step (``current`` / ``observe``) or all at once (:func:`run_to_end`):

- :class:`FirstBadSearch` (``calls``): the first bad call of an ordered stream, skips handled like ``git bisect``;
- :class:`MutationSearch` (``mutations``): ddmin — the minimal mutation set that makes a failing call pass, and which
  mutations do not matter;
- :class:`ShapeSearch` (``shape``): the minimal failing shape over legal dimension values, and which dimensions matter;
- :class:`PackSearch` (``packs``): the first kernel pack in an ordered list where the behaviour changes.

A :class:`Session` adds the person (good / bad / skip overrides) and the JSON-lines log (in the state directory), from which
it resumes (:meth:`Session.resume`). :mod:`moereplay.bisect.replay_wiring` builds searches over a capture file and
judges their probes with ``moereplay.replay``.
"""

from __future__ import annotations

from moereplay.bisect.ddmin import MutationResult, MutationSearch
from moereplay.bisect.errors import BisectError, BisectLogError, ReplayUnavailableError
from moereplay.bisect.interval import Interval, bisect_interval
from moereplay.bisect.log import LoggedSession, Step, default_log_path, read_log
from moereplay.bisect.observation import Decider, Observation, Outcome, Signature, SignatureMatch, classify
from moereplay.bisect.packs import PackResult, PackSearch
from moereplay.bisect.probes import ItemProbe, Probe, ShapeProbe, SubsetProbe
from moereplay.bisect.search import Predicate, Progress, Report, Search, call_predicate, run_to_end
from moereplay.bisect.session import Session, SessionSummary
from moereplay.bisect.shape import Dimension, DimensionReport, ShapeResult, ShapeSearch
from moereplay.bisect.stream import FirstBadResult, FirstBadSearch

__all__ = [
    "BisectError",
    "BisectLogError",
    "Decider",
    "Dimension",
    "DimensionReport",
    "FirstBadResult",
    "FirstBadSearch",
    "Interval",
    "ItemProbe",
    "LoggedSession",
    "MutationResult",
    "MutationSearch",
    "Observation",
    "Outcome",
    "PackResult",
    "PackSearch",
    "Predicate",
    "Probe",
    "Progress",
    "ReplayUnavailableError",
    "Report",
    "Search",
    "Session",
    "SessionSummary",
    "ShapeProbe",
    "ShapeResult",
    "ShapeSearch",
    "Signature",
    "SignatureMatch",
    "Step",
    "SubsetProbe",
    "bisect_interval",
    "call_predicate",
    "classify",
    "default_log_path",
    "read_log",
    "run_to_end",
]
