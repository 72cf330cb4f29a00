"""Tokens per second of a served MoE model with capture off, the flight recorder armed, and full capture.

Run on the GPU machine after the prelude (kernel pack + serving pack carried), with a model from tools/models/::

    python3 tools/bench/serve_bench.py --model /tmp/models/gpt-oss-24l --mode graph --rounds 3

The three servers (one per capture setting) are started together on the one GPU and measured in interleaved
rounds — each round runs every measurement on every server, the server order rotating — so a drift of the
machine (clocks, other tenants) touches all settings alike. Measurements, all greedy with ``ignore_eos``:

- decode, batch 1: one request with a short prompt and ``--decode-tokens`` new tokens; completion tokens / s;
- decode, batch 32: 32 such requests at once; completion tokens / s over the wall time of the batch;
- prefill: ``--prefill-requests`` requests of ~``--prefill-length`` prompt tokens and one new token each; prompt
  tokens / s.

Each number includes the HTTP round trip, identical for all settings. Prints one table: the median of the rounds
per setting and its ratio to capture off (slowdown ×: off tokens/s ÷ setting tokens/s, so 1.05 is 5 % slower).
Under it, per setting, the median and range of the per-round ratios (each round's off ÷ setting): a slow round
moves one of them, where it can move a column's median (decode batch 32 falls into a ~2× slow mode now and then,
capture off included), and where a round of either side fell into that mode, the same over the steady rounds
alone (:func:`steady_ratios`). With two servers the rotation measures, in every round from the second, one server's
decode batch 1 right after its own prefill, the two by turns: a line gives each server's median apart, right
after its own prefill or not, and the ratio where neither followed itself (:func:`follow_notes`; a prefill's
aftermath shows there). Last, a line per recorder setting held to issue 14's targets (:data:`TARGETS`):
meets (every figure under it), misses, or at the line within the A/A spread. ``--pool A.json B.json …`` prints
the same over several runs' ``--json`` files, serving nothing (rounds are paired within their own run).

Two ways a number can mean something else, both handled:

- the prompts repeat between rounds, and vLLM caches prompt prefixes by default, so every server runs with
  ``--no-enable-prefix-caching`` (else "prefill" after the warm-up measures a few cached steps);
- a capture that stops — the file reached ``MOEREPLAY_MAX_BYTES`` (full capture of an eager server writes GBs a
  minute), a write failed — leaves vLLM running with the recorder off, so that server measures capture off. Each
  server's log is read for the recorder's "capture disabled" line; a setting whose recorder stopped before or
  during the measured rounds is marked in the table with when and why, and its ratios are not capture's cost.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPOSITORY / "tools" / "serve"))
sys.path.insert(0, str(REPOSITORY / "tools" / "gpu"))

import harness  # noqa: E402
import serve_gpu  # noqa: E402
import spin_plugin  # noqa: E402

from moereplay.cli.inspect_cmds import recorder_cost, recorder_timers  # noqa: E402  (also printed by moereplay info)

SETTINGS: dict[str, dict[str, str]] = {
    "off": {},
    "flight": {"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_TRIGGER": "flight"},
    "full": {"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_MAX_BYTES": "12G"},
    # diagnostic: the flight recorder without its graph ring (graph-replayed calls not kept): what is left is
    # its host side (the writer thread's polls, the wrappers of eager calls)
    "flight-nograph": {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_TRIGGER": "flight",
        "MOEREPLAY_FLIGHT_GRAPH_BYTES": "0",
    },
    # diagnostic: the flight recorder polling the graph ring's tag words every 50 ms instead of 5 (its other
    # polls unchanged): what the writer's polls, which take the GIL from the serving threads, cost under graphs
    # beside the ring kernels' device time
    "flight-gpoll50": {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_TRIGGER": "flight",
        "MOEREPLAY_FLIGHT_GRAPH_POLL_MS": "50",
    },
    # diagnostic: the flight recorder as it was by default until 2026-12-07 — only lone graph entries staged, each
    # entry recorded by a node of its own (the default stages entries up to 384K, every gpt-oss decode batch up to
    # 32, and records a graph's staged entries by one batch node at its end: on the path a copy per layer call)
    "flight-nobatch": {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_TRIGGER": "flight",
        "MOEREPLAY_FLIGHT_GRAPH_STAGE": "32K",
        "MOEREPLAY_FLIGHT_GRAPH_BATCH": "0",
    },
    # diagnostic: the flight recorder with MOEREPLAY_TIMERS (its pieces timed, its threads' CPU time beside the
    # wall time; a few µs a call more than "flight"): where the serving thread's time per layer call goes
    "flight-timers": {"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_TRIGGER": "flight", "MOEREPLAY_TIMERS": "1"},
    # diagnostic: armed, but no MoE layer selected (no model has a layer 100000): every layer call still goes
    # through the wrapper and the context tracking, none is recorded — the cost of being armed, apart from the
    # cost of recording ("flight" less this)
    "flight-idle": {"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_TRIGGER": "flight", "MOEREPLAY_LAYERS": "100000"},
    # diagnostic: flight-idle with MOEREPLAY_TIMERS — the serving process's garbage collections when nothing is
    # recorded, beside flight-timers' when every layer call is: whether the recorder's per-call objects bring on
    # the full collections (281 ms each, nine in an eager run of 2026-12-07)
    "flight-idle-timers": {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_TRIGGER": "flight",
        "MOEREPLAY_LAYERS": "100000",
        "MOEREPLAY_TIMERS": "1",
    },
    # diagnostic: the flight recorder with every eager call's inputs copied after it, in its one launch (no side
    # stream beside prefill-sized calls): what copying the inputs beside the call saves at prefill
    "flight-inline": {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_TRIGGER": "flight",
        "MOEREPLAY_FLIGHT_BESIDE_BYTES": "0",
    },
    # a candidate default: the copy beside each prefill-sized call forked and joined by the driver's event calls on
    # two events made once, launched on the side stream's handle (MOEREPLAY_FLIGHT_BESIDE_DRIVER). On an H100
    # (2026-12-08, 117 prefill rounds) the recorder took 376 µs of serving-thread time per prefill call, 154 µs of
    # it in copy_beside (its ring launch ≈ 66) and 21 µs in the join, while 250 µs of spin alone cost prefill
    # 1.009× against flight's 1.026×: what the serving-thread time this saves is worth
    "flight-beside-driver": {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_TRIGGER": "flight",
        "MOEREPLAY_FLIGHT_BESIDE_DRIVER": "1",
    },
    # a candidate default for graph mode: the eager calls' checks left to the writer's polls, which run every 5 ms
    # while graphs hold ring launches anyway (MOEREPLAY_FLIGHT_INLINE_CHECKS=0). On an H100 (2026-12-08, timers)
    # the serving thread's check after each prefill call took 52 µs of its 451
    "flight-noinline": {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_TRIGGER": "flight",
        "MOEREPLAY_FLIGHT_INLINE_CHECKS": "0",
    },
    # candidate defaults that add the cuts up: the eager checks left to the writer's polls with the beside copy
    # through the driver, or with lean prefill-sized calls (no beside copy at all: a good prefill call costs the read
    # of its output for the check and the two launches of record_lean, the least device time of any setting). On an
    # H100 (2026-12-08) 376 µs of serving-thread time per prefill call cost about half of prefill's 2.6 %, the ring's
    # device copies (≈ 4 × a call's 47 MB at 8,192 tokens) most of the rest
    "flight-driver-noinline": {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_TRIGGER": "flight",
        "MOEREPLAY_FLIGHT_BESIDE_DRIVER": "1",
        "MOEREPLAY_FLIGHT_INLINE_CHECKS": "0",
    },
    "flight-lean-noinline": {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_TRIGGER": "flight",
        "MOEREPLAY_FLIGHT_LEAN_BYTES": "8M",
        "MOEREPLAY_FLIGHT_INLINE_CHECKS": "0",
    },
    # diagnostic: the flight recorder keeping gpt-oss's layer calls one level down, at triton_kernel_fused_experts
    # (as before 2026-12-06): what recording triton_kernel_moe_forward instead changes
    "flight-fused": {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_TRIGGER": "flight",
        "MOEREPLAY_OPS_EXCLUDE": "triton_kernel_moe_forward",
    },
    # a candidate default: the flight recorder with prefill-sized outputs checked and fingerprinted, not kept
    # (MOEREPLAY_FLIGHT_OUTPUT_BYTES: an 8,192-token gpt-oss layer call's 47 MB output read for its check and the
    # fingerprint that proves a re-run bit-exact, not written to the ring). On an H100 (2026-12-07, 40 rounds,
    # before the fingerprint) prefill 1.021× as medians' ratio, 1.017× per round, against the default's 1.020×
    # and 1.021×: within the bench's spread
    "flight-checkonly": {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_TRIGGER": "flight",
        "MOEREPLAY_FLIGHT_OUTPUT_BYTES": "8M",
    },
    # a candidate default: prefill-sized layer calls (inputs of 8M and more) keep their bytes only if their check
    # fails (MOEREPLAY_FLIGHT_LEAN_BYTES): a good one costs a read of its output for the check and a launch that
    # finds nothing to copy, instead of ≈ 4 × 47 MB of ring traffic at 8,192 tokens of gpt-oss. On an H100
    # (2026-12-07, 40 rounds, four servers) prefill 1.018× (90 % interval 1.013–1.022) against 1.020× (1.015–1.028)
    # without it; with the one-loop batch node, 157 prefill rounds: 1.019× (1.016–1.023): no gain beyond the spread
    "flight-lean": {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_TRIGGER": "flight",
        "MOEREPLAY_FLIGHT_LEAN_BYTES": "8M",
    },
    # diagnostic: the previous default, the graph's batch node unrolled (MOEREPLAY_FLIGHT_GRAPH_COMPACT=0: 3.7 MB of
    # sm_90 code whose programs step over 48 far-apart bodies to reach their own). On an H100 (2026-12-07, 40
    # rounds) the one-loop kernel (the default since) took decode batch 1 from 1.046× (the unrolled kernel, runs
    # before) to 1.024× (90 % interval 1.020–1.026); with lean calls as well 1.021×
    "flight-unrolled": {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_TRIGGER": "flight",
        "MOEREPLAY_FLIGHT_GRAPH_BATCH": "1",
        "MOEREPLAY_FLIGHT_GRAPH_COMPACT": "0",
    },
    # diagnostic: the default's staging (entries up to 384 KiB, a gpt-oss decode batch of 32 at
    # triton_kernel_moe_forward: 370 KB) without its batch node — each staged entry's record node of many
    # programs on a side stream beside the layers that follow (the default ring: every graph reuses its 16 MB
    # staging area, and a full decode graph of 24 layers at batch 32 takes 9 MB of it)
    "flight-stage": {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_TRIGGER": "flight",
        "MOEREPLAY_FLIGHT_GRAPH_BATCH": "0",
    },
    # the flight recorder with its eager ring launch's stores marked as written once (st.global.cs, evicted from L2
    # first): whether a prefill's ring writes (~100 MB a layer call at 8,192 tokens) cost the kernels after the
    # launch their L2 hits on the layer's output — an A/B; on an H100 (2026-12-07, 11 graph-mode rounds) prefill
    # 1.019× against flight's 1.012×: no gain, the default stays plain stores
    "flight-stream": {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_TRIGGER": "flight",
        "MOEREPLAY_FLIGHT_STREAM_STORES": "1",
    },
    # diagnostics, not timings: vLLM's own GC debugger (VLLM_GC_DEBUG, attached after each process freezes its
    # start-up heap) logs every collection of serving time with the objects its generation held — whether the
    # full collections seen under the armed recorder (gc2 278–382 ms, 14–15 a run, 2026-12-07) are vLLM's with
    # capture off too (it lists the generation's objects first: each collection reads slower than it is)
    "off-gcdebug": {"VLLM_GC_DEBUG": "1"},
    "flight-gcdebug": {"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_TRIGGER": "flight", "VLLM_GC_DEBUG": "1"},
    # diagnostics of the serving thread's time alone (tools/serve/spin_plugin.py, capture off): every eager
    # triton_kernel_moe_forward call first spins 250 µs holding the GIL (about what the recorder's serving-thread
    # work per prefill call measured served, 2026-12-07), and with "-polls" a thread also holds the GIL 57 µs every
    # 5 ms (the writer's polls at prefill, the same run) — what that much host work costs with nothing recorded.
    # On an H100 (2026-12-08, 117 prefill rounds) spin-250 read 1.009× (90 % interval 1.006–1.017) beside flight's
    # 1.026× (1.023–1.031): serving-thread time is part of prefill's cost, not all of it
    "spin-250": {"MOEREPLAY_BENCH_SPIN_US": "250"},
    "spin-250-polls": {"MOEREPLAY_BENCH_SPIN_US": "250", "MOEREPLAY_BENCH_POLL_US": "57"},
    # diagnostic: capture off again, a second server (an A/A test): its ratio to "off" is the bench's own spread
    # between two servers doing the same thing — a setting's ratio within it says nothing
    "off-again": {},
}
"""Full capture is bounded so the GPU machine's disk (64 GiB, the model on it too) cannot fill: past the bound the
file is closed and the rest is counted, not written — the table's last lines say how much each setting wrote."""


DISABLED = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d)[^\n]*moereplay: capture disabled: ([^\n]*)")
"""The recorder's warning when it stops (``capture/recorder.py``), with vLLM's log timestamp (month-day time)."""


def capture_stopped(log: Path, rounds_began: float) -> str | None:
    """Why and when the server's recorder stopped, relative to the first measured round (``rounds_began``, a
    ``time.time()``), or ``None`` if it never did."""
    try:
        found = DISABLED.search(log.read_text(errors="replace"))
    except OSError:
        return None
    if not found:
        return None
    reason = found.group(2).split(" (vLLM keeps running")[0]
    now = datetime.datetime.now()
    try:
        stamp = datetime.datetime.strptime(f"{now.year}-{found.group(1)}", "%Y-%m-%d %H:%M:%S")
    except ValueError:
        return f"stopped ({reason})"
    when = stamp.timestamp() - rounds_began
    place = "before the measured rounds" if when < 0 else f"{when:.0f} s into the measured rounds"
    return f"stopped {place}: {reason}"


GC_LINE = re.compile(
    r"\((?P<process>[^\s()]+) pid=\d+\)[^\n]*GC took (?P<ms>[\d.]+)ms to complete\. Collected \S+ objects "
    r"\(out of (?P<objects>\d+)\) in GC generation (?P<generation>\d)"
)
"""A collection as vLLM's GC debugger logs it (``VLLM_GC_DEBUG=1``), with the process's log prefix."""


def gc_notes(log: Path) -> list[str]:
    """Per process and generation, the collections ``VLLM_GC_DEBUG`` logged in a server's log: how many, their
    median and longest time, and the most objects the generation held when one began (none without the setting)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    found: dict[tuple[str, int], list[tuple[float, int]]] = {}
    for match in GC_LINE.finditer(text):
        key = (match["process"], int(match["generation"]))
        found.setdefault(key, []).append((float(match["ms"]), int(match["objects"])))
    lines = []
    for (process, generation), items in sorted(found.items()):
        times = [ms for ms, _ in items]
        lines.append(
            f"{process} gc{generation}: {len(items)} collections, median {statistics.median(times):.1f} ms, "
            f"longest {max(times):.1f} ms, at most {max(objects for _, objects in items):,} objects"
        )
    return lines


TWO_MODES = 1.15
"""A setting's rounds of one measurement whose fastest is this many times its slowest are reported as spread over
two modes. Seen on the H100 (2026-12-06): servers sharing the one GPU fall for a few rounds into a mode ~1.3× slower
(decode b1 ~285 against ~370 tokens/s), now one setting, now another — capture off included. A median over such
rounds says which mode most rounds fell in, not what the setting costs; the A/A server's spread is the check."""


def slow_rounds(values: list[float], *, limit: float = TWO_MODES) -> set[int]:
    """The indices of ``values``' rounds in the slow mode: those below the midpoint of the two extremes, when the
    fastest is more than ``limit`` times the slowest (else none)."""
    low, high = (min(values), max(values)) if values else (0.0, 0.0)
    if low <= 0 or high / low <= limit:
        return set()
    middle = (low + high) / 2
    return {i for i, value in enumerate(values) if value < middle}


def spread_notes(results: dict[str, dict[str, list[float]]], *, limit: float = TWO_MODES) -> list[str]:
    """One line per setting and measurement whose rounds spread past ``limit`` (fastest ÷ slowest), naming the
    rounds below the midpoint of the two extremes (the slow mode) and the rounds' range."""
    notes = []
    for name, by in results.items():
        for what, values in by.items():
            slow = [str(i + 1) for i in sorted(slow_rounds(values, limit=limit))]
            if not slow:
                continue
            low, high = min(values), max(values)
            notes.append(
                f"{name} {what}: rounds spread {low:.1f}–{high:.1f} tok/s ({high / low:.2f}×); round(s) "
                f"{', '.join(slow)} of {len(values)} in the slow mode — its median is not a cost"
            )
    return notes


def rotation(names: list[str], round_index: int) -> list[str]:
    """The order the servers are measured in, round ``round_index`` (each measurement in turn, every server in this
    order): rotated by one a round, so a drift of the machine touches every setting alike."""
    shift = round_index % len(names) if names else 0
    return names[shift:] + names[:shift]


def after_own(names: list[str], round_index: int) -> str | None:
    """The server whose first measurement of round ``round_index`` came right after its own last measurement of
    the round before (:func:`rotation`: with two servers, from the second round on, the two servers by turns;
    with three or more, never), or None."""
    if round_index < 1 or not names:
        return None
    first = rotation(names, round_index)[0]
    return first if first == rotation(names, round_index - 1)[-1] else None


def follow_notes(results: dict[str, dict[str, list[float]]], base: str = "off") -> list[str]:
    """With two servers: the first measurement (decode batch 1) of each, split by whether it came right after its
    own server's last one (:func:`after_own`: a server's prefill, then at once its decode) — an aftermath of the
    server's own work shows there. Every round from the second has one server in that position, by turns, so the
    setting's other rounds are the ones where capture off followed itself: the line gives each server's median
    apart and the ratio of the two servers' medians where neither followed itself."""
    names = list(results)
    if (
        base not in results
        or len(names) != 2
        or any(what in by for by in results.values() for what in AFTERMATH)
    ):
        return []  # (--aftermath ends every round with each server's own prefill: no rounds to set apart)
    notes = []
    for name, what, pairs in _round_pairs(results, base):
        if what != next(iter(results[name]), None):
            continue
        shown = [(i, b, v) for i, (b, v) in enumerate(pairs) if b > 0 and v > 0]
        medians: dict[tuple[str, bool], float] = {}
        counts: dict[tuple[str, bool], int] = {}
        for server, column in ((base, 1), (name, 2)):
            for own in (True, False):
                values = [row[column] for row in shown if (after_own(names, row[0]) == server) == own]
                if len(values) < 2:
                    break
                medians[server, own] = statistics.median(values)
                counts[server, own] = len(values)
        if len(medians) < 4:
            continue
        notes.append(
            f"{name} {what}: {medians[name, True]:.1f} tok/s right after its own server's last measurement "
            f"({counts[name, True]} rounds), {medians[name, False]:.1f} otherwise; {base} "
            f"{medians[base, True]:.1f} and {medians[base, False]:.1f}; where neither followed itself "
            f"{medians[base, False] / medians[name, False]:.3f}× ({base} {medians[base, False]:.1f} ÷ "
            f"{medians[name, False]:.1f})"
        )
    return notes


def _round_pairs(
    results: dict[str, dict[str, list[float]]], base: str
) -> Iterator[tuple[str, str, list[tuple[float, float]]]]:
    """Per setting but ``base`` and measurement, each round's (``base``'s tokens/s, the setting's), in round order
    (as many as both measured)."""
    if base not in results:
        return
    for name, by in results.items():
        if name == base:
            continue
        for what, values in by.items():
            yield name, what, list(zip(results[base].get(what, []), values, strict=False))


def paired_ratios(
    results: dict[str, dict[str, list[float]]], base: str = "off"
) -> dict[str, dict[str, list[float]]]:
    """Per setting and measurement, each round's own ratio to ``base`` (``base``'s tokens/s ÷ the setting's, both
    measured in that round, minutes apart): a drift or a slow mode that lasts a round or two touches one pair, not
    a whole column, so the median of these ratios moves less than the ratio of the columns' medians."""
    paired: dict[str, dict[str, list[float]]] = {}
    for name, what, pairs in _round_pairs(results, base):
        paired.setdefault(name, {})[what] = [b / v for b, v in pairs if v > 0]
    return paired


Steady = dict[str, dict[str, tuple[list[float], int]]]
"""Per setting and measurement: the per-round ratios of the steady rounds and how many rounds were left out."""


def steady_ratios(
    results: dict[str, dict[str, list[float]]], base: str = "off", *, limit: float = TWO_MODES
) -> Steady:
    """:func:`paired_ratios` over the rounds where neither the setting nor ``base`` was in the slow mode
    (:func:`slow_rounds`, over the rounds both measured with tokens to show), and how many rounds the slow mode
    left out. The slow mode strikes capture off too, a few rounds a run: a median of per-round ratios that keeps a
    round where one side fell into it and the other did not keeps a ratio of two modes, not a cost (seen at decode
    batch 32, 2026-12-07: 1.081 over 11 rounds, 1.072 over the 8 steady ones, 0.617–1.657 in all)."""
    steady: Steady = {}
    for name, what, pairs in _round_pairs(results, base):
        shown = [(b, v) for b, v in pairs if b > 0 and v > 0]
        slow = slow_rounds([b for b, _ in shown], limit=limit)
        slow |= slow_rounds([v for _, v in shown], limit=limit)
        kept = [b / v for i, (b, v) in enumerate(shown) if i not in slow]
        steady.setdefault(name, {})[what] = (kept, len(slow))
    return steady


def _off_rounds(
    results: dict[str, dict[str, list[float]]],
    bases: dict[str, dict[str, list[float]]] | None,
    name: str,
    what: str,
) -> list[float]:
    """The capture-off rounds ``name``'s ``what`` is compared with: those of the runs it was in (``bases``, from
    :func:`pooled`), by default all of off's."""
    return (bases or {}).get(name, results.get("off", {})).get(what) or []


def _median_ratio(base: list[float], values: list[float]) -> float | None:
    """Capture off's median ÷ the setting's (slowdown ×), or None where either has no rounds."""
    if not base or not values or statistics.median(values) <= 0:
        return None
    return statistics.median(base) / statistics.median(values)


def table(
    results: dict[str, dict[str, list[float]]],
    paired: dict[str, dict[str, list[float]]],
    stopped: dict[str, str | None],
    bases: dict[str, dict[str, list[float]]] | None = None,
    notes: tuple[str, ...] | list[str] = (),
    steady: Steady | None = None,
) -> list[str]:
    """The table's lines: per setting and measurement the median of its rounds and that median's ratio to capture
    off's (``bases``: per setting, the capture-off rounds to compare it with — those of the runs it was in; by
    default all of off's); under it, per setting, the median of the per-round ratios (:func:`paired_ratios`) and
    their range, and the same over the steady rounds where ``steady`` (:func:`steady_ratios`) left a round out;
    then the ``notes`` (:func:`spread_notes`, :func:`follow_notes`) and a line per recorder that stopped."""
    measurements = list(next(iter(results.values())))
    lines = [f"{'setting':<14} " + " ".join(f"{m + ' tok/s':>18} {'×':>6}" for m in measurements)]
    for name, by in results.items():
        cells = []
        for what in measurements:
            values = by.get(what) or []
            value = statistics.median(values) if values else 0.0
            ratio = _median_ratio(_off_rounds(results, bases, name, what), values)
            cells.append(f"{value:18.1f} " + (f"{ratio:6.3f}" if ratio is not None else f"{'':>6}"))
        lines.append(f"{name + ('*' if stopped.get(name) else ''):<14} " + " ".join(cells))
    for name, by in paired.items():
        parts = [
            f"{what} {statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f})"
            for what, ratios in by.items()
            if ratios
        ]
        if parts:
            rounds = max(len(ratios) for ratios in by.values())
            lines.append(
                f"= {name}: per-round ratios to off, median (range) of {rounds}: " + ", ".join(parts)
            )
    for name, steady_by in (steady or {}).items():
        parts = [
            f"{what} {statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f}) of {len(ratios)}"
            if ratios
            else f"{what} none ({left_out} left out)"
            for what, (ratios, left_out) in steady_by.items()
            if left_out
        ]
        if parts:
            lines.append(
                f"= {name}: the same over the steady rounds (neither in the slow mode): " + ", ".join(parts)
            )
    lines += [f"~ {note}" for note in notes]
    lines += [
        f"* {name}: the recorder {why} — what follows it measured capture off, not {name}"
        for name, why in stopped.items()
        if why
    ]
    return lines


TARGETS: dict[str, dict[str, float]] = {
    "graph": {"decode_b1": 1.05, "decode_b32": 1.05, "prefill": 1.02},
    "eager": {"decode_b1": 1.15, "decode_b32": 1.15, "prefill": 1.02},
}
"""Issue 14's targets for the flight recorder armed, per vLLM mode and measurement (slowdown ×: off ÷ armed)."""

JUDGED = (
    "flight",
    "flight-stream",
    "flight-checkonly",
    "flight-lean",
    "flight-beside-driver",
    "flight-noinline",
    "flight-driver-noinline",
    "flight-lean-noinline",
)
"""The settings held to :data:`TARGETS`: the default recorder and the candidates for its default (the others are
diagnostics that take a piece away or add timers)."""

DEFAULT = "flight"
"""The default recorder's setting, the one a candidate (the rest of :data:`JUDGED`) must beat to replace it."""


def median_interval(
    values: list[float], level: float = 0.9, resamples: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """A bootstrap interval of the median of ``values``: the ``level`` central range of the medians of
    ``resamples`` resamples drawn with replacement (seeded: the same rounds give the same interval)."""
    import numpy as np

    data = np.asarray(values, dtype=np.float64)
    draws = np.random.default_rng(seed).integers(0, len(data), size=(resamples, len(data)))
    medians = np.median(data[draws], axis=1)
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(medians, [tail, 100 - tail])
    return float(low), float(high)


def intervals(
    paired: dict[str, dict[str, list[float]]], mode: str, steady: Steady | None = None
) -> list[str]:
    """A line per judged setting (:data:`JUDGED`): for each measurement with a target, the 90 % bootstrap interval
    (:func:`median_interval`) of the median of its per-round ratios — of the steady rounds' where the slow mode
    left rounds out — and where the target stands: above the interval (the figure is under it beyond the rounds'
    scatter), inside it (this run cannot tell) or below it."""
    targets = TARGETS.get(mode) or {}
    lines = []
    for name in (name for name in JUDGED if name in paired):
        parts = []
        for what, target in targets.items():
            ratios = paired[name].get(what) or []
            kept, left_out = (steady or {}).get(name, {}).get(what, ([], 0))
            if left_out and kept:
                ratios, label = kept, "steady "
            else:
                label = ""
            if len(ratios) < 3:
                continue
            low, high = median_interval(ratios)
            where = (
                f"under {target:.2f}"
                if high <= target
                else f"over {target:.2f}"
                if low > target
                else f"{target:.2f} inside it: this run cannot tell"
            )
            parts.append(f"{what} {label}{low:.3f}–{high:.3f} of {len(ratios)} ({where})")
        if parts:
            lines.append(f"> {name}: 90 % interval of the per-round median: " + "; ".join(parts))
    return lines


AGAINST_ROUNDS = 8
"""Rounds a candidate needs beside the default before :func:`against_default` calls it cheaper or dearer: with
fewer, the 90 % interval of a median of a handful of ratios leaves 1.000 out for no difference at all about one
run in four (three rounds: whenever all three fall on one side)."""


def against_default(
    results: dict[str, dict[str, list[float]]],
    mode: str,
    stopped: dict[str, str | None] | None = None,
    against: Steady | None = None,
) -> list[str]:
    """A line per candidate (:data:`JUDGED` but :data:`DEFAULT`) run beside the default: for each measurement with
    a target, the median and the 90 % bootstrap interval (:func:`median_interval`) of the per-round ratio of the
    default's tokens/s to the candidate's — under 1.000 the candidate costs less — over the rounds where neither
    was in the slow mode (:func:`steady_ratios`), and the verdict the default is changed by: cheaper (or dearer)
    beyond the rounds' scatter when 1.000 lies above (below) the whole interval, else no difference this run can
    tell — and no verdict under :data:`AGAINST_ROUNDS` rounds. A recorder that stopped (``stopped``, as for
    :func:`verdicts`) serves as capture off from then on: it is not compared (a line says so), and if it is the
    default's, no line at all. ``against``: those steady ratios taken already (pooled runs: within each run,
    :attr:`Pool.against`) instead of from ``results``' rounds."""
    targets = TARGETS.get(mode) or {}
    stopped = stopped or {}
    if DEFAULT not in results or stopped.get(DEFAULT):
        return []
    steady = steady_ratios(results, DEFAULT) if against is None else against
    lines = []
    for name in (name for name in JUDGED if name != DEFAULT and name in steady):
        if stopped.get(name):
            lines.append(f"> {name} against {DEFAULT}: not compared (its recorder stopped)")
            continue
        parts = []
        for what in targets:
            ratios, left_out = steady[name].get(what, ([], 0))
            if len(ratios) < 3:
                continue
            low, high = median_interval(ratios)
            word = (
                f"too few rounds to tell (under {AGAINST_ROUNDS})"
                if len(ratios) < AGAINST_ROUNDS
                else "cheaper beyond the spread"
                if high < 1.0
                else "dearer beyond the spread"
                if low > 1.0
                else "no difference this run can tell"
            )
            kept = f"{len(ratios)}" + (f" ({left_out} slow left out)" if left_out else "")
            parts.append(f"{what} {statistics.median(ratios):.3f} ({low:.3f}–{high:.3f}) of {kept}: {word}")
        if parts:
            lines.append(
                f"> {name} against {DEFAULT} ({DEFAULT}'s tokens/s ÷ its own, per round): " + "; ".join(parts)
            )
    return lines


def verdicts(
    results: dict[str, dict[str, list[float]]],
    paired: dict[str, dict[str, list[float]]],
    mode: str,
    stopped: dict[str, str | None],
    bases: dict[str, dict[str, list[float]]] | None = None,
    steady: Steady | None = None,
) -> list[str]:
    """A line per judged setting (:data:`JUDGED`) against ``mode``'s :data:`TARGETS`: per measurement the ratio of
    the medians, the median of the per-round ratios and — where ``steady`` (:func:`steady_ratios`) left rounds in
    the slow mode out — the median of the steady rounds' ratios; and whether all meet the target, all miss it by
    more than the A/A spread (``off-again``'s largest distance from 1.000 of its figures; none without that
    server) or it is at the line."""
    targets = TARGETS.get(mode)
    if not targets or "off" not in results:
        return []

    def figures(name: str, what: str) -> list[tuple[str, float]]:
        ratio = _median_ratio(_off_rounds(results, bases, name, what), results[name].get(what) or [])
        rounds = paired.get(name, {}).get(what) or []
        kept, left_out = (steady or {}).get(name, {}).get(what, ([], 0))
        found = [
            ("", ratio),
            ("", statistics.median(rounds) if rounds else None),
            (f"steady ({len(kept)} rounds) ", statistics.median(kept) if kept and left_out else None),
        ]
        return [(label, x) for label, x in found if x is not None]

    lines = []
    for name in (name for name in JUDGED if name in results):
        if stopped.get(name):
            lines.append(f"> {name}: not judged (its recorder stopped)")
            continue
        parts = []
        with_steady = False
        for what, target in targets.items():
            found = figures(name, what)
            if not found:
                continue
            with_steady |= any(label for label, _ in found)  # (only the steady figure has a label)
            spread = (
                max((abs(x - 1.0) for _, x in figures("off-again", what)), default=0.0)
                if "off-again" in results
                else 0.0
            )
            values = [x for _, x in found]
            if max(values) <= target:
                word = "meets"
            elif min(values) > target + spread:
                word = "misses"
            else:
                word = "at the line" + (f" (A/A ±{spread:.3f})" if spread else "")
            shown = " / ".join(f"{label}{x:.3f}" for label, x in found)
            parts.append(f"{what} ≤ {target:.2f}: {shown} {word}")
        if parts:
            lines.append(
                f"> {name} against the {mode} targets (medians' ratio / per-round median"
                + (" / over the steady rounds" if with_steady else "")
                + "): "
                + "; ".join(parts)
            )
    return lines


class PoolError(ValueError):
    """``--pool`` files that cannot be tabled together: which file, or which files, and why."""


@dataclass
class Pool:
    """Several runs' ``--json`` files as one table's material (:func:`pooled`)."""

    mode: str
    results: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # every run's rounds, run by run
    # per-round ratios, within each run
    paired: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # off's rounds of the runs a setting ran in
    bases: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    stopped: dict[str, str | None] = field(default_factory=dict)  # a recorder that stopped, in which run
    notes: list[str] = field(default_factory=list)  # each run's own spread and follow-on notes, the run named
    steady: Steady = field(default_factory=dict)  # steady_ratios, within each run
    # steady_ratios against the default recorder (DEFAULT), within each run that had it
    against: Steady = field(default_factory=dict)

    @property
    def rounds(self) -> int:
        return max((len(values) for by in self.results.values() for values in by.values()), default=0)


def _numbers(values: object) -> bool:
    return isinstance(values, list) and all(
        type(x) in (int, float) and math.isfinite(x) and x >= 0 for x in values
    )


def pooled(paths: list[Path]) -> Pool:
    """Several runs' ``--json`` files as one: every setting's rounds, each compared with the capture-off rounds of
    the runs it was in, and the per-round ratios taken within each run (a round pairs measurements of one run's
    servers). Every file must be a run of one mode with a capture-off server."""
    pool: Pool | None = None
    modes = set()
    for number, path in enumerate(paths, 1):
        try:
            loaded = json.loads(path.read_text())
            run = loaded["results"]
            mode = str(loaded.get("mode", "?"))
            stopped = loaded.get("stopped") or {}
            if not isinstance(run, dict) or not all(
                isinstance(by, dict) and all(_numbers(v) for v in by.values()) for by in run.values()
            ):
                raise PoolError(f"{path}: 'results' is not settings of measurements of finite numbers")
            if not isinstance(stopped, dict):
                raise PoolError(f"{path}: 'stopped' is not settings of reasons")
            timelines = loaded.get("timelines") or {}
            if not _timelines(timelines):
                raise PoolError(f"{path}: 'timelines' is not settings of measurements of step timelines")
        except (
            OSError,
            UnicodeDecodeError,
            json.JSONDecodeError,
            KeyError,
            TypeError,
            AttributeError,
            RecursionError,
            OverflowError,
        ) as error:
            raise PoolError(
                f"{path}: not a serve_bench --json file ({type(error).__name__}: {error})"
            ) from None
        if "off" not in run:
            raise PoolError(f"{path}: the run has no capture-off server to compare the others with")
        modes.add(mode)
        pool = pool or Pool(mode)
        for name, by in run.items():
            for what, values in by.items():
                pool.results.setdefault(name, {}).setdefault(what, []).extend(float(x) for x in values)
                pool.bases.setdefault(name, {}).setdefault(what, []).extend(
                    float(x) for x in run["off"].get(what, [])
                )
            why = stopped.get(name)
            if why and not pool.stopped.get(name):
                pool.stopped[name] = f"{why} (run {number}, {path.name})"
        for name, by in paired_ratios(run).items():
            for what, ratios in by.items():
                pool.paired.setdefault(name, {}).setdefault(what, []).extend(ratios)
        for pooled_steady, base in ((pool.steady, "off"), (pool.against, DEFAULT)):
            for name, steady_by in steady_ratios(run, base).items():
                for what, (kept, left_out) in steady_by.items():
                    pooled_kept, pooled_left_out = pooled_steady.setdefault(name, {}).get(what, ([], 0))
                    pooled_steady[name][what] = (pooled_kept + kept, pooled_left_out + left_out)
        notes = run_notes(run, timelines)
        pool.notes += [f"run {number} ({path.name}): {note}" for note in notes]
    if len(modes) > 1:
        raise PoolError(f"the files mix modes {sorted(modes)}: pool runs of one mode")
    if pool is None:
        raise PoolError("no file to pool")
    pool.results = {"off": pool.results.pop("off"), **pool.results}  # capture off first, as in a run's table
    return pool


MEASUREMENTS = ("decode_b1", "decode_b32", "prefill")
"""What a round measures (``--measure`` picks some): decode batches of 1 and 32 streamed, and a prefill batch."""

AFTERMATH = ("b1_before", "b1_after")
"""``--aftermath``'s measurements: decode batch 1 streamed, right before and right after the server's own prefill."""

SLOW_STEP = 1.5
"""A step slower than this many times the request's median step counts toward :func:`step_times`' ``slow_ms``."""

STEP_FIGURES = (
    ("total", "request"),
    ("first", "first token"),
    ("median", "median step"),
    ("slow_ms", f"beyond the median in steps over {SLOW_STEP}×"),
    ("slowest", "slowest step"),
)
""":func:`step_times`' figures, each with what :func:`aftermath_notes` calls it."""


def step_times(times: tuple[float, ...] | list[float]) -> dict[str, float]:
    """One streamed request's timeline in ms (:attr:`harness.Completion.times`): ``first`` (the request to its first
    token: its prefill, and whatever the server still did before it), the steps' ``median``, ``slow_ms`` (the time
    the steps over :data:`SLOW_STEP` × the median took beyond it) and the ``slowest`` step; empty for no token."""
    if not times:
        return {}
    gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(times)]
    median = statistics.median(gaps) if gaps else 0.0
    return {
        "first": times[0] * 1e3,
        "median": median,
        "slow_ms": sum(g - median for g in gaps if g > SLOW_STEP * median),
        "slowest": max(gaps, default=0.0),
        "total": times[-1] * 1e3,
    }


def aftermath_notes(timelines: dict[str, dict[str, list[dict[str, float]]]]) -> list[str]:
    """Per setting, ``--aftermath``'s streamed decode batch 1 right before and right after the server's own
    prefill, the medians over the rounds of :func:`step_times`' figures: where a prefill's aftermath is spent — in
    the first token (work the server did before it took the request) or in slow steps, and how much."""
    notes = []
    for name, by in timelines.items():
        before, after = ([row for row in by.get(what, []) if row] for what in AFTERMATH)
        if not before or not after:
            continue

        def med(rows: list[dict[str, float]], key: str) -> float:
            return statistics.median(row[key] for row in rows)

        parts = [f"{label} {med(before, key):.1f} / {med(after, key):.1f} ms" for key, label in STEP_FIGURES]
        rounds = f"{len(after)}" if len(before) == len(after) else f"{len(before)} / {len(after)}"
        notes.append(
            f"{name} decode b1 streamed, before / right after its own prefill (medians of {rounds} rounds): "
            + ", ".join(parts)
        )
    return notes


def run_notes(
    results: dict[str, dict[str, list[float]]], timelines: dict[str, dict[str, list[dict[str, float]]]]
) -> list[str]:
    """One run's notes under its table (and each run's in ``--pool``): the spread, the follow-on split and the
    aftermath's timelines."""
    return spread_notes(results) + follow_notes(results) + aftermath_notes(timelines)


def _timelines(value: object) -> bool:
    """Whether a ``--json`` file's ``timelines`` is settings of measurements of :func:`step_times` rows."""
    return isinstance(value, dict) and all(
        isinstance(by, dict)
        and all(
            isinstance(rows, list)
            and all(
                isinstance(row, dict)
                and _numbers(list(row.values()))
                and (not row or set(row) >= {key for key, _ in STEP_FIGURES})
                for row in rows
            )
            for rows in by.values()
        )
        for by in value.values()
    )


def measure(
    server: harness.Server,
    words: list[str],
    what: str,
    options: argparse.Namespace,
    timeline: list[dict[str, float]] | None = None,
) -> float:
    if what == "decode_b1":
        batch = server.complete_many(serve_gpu.prompts(words, [8]), options.decode_tokens)
        return batch.completion_tokens / batch.seconds
    if what in AFTERMATH:  # decode batch 1 streamed: when each step's token came, for the timeline
        batch = server.complete_many(
            serve_gpu.prompts(words, [8], offset=3), options.decode_tokens, stream=True
        )
        if timeline is not None:
            timeline.append(step_times(batch.completions[0].times))
        return batch.completion_tokens / batch.seconds
    if what == "decode_b32":
        batch = server.complete_many(serve_gpu.prompts(words, [8] * 32, offset=5), options.decode_tokens)
        return batch.completion_tokens / batch.seconds
    batch = server.complete_many(
        serve_gpu.prompts(words, [options.prefill_length] * options.prefill_requests, offset=9), 1
    )
    return batch.prompt_tokens / batch.seconds


def server_environment(name: str, out: Path) -> dict[str, str]:
    """The environment of setting ``name``'s server, its files under ``out``: a harness site declaring moereplay's
    plugin (and :mod:`spin_plugin` where the setting names its variables, its folder then on ``PYTHONPATH``), vLLM's
    serving variables, the setting's own and ``MOEREPLAY_DIR``."""
    site = harness.make_site(out)
    setting = SETTINGS[name]
    extra = [str(spin_plugin.declare(site))] if any(key in spin_plugin.VARIABLES for key in setting) else []
    env = harness.base_environment(site, extra)
    env.update(serve_gpu.SERVE_ENV)
    env.update({**setting, "MOEREPLAY_DIR": str(out / "captures")})
    return env


class ServerFailed(RuntimeError):
    """A setting's server failed a measurement's requests: which, and the lines of its log that say why."""


def measure_or_say(
    name: str,
    server: harness.Server,
    words: list[str],
    what: str,
    options: argparse.Namespace,
    timeline: list[dict[str, float]] | None = None,
) -> float:
    """:func:`measure`, naming the setting and quoting its server log's error lines when requests fail (a
    server that ran out of GPU memory answers HTTP 500 to every request, which says nothing by itself)."""
    try:
        return measure(server, words, what, options, timeline)
    except RuntimeError as error:
        log = options.out / name / "server.log"
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        said = [line for line in lines if re.search(r"Error|out of memory|Traceback|EngineDeadError", line)]
        quoted = "\n  ".join(line[:300] for line in said[-8:]) or "(no error line in it)"
        raise ServerFailed(f"setting {name!r} failed {what}: {error}; {log}:\n  {quoted}") from error


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="the served model's directory (every run but --pool's)")
    parser.add_argument(
        "--pool",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="serve nothing: print one table over the rounds of these runs' --json files (one mode), each run's "
        "rounds paired within it",
    )
    parser.add_argument("--mode", choices=("eager", "graph"), default="graph")
    parser.add_argument("--out", type=Path, default=Path("/tmp/serve-bench"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settings", default="off,flight,full")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prefill-length", type=int, default=900)
    parser.add_argument(
        "--prefill-requests",
        type=int,
        default=64,
        help="prefill batch: requests of --prefill-length prompt tokens (64 · 900: seven scheduler steps of 8,192 "
        "tokens, ~0.9 s on the H200. One step of 8 requests scattered up to 1.5× between rounds of the same "
        "server; at 32 · 900, 0.45 s, capture off's own rounds spread 63–67 K tokens/s)",
    )
    parser.add_argument(
        "--aftermath",
        action="store_true",
        help="each round also measures every server's decode batch 1 streamed right before and right after a "
        "prefill of its own (b1_before, b1_after; that prefill not counted), with when each step's token came: "
        "where a prefill's aftermath at decode goes (first token or slow steps)",
    )
    parser.add_argument(
        "--measure",
        default=",".join(MEASUREMENTS),
        help="what each round measures, comma-separated (default: all of decode_b1, decode_b32, prefill): one alone "
        "fits more rounds in a device call — a round of all three took ≈ 2.8 s a server on an H100 (2026-12-07), its "
        "prefill ≈ 0.9 s: prefill alone, more than twice the rounds, for an interval narrow enough to judge 1.02×",
    )
    parser.add_argument("--serve-arg", action="append", default=[])
    parser.add_argument("--kv-cache-bytes", type=int, default=4 << 30, help="KV cache of each server")
    parser.add_argument("--timeout", type=float, default=540.0)
    parser.add_argument("--json", type=Path, default=None, help="write every measurement here")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="start no further round once another as long as the last would end past this many seconds from the "
        "start (0: no bound); the table then covers the rounds done",
    )
    options = parser.parse_args()
    if options.pool:
        try:
            pool = pooled(options.pool)
        except PoolError as error:
            print(f"serve_bench: {error}", file=sys.stderr)
            return 2
        if not pool.rounds:
            print("serve_bench: the files hold no rounds", file=sys.stderr)
            return 2
        print(
            f"serve_bench: {len(options.pool)} runs pooled, {pool.mode}, median of up to {pool.rounds} rounds"
        )
        for line in table(pool.results, pool.paired, pool.stopped, pool.bases, pool.notes, pool.steady):
            print(line)
        for line in verdicts(pool.results, pool.paired, pool.mode, pool.stopped, pool.bases, pool.steady):
            print(line)
        for line in intervals(pool.paired, pool.mode, pool.steady):
            print(line)
        for line in against_default(pool.results, pool.mode, pool.stopped, pool.against):
            print(line)
        return 0
    if options.model is None:
        parser.error("--model is required (or --pool)")
    names = [name.strip() for name in options.settings.split(",") if name.strip()]
    unknown = [name for name in names if name not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; known: {list(SETTINGS)}")
    if len(set(names)) != len(names):  # one server per setting: results are kept by name
        parser.error(f"a setting named twice in {names}")
    measurements = tuple(what.strip() for what in options.measure.split(",") if what.strip())
    if not measurements or any(what not in MEASUREMENTS for what in measurements):
        parser.error(f"--measure {options.measure!r}: name some of {', '.join(MEASUREMENTS)}")
    words = serve_gpu.vocabulary_words(options.model)
    memory = max(0.08, min(0.28, 0.85 / len(names)))
    servers: dict[str, harness.Server] = {}
    started = time.monotonic()
    after: tuple[str, ...] = AFTERMATH if options.aftermath else ()
    results: dict[str, dict[str, list[float]]] = {n: {m: [] for m in measurements + after} for n in names}
    timelines: dict[str, dict[str, list[dict[str, float]]]] = {n: {m: [] for m in after} for n in names}
    rounds_done, last_round = 0, 0.0
    rounds_began = time.time()
    try:
        for name in names:
            out = options.out / name
            env = server_environment(name, out)
            port = harness.free_port()
            command = serve_gpu.serve_command(
                options.model, port, options.mode, options.serve_arg, options.prefill_length + 200
            )
            command[command.index("--gpu-memory-utilization") + 1] = f"{memory:.2f}"
            # a fixed KV cache for every setting: servers started together would otherwise size theirs from
            # a memory profile that sees the others' allocations (seen on the H200: one server estimated 85 GiB
            # of CUDA-graph memory and refused to start, the other two got 1.8 and 14 GiB of KV cache)
            command += ["--kv-cache-memory-bytes", str(options.kv_cache_bytes), "--no-enable-prefix-caching"]
            servers[name] = harness.start(command, str(options.model), port, env, out / "server.log")
            time.sleep(5.0)  # let each take its memory before the next measures what is free
        for name, server in servers.items():
            print(f"serve_bench: {name} ready in {server.wait_ready(options.timeout):.1f} s", flush=True)
            for what in measurements + after[:1]:  # warm-up: every batch shape once (compiles, allocations)
                measure_or_say(name, server, words, what, options)
        rounds_began = time.time()
        for round_index in range(options.rounds):
            began = time.monotonic()
            if options.budget_s and rounds_done and began - started + last_round > options.budget_s:
                print(f"serve_bench: stopping after {rounds_done} rounds (--budget-s {options.budget_s:.0f})")
                break
            order = rotation(names, round_index)
            for what in measurements:
                for name in order:
                    results[name][what].append(measure_or_say(name, servers[name], words, what, options))
            for name in order if after else ():  # each server: b1, its own prefill, at once b1 again
                server, lines = servers[name], timelines[name]
                results[name][after[0]].append(
                    measure_or_say(name, server, words, after[0], options, lines[after[0]])
                )
                measure_or_say(name, server, words, "prefill", options)
                results[name][after[1]].append(
                    measure_or_say(name, server, words, after[1], options, lines[after[1]])
                )
            rounds_done, last_round = round_index + 1, time.monotonic() - began
            values = "; ".join(
                f"{name} " + " ".join(f"{results[name][what][-1]:.1f}" for what in measurements + after)
                for name in names
            )
            print(
                f"serve_bench: round {rounds_done}/{options.rounds} done in {last_round:.0f} s: {values}",
                flush=True,
            )
    finally:
        for server in servers.values():
            server.stop()
    if not rounds_done:
        print("serve_bench: no round finished")
        return 1
    medians = {n: {m: statistics.median(v) for m, v in by.items()} for n, by in results.items()}
    print(f"\nserve_bench: {options.model.name}, {options.mode}, median of {rounds_done} interleaved rounds")
    stopped = {name: capture_stopped(options.out / name / "server.log", rounds_began) for name in names}
    paired = paired_ratios(results)
    steady = steady_ratios(results)
    for line in table(
        results,
        paired,
        stopped,
        notes=run_notes(results, timelines),
        steady=steady,
    ):
        print(line)
    for line in verdicts(results, paired, options.mode, stopped, steady=steady):
        print(line)
    for line in intervals(paired, options.mode, steady):
        print(line)
    for line in against_default(results, options.mode, stopped):
        print(line)
    for name in names:
        for line in gc_notes(options.out / name / "server.log"):
            print(f"{name:<14} {line}")
        for path in sorted((options.out / name / "captures").glob("**/*.zst")):
            try:
                item = serve_gpu.summarise_file(path, {})
            except Exception as error:  # a report line, not a reason to lose the table
                print(f"{name:<14} {path.name}: unreadable ({error})")
                continue
            if item.calls or item.counters:
                counters = {k: v for k, v in item.counters.items() if v}
                print(
                    f"{name:<14} {path.name}: {item.calls} calls in file, {path.stat().st_size / 2**20:.0f} MiB, "
                    f"counters {counters}"
                )
                cost = recorder_cost(counters)
                if cost:
                    print(f"{name:<14} {path.name}: {cost}")
                timers = recorder_timers(counters)
                if timers:
                    print(f"{name:<14} {path.name}: {timers}")
    if options.json:
        options.json.write_text(
            json.dumps(
                {
                    "results": results,
                    "medians": medians,
                    "mode": options.mode,
                    "stopped": stopped,
                    "spread": spread_notes(results),
                    "paired": paired,
                    "steady": steady,
                    "timelines": timelines,
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
