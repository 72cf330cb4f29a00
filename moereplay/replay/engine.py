"""``replay()``: rerun one captured call as-is and with mutations, judge every variant, and explain failures.

One call of :class:`~moereplay.replay.session.ReplaySession` from start to end:

1. load the call (capture file + index, or arguments given in memory) and decode its arguments;
2. parse the mutations into variants (one per CLI option; sweeps expand) — malformed ones raise
   :class:`~moereplay.errors.InvalidMutationError` before anything runs;
3. judge the baseline and each variant (see :mod:`moereplay.replay.session`), optionally the mutations the
   findings suggest, and the baseline under compute-sanitizer;
4. follow the evidence (unless told not to): a contract violation that predicts reads past a tensor's end runs
   the guard fills that test it (``fill 0xff``, ``fill 0x00``);
5. report: one verdict row per variant, their findings, and the cross-variant ones — why the replay is not
   bit-exact with the recording (localised, its candidate causes tested: :mod:`moereplay.replay.fidelity`), an
   output that changes with the guard fill (an out-of-bounds read, localised to a tensor and a byte range; the
   baseline is then ``memory-dependent``, never ``ok``), the variants that fix a failing baseline and whether they
   confirm the diagnosis.

Every report also carries the *recorded* row: the captured output judged against the reference (what production
saw); the headline verdict is the worse of recorded and replayed. With the ``reference`` backend no kernel runs: the
recorded row is the offline verdict, the baseline and the variants only a kernel can answer (fills, casts, launch
configurations) are ``needs-kernel``, and any other variant asks "does the captured output match the semantics of
this changed call?".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from moereplay.errors import ReplayError
from moereplay.replay.memory import DEFAULT_GUARD_BYTES
from moereplay.replay.mutations import FillPattern, Variant, parse_variants
from moereplay.replay.results import ReplayReport
from moereplay.replay.session import ReplaySession
from moereplay.replay.source import LoadedCall

__all__ = ["parse_variants", "replay"]


def replay(
    source: str | Path | LoadedCall | Any,
    args: Mapping[str, Any] | None = None,
    *,
    call: int | None = None,
    mutations: Sequence[str | Variant] = (),
    fills: Sequence[str | FillPattern] = (),
    backend: str = "auto",
    repeat: int = 1,
    sanitize: bool = False,
    device: str | torch.device | None = None,
    isolate: bool | None = None,
    timeout_s: float = 600.0,
    follow_suggestions: bool = False,
    follow_evidence: bool = True,
    explain_fidelity: bool = True,
    localise_reads: bool = True,
    output: torch.Tensor | None = None,
    guard_bytes: int = DEFAULT_GUARD_BYTES,
    reuse_worker: bool = True,
    keep_tensors: bool = False,
) -> ReplayReport:
    """Replay one call (baseline + every variant) and return the typed report.

    ``source``: a capture path (with ``call`` = index; a file with one replayable call needs none), a
    :class:`LoadedCall`, or a ``CallRecord`` with ``args`` (and optionally its captured ``output``).
    ``mutations``: texts like ``"flip mul_topk_weights"``, ``"set thread_k=128+thread_n=64"``,
    ``"cast topk_weights=float32"``, ``"sweep moe_block_size=8,16,32"``, ``"fill 0xff"``, or :class:`Variant`s.
    ``backend``: ``auto`` (``$MOEREPLAY_PACK``, else the installed vLLM, else the reference) | ``reference`` |
    ``vllm`` | ``pack:DIR`` | ``python:MODULE``. ``isolate``: run kernels in a worker process (default: yes for
    kernel backends); ``reuse_worker`` keeps that worker for later calls in this process. ``follow_suggestions``:
    also run the mutations the findings suggest. ``follow_evidence``: run the guard fills a contract violation
    predicts an over-read for (:meth:`~moereplay.replay.session.ReplaySession.follow_evidence`).
    ``explain_fidelity``: localise and explain a replay that is not bit-exact with the recording.
    ``keep_tensors``: the report keeps every variant's output and reference (``report.tensors``). The rest as
    :class:`~moereplay.replay.session.ReplaySession` says.
    """
    if isinstance(source, (str, Path)) and call is not None and (mutations or fills):
        check_mutations(source, [call], mutations, fills)  # a typo fails before any tensor is rebuilt
    with ReplaySession(
        source,
        args,
        call=call,
        backend=backend,
        device=device,
        repeat=repeat,
        isolate=isolate,
        timeout_s=timeout_s,
        guard_bytes=guard_bytes,
        reuse_worker=reuse_worker,
        output=output,
        localise_reads=localise_reads,
        keep_tensors=keep_tensors,
        explain_fidelity=explain_fidelity,
    ) as session:
        variants = session.variants(mutations, fills)
        session.baseline  # noqa: B018 - judged first: every variant is judged beside it
        session.run_all(variants)
        if follow_suggestions:
            session.follow_suggestions()
        if follow_evidence:
            session.follow_evidence()
        report = session.report()
        if sanitize:
            session.sanitize()
            report = session.report()
        return report


def check_mutations(
    path: str | Path,
    indices: Sequence[int],
    mutations: Sequence[str | Variant],
    fills: Sequence[str | FillPattern] = (),
) -> None:
    """Check mutation texts against the schema of each selected call's op, reading only the call records (no
    tensor bytes, no recipe expansion: well under a second). Raises the one-line
    :class:`~moereplay.errors.InvalidMutationError` a replay would raise after loading the call. Ops this process
    does not know yet (a ``python:`` backend registers its own) are left to the replay."""
    from moereplay.format import CaptureReader
    from moereplay.ops import get_op

    if not mutations and not fills:
        return
    with CaptureReader(path) as reader:
        names = {reader.call(index).op for index in indices}
    for name in sorted(names):
        try:
            op = get_op(name)
        except ReplayError:
            continue
        parse_variants(op, mutations, fills)
