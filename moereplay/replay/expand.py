"""``moereplay expand``: regenerate the kernel calls of recorded MoE layer calls by re-running them.

A layer call (a *parent*: ``fused_marlin_moe``, ``batched_fused_marlin_moe``, ``triton_kernel_fused_experts``) is
re-run with the backend's real vLLM function — imported by the record's site, which must be one of the capture's
patch points (a file never names a module to import) — under a capture session of this process in ``always``
mode, so the re-run parent and every kernel call it makes are recorded as a full capture records them. That file
is then copied into ``OUT`` (calls renumbered in order, undecoded, blobs stored once), each re-run parent's
context carrying ``"expanded_from": {"file", "call", "bit_exact"}`` and every kernel call's context
``"expanded_from": {"file", "call", "child", "recorded_child", "bit_exact"}``; the recorded parent's ``layer``,
``step`` (or a graph-kept call's ``graph_step``, ``graph_sequence``, ``graph_launch``, ``graph_tokens`` and
``graph_batch``), ``layer_name``, ``tag`` and ``ranks`` are added where the re-run has none (outside vLLM's
forward pass it has none), so ``moereplay ls --layer`` finds them. A layer call only the layer-scope flight recorder
wraps (``CaptureTarget.layer_flight_only``: gpt-oss's ``triton_kernel_moe_forward``) is re-run unwrapped: its re-run
is recorded as the layer call it makes (``triton_kernel_fused_experts``, routing recomputed from the recorded router
logits) with that call's kernel calls, and judged against the recorded output.

Arguments: loaded as recorded, on ``device``. Scratch buffers the layer-scope flight recorder did not keep
(:class:`~moereplay.format.schema.Unsupported` whose text starts with ``scratch``) are passed as ``None`` (the
function allocates its own). Any other unsupported argument (a function recorded by name: ``activation_func``) is
left out when the live function has a default for it (a note says so), else refused. Enum members and dataclass
objects recorded without a codec (``MoEActivation``, a quant config) are rebuilt from classes of the parent's own
library (vLLM, triton_kernels); triton_kernels objects are rebuilt through the backend. The output buffer is
passed as recorded (a layer-scope record holds its post-call bytes; the function overwrites it).

Verdicts: the re-run parent's outputs against the recorded ones, byte for byte (NaN payloads included), and —
when the recorded parent had kernel calls — each re-run kernel call's outputs against the recorded one in call
order. Not bit-exact is a finding, not an error: the kernel read state outside its arguments (triton_kernels'
process-wide opt_flags, a stale workspace), or it is nondeterministic. An output the flight recorder checked but
did not keep (``MOEREPLAY_FLIGHT_OUTPUT_BYTES``) has no bytes to compare: the fingerprint of its bytes the recorder
reduced is compared with the re-run's (``device_ring.byte_fingerprint``; ``ExpandedCall.fingerprints``: equal is
bit-exact, else it differs), and its recorded largest magnitude with the re-run's (``ExpandedCall.checked``; with
no fingerprint in the file the verdict stays not compared).

Cost: the re-run itself, plus the capture writing every call (weights hashed and compressed once per call) and
one copy of that file into ``OUT``. The re-runs are not isolated in a worker: a kernel that kills the CUDA context
ends the command.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import tempfile
import types
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moereplay.capture.device_ring import byte_fingerprint
from moereplay.capture.flight_layer import is_unkept_marker, largest_magnitude
from moereplay.capture.patch_points import TARGETS, CaptureTarget
from moereplay.capture.patching import ORIGINAL
from moereplay.errors import MoereplayError, ReplayError, SettingsError
from moereplay.ops.base import KernelBackend
from moereplay.replay.expand_args import (
    LIBRARY_PACKAGES,
    Rebuilder,
    attribute_of,
    plan_arguments,
    resolve_function,
    unsupported_text,
)
from moereplay.replay.expand_report import (
    ExpandedCall,
    ExpandReport,
    ExpandVerdict,
    KernelCallComparison,
    OutputComparison,
    compare_bytes,
    compare_outputs,
    primary_output,
)
from moereplay.wording import index_range, plural

__all__ = [
    "REFUSED_OPS",
    "ExpandReport",
    "ExpandVerdict",
    "ExpandedCall",
    "KernelCallComparison",
    "OutputComparison",
    "choose_calls",
    "compare_bytes",
    "compare_outputs",
    "expand_capture",
    "unsupported_text",
]

REFUSED_OPS: dict[str, str] = {
    "unfused_oai_triton_experts": "it is a method (UnfusedOAITritonExperts.apply) recorded with self.<attribute> "
    "pseudo-arguments, which expand cannot rebuild yet",
}
"""Parent ops expand refuses, with the reason."""

CAPTURE_LOGGER = "moereplay.capture"


# --------------------------------------------------------------------------------------------------------------
# choosing the calls
# --------------------------------------------------------------------------------------------------------------


def _targets_by_site(targets: Sequence[CaptureTarget]) -> dict[str, CaptureTarget]:
    return {target.site: target for target in targets if target.role == "parent"}


def choose_calls(
    reader: Any, calls: Sequence[int] | None, targets: Sequence[CaptureTarget] = TARGETS
) -> list[Any]:
    """The layer-call records to expand (every layer call when ``calls`` is None); one-line errors otherwise."""
    path = reader.path
    parents = _targets_by_site(targets)
    parent_ops = {target.op for target in parents.values()}
    kernel_ops = {target.op for target in targets if target.role == "kernel"}
    if calls is None:
        chosen = [record for record in reader.calls() if record.op in parent_ops]
        if not chosen:
            raise ReplayError(
                f"{path}: no layer call to expand (layer calls are {', '.join(sorted(parent_ops))})"
            )
    else:
        chosen = []
        for index in dict.fromkeys(calls):
            if index not in reader.indices:
                raise ReplayError(
                    f"{path}: no call {index} (the file holds {index_range(len(reader), 'call')})"
                )
            record = reader.call(index)
            if record.op not in parent_ops:
                kind = "kernel call" if record.op in kernel_ops else "call"
                raise ReplayError(f"{path}: call {index} is a {record.op} {kind}, not a layer call")
            chosen.append(record)
    for record in chosen:
        if record.op in REFUSED_OPS:
            raise ReplayError(f"{path}: call {record.index} ({record.op}): {REFUSED_OPS[record.op]}")
        if record.site not in parents or parents[record.site].op != record.op:
            raise ReplayError(
                f"{path}: call {record.index} ({record.op}) was recorded at {record.site!r}, which is not a patch "
                "point moereplay knows; expand imports only those"
            )
    return chosen


# --------------------------------------------------------------------------------------------------------------
# the session
# --------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_capture_logs() -> Iterator[None]:
    """The session's "armed" / unknown-vLLM warnings are for serving processes; errors still show."""
    logger = logging.getLogger(CAPTURE_LOGGER)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@dataclass(frozen=True)
class _Run:
    call: int
    error: str | None
    notes: tuple[str, ...]
    # the re-run left a top-level record (a layer_flight_only call may fail before the layer call it makes)
    recorded: bool = True


def _rerun(
    reader: Any,
    records: Sequence[Any],
    backend: KernelBackend,
    device: torch.device,
    targets: Sequence[CaptureTarget],
    directory: Path,
) -> tuple[Path, list[_Run]]:
    """Arm a capture session writing into ``directory``, call each parent, disarm; the file and what happened."""
    import importlib

    from moereplay.capture import session as session_module

    by_site = _targets_by_site(targets)
    modules: dict[str, tuple[types.ModuleType, str]] = {}
    plans: dict[int, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {}
    for record in records:
        target = by_site[record.site]
        for codec_module in target.codec_modules:
            importlib.import_module(codec_module)
        if record.site not in modules:
            modules[record.site] = resolve_function(backend, record.site)
        module, attribute = modules[record.site]
        function = attribute_of(module, attribute)
        function = getattr(function, ORIGINAL, function)
        plans[record.index] = plan_arguments(record, function, target, f"call {record.index}")
    if session_module.current() is not None:
        raise ReplayError("a capture session is already armed in this process; expand arms its own")
    environment = {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_DIR": str(directory),
        "MOEREPLAY_TRIGGER": "always",
    }
    with _quiet_capture_logs():
        session = session_module.arm(environment, targets=targets)
    if session is None:  # pragma: no cover - the environment above always arms
        raise ReplayError("the capture session did not arm")
    runs: list[_Run] = []
    try:
        for record in records:
            scratch, omitted, notes = plans[record.index]
            target = by_site[record.site]
            module, attribute = modules[record.site]
            function = attribute_of(module, attribute)
            if target.layer_flight_only:
                # wrapped only while the layer-scope flight recorder is armed: its re-run is recorded as the
                # parent it calls, with that parent's kernel calls
                unwrapped = (
                    f"{target.op} re-run unwrapped (what it computes before its layer call, such as the routing, "
                    "computed again from the recorded arguments); recorded as the layer call it makes, with its "
                    "kernel calls"
                )
                notes = (*notes, unwrapped)
            elif getattr(function, ORIGINAL, None) is None:
                raise ReplayError(f"the capture session did not wrap {record.site}")
            where = f"call {record.index}"
            packages = frozenset({record.site.split(".", 1)[0].split(":", 1)[0], *LIBRARY_PACKAGES})
            rebuilder = Rebuilder(backend, packages, where)
            state, state_note = _gemm_state(record, function, target)
            if state_note:
                notes = (*notes, state_note)
            loaded = reader.load_args(record.index, device=device)
            keyword: dict[str, Any] = {}
            for name, value in loaded.items():
                if name in omitted:
                    continue
                keyword[name] = None if name in scratch else rebuilder.rebuild(value, name)
            error = None
            seen = session.recorder.counters.seen
            try:
                with state if state is not None else contextlib.nullcontext():
                    function(**keyword)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
            except MoereplayError:
                raise
            except Exception as failure:  # the kernel's own error is a finding, recorded by the session too
                error = f"{type(failure).__name__}: {failure}".splitlines()[0][:300]
            del keyword, loaded
            recorded = not target.layer_flight_only or session.recorder.counters.seen > seen
            if not recorded and error is None:
                notes = (*notes, f"the re-run of {target.op} made no layer call to record")
            runs.append(_Run(record.index, error, notes, recorded))
        if not session.flush(timeout=600.0):
            raise ReplayError("the capture writer did not finish writing the re-runs within 600 s")
        if session.recorder.disabled_reason is not None:
            raise ReplayError(f"capture of the re-runs failed: {session.recorder.disabled_reason}")
        counters = session.writer.counters
        lost = counters.dropped_queue_full + counters.outputs_dropped + counters.write_errors
        if lost or session.recorder.counters.dropped_queue_full:
            raise ReplayError(
                f"capture of the re-runs dropped calls ({counters.as_dict()}); free host memory and try fewer --call"
            )
    finally:
        with _quiet_capture_logs():
            session_module.disarm()
    return session.path, runs


def _gemm_state(
    record: Any, function: Any, target: CaptureTarget
) -> tuple[AbstractContextManager[Any] | None, str | None]:
    """The process state a layer call must re-run under, as its family's hooks read it from the record
    (:class:`moereplay.ops.surface.ProcessStateHooks`), and a note for the report; ``(None, None)`` for layer
    calls without."""
    if not target.process_state_via:
        return None, None
    # the layer function as vLLM defined it: a capture session's wrapper has moereplay's globals, not its module's
    function = getattr(function, ORIGINAL, function)
    hooks: Any = importlib.import_module(target.process_state)
    state: tuple[AbstractContextManager[Any] | None, str | None] = hooks.replay_state(
        record, function, target.process_state_via
    )
    return state


# --------------------------------------------------------------------------------------------------------------
# the core function
# --------------------------------------------------------------------------------------------------------------


def expand_capture(
    source: str | Path,
    output: str | Path,
    *,
    calls: Sequence[int] | None = None,
    backend: str = "auto",
    device: str | torch.device = "cuda",
    targets: Sequence[CaptureTarget] = TARGETS,
    environ: Mapping[str, str] | None = None,
) -> ExpandReport:
    """Re-run the layer calls ``calls`` of ``source`` (all of them when None) with ``backend``'s real functions on
    ``device`` under a capture session; write the re-run parents and their kernel calls into ``output``.

    ``targets``: the patch points (tests pass stand-ins); ``environ``: for ``--backend auto`` (default
    ``os.environ``). Raises :class:`ReplayError` / :class:`SettingsError` / ``CaptureFileError`` (one line) for bad
    input; a re-run that raises is reported (``ExpandVerdict.RAISED``), not raised.
    """
    from moereplay import __version__
    from moereplay.format import CaptureReader, CaptureWriter
    from moereplay.replay.backends import load_backend, parse_backend
    from moereplay.trim import CallCopier

    source, output = Path(source), Path(output)
    if not source.is_file():
        raise SettingsError(f"{source}: no such file")
    if output.exists() and source.resolve() == output.resolve():
        raise SettingsError(f"{output}: expand would overwrite its own source")
    if not output.parent.is_dir():
        raise SettingsError(f"-o {output}: no such directory {output.parent}")
    target_device = torch.device(device)
    with CaptureReader(source) as reader:
        records = choose_calls(reader, calls, targets)
        if target_device.type == "cuda" and not torch.cuda.is_available():
            raise SettingsError(
                "expand re-runs the layer calls with the real kernels on CUDA, and this machine has no CUDA device"
            )
        spec = parse_backend(backend, environ)
        if not spec.runs_kernels:
            raise SettingsError(
                "expand needs the real kernels: the reference backend runs none (use --backend vllm, pack:DIR or auto)"
            )
        kernel_backend = load_backend(spec, target_device)
        chosen = {record.index for record in records}
        children: dict[int, list[int]] = {index: [] for index in chosen}
        for child in reader.calls():
            if child.parent is not None and child.parent in chosen:
                children[child.parent].append(child.index)
        recorded_children = {index: tuple(found) for index, found in children.items()}
        with tempfile.TemporaryDirectory(prefix=".moereplay-expand-", dir=output.parent) as folder:
            session_path, runs = _rerun(reader, records, kernel_backend, target_device, targets, Path(folder))
            with CaptureReader(session_path) as rerun:
                expanded = _judge(reader, rerun, records, runs, recorded_children)
                header = dict(rerun.header)
                header["expand"] = {
                    "source": source.name,
                    "calls": [record.index for record in records],
                    "backend": spec.text,
                    "device": str(target_device),
                    "moereplay": __version__,
                }
                copier = CallCopier(rerun)
                renumbered: dict[int, int] = {}
                with CaptureWriter(output, header=header) as writer:
                    for index in rerun.indices:
                        parent = rerun.call(index).parent
                        renumbered[index] = copier.copy(
                            writer,
                            index,
                            parent=renumbered.get(parent) if parent is not None else None,
                            extra_context=expanded.contexts.get(index, {}),
                        )
                    writer.close(counters=rerun.counters)
                output_calls = len(rerun)
    final = tuple(
        dataclasses.replace(
            call,
            parent=renumbered[call.parent] if call.parent is not None else None,
            kernel_calls=tuple(renumbered[index] for index in call.kernel_calls),
            kernel_comparisons=tuple(
                dataclasses.replace(pair, rerun=renumbered[pair.rerun]) for pair in call.kernel_comparisons
            ),
        )
        for call in expanded.calls
    )
    return ExpandReport(
        source, output, spec.text, str(target_device), final, output_calls, output.stat().st_size
    )


@dataclass(frozen=True)
class _Judged:
    calls: tuple[ExpandedCall, ...]
    contexts: dict[int, dict[str, Any]]  # session-file index -> context added in OUT


CONTEXT_KEYS = (
    "layer",
    "step",
    "layer_name",
    "tag",
    "ranks",
    "graph_step",
    "graph_sequence",
    "graph_launch",
    "graph_tokens",
    "graph_batch",
)
"""Context of the recorded parent given to its re-run (and its kernel calls) where the re-run has none: a call kept
from a CUDA graph replay has ``graph_step`` (``ls`` shows ``g5``), ``graph_sequence`` and ``graph_launch`` instead of
``step``, and where its batch was padded ``graph_tokens`` and ``graph_batch`` (the real and the padded token counts:
a replay of its kernel calls leaves the padding rows unjudged, :mod:`moereplay.replay.padding`)."""


def _judge(
    reader: Any,
    rerun: Any,
    records: Sequence[Any],
    runs: Sequence[_Run],
    recorded_children: Mapping[int, tuple[int, ...]],
) -> _Judged:
    """Pair each recorded parent with its re-run (the n-th top-level call of the session file) and compare."""
    session_records = list(rerun.calls())
    tops = [record for record in session_records if record.parent is None]
    wanted = sum(1 for run in runs if run.recorded)
    if len(tops) != wanted:
        raise ReplayError(
            f"the capture of the re-runs holds {plural(len(tops), 'layer call')} for {plural(wanted, 're-run')}; "
            "were they recorded?"
        )
    expanded: list[ExpandedCall] = []
    contexts: dict[int, dict[str, Any]] = {}
    source_name = reader.path.name
    next_top = iter(tops)
    for record, run in zip(records, runs, strict=True):
        if not run.recorded:  # a layer_flight_only call that failed before the layer call it makes
            verdict = ExpandVerdict.RAISED if run.error is not None else ExpandVerdict.NOT_COMPARED
            expanded.append(
                ExpandedCall(
                    call=record.index,
                    op=record.op,
                    context=dict(record.context),
                    verdict=verdict,
                    parent=None,
                    kernel_calls=(),
                    recorded_kernel_calls=(),
                    outputs=(),
                    kernel_comparisons=(),
                    error=run.error,
                    notes=run.notes,
                )
            )
            continue
        top = next(next_top)
        children = tuple(child.index for child in session_records if child.parent == top.index)
        recorded = recorded_children[record.index]
        inherited = {
            key: record.context[key]
            for key in CONTEXT_KEYS
            if record.context.get(key) is not None and top.context.get(key) is None
        }
        outputs: tuple[OutputComparison, ...] = ()
        checked: tuple[str, float | None, float] | None = None
        fingerprints: tuple[str, str] | None = None
        if run.error is not None:
            verdict = ExpandVerdict.RAISED
        elif record.status != "completed" or top.status != "completed":
            verdict = ExpandVerdict.NOT_COMPARED
        else:
            recorded_outputs, rerun_outputs = reader.load_outputs(record.index), rerun.load_outputs(top.index)
            outputs = compare_outputs(recorded_outputs, rerun_outputs)
            if not outputs:
                verdict = ExpandVerdict.NOT_COMPARED
                found = _checked_only(record.context, recorded_outputs, rerun_outputs)
                if found is not None:
                    checked, fingerprints = found
                if fingerprints is not None:  # the output's bytes compared by their fingerprints
                    same = fingerprints[0] == fingerprints[1]
                    verdict = ExpandVerdict.BIT_EXACT if same else ExpandVerdict.DIFFERS
            elif all(output.bit_exact for output in outputs):
                verdict = ExpandVerdict.BIT_EXACT
            else:
                verdict = ExpandVerdict.DIFFERS
        pairs: list[KernelCallComparison] = []
        for position, (new, old) in enumerate(zip(children, recorded, strict=False)):
            new_record, old_record = rerun.call(new), reader.call(old)
            problem = None
            compared: tuple[OutputComparison, ...] = ()
            if new_record.op != old_record.op:
                problem = f"is a {new_record.op}, the recorded one a {old_record.op}"
            elif new_record.status != "completed" or old_record.status != "completed":
                problem = f"not comparable (status {old_record.status} recorded, {new_record.status} re-run)"
            else:
                compared = compare_outputs(reader.load_outputs(old), rerun.load_outputs(new))
                if not compared:
                    problem = "has no output tensor in common with the recorded one"
            pair = KernelCallComparison(new, old, new_record.op, compared, problem)
            pairs.append(pair)
            contexts[new] = {
                **{key: value for key, value in inherited.items() if new_record.context.get(key) is None},
                "expanded_from": {
                    "file": source_name,
                    "call": record.index,
                    "child": position,
                    "recorded_child": old,
                    "bit_exact": pair.bit_exact,
                },
            }
        for position, new in enumerate(children[len(recorded) :], start=len(recorded)):
            contexts[new] = {
                **{
                    key: value for key, value in inherited.items() if rerun.call(new).context.get(key) is None
                },
                "expanded_from": {
                    "file": source_name,
                    "call": record.index,
                    "child": position,
                    "recorded_child": None,
                    "bit_exact": None,
                },
            }
        call = ExpandedCall(
            record.index,
            record.op,
            dict(record.context),
            verdict,
            top.index,
            children,
            recorded,
            outputs,
            tuple(pairs),
            run.error,
            run.notes,
            checked,
            fingerprints,
        )
        contexts[top.index] = {
            **inherited,
            "expanded_from": {
                "file": source_name,
                "call": record.index,
                "bit_exact": call.bit_exact,
                **({"check_agrees": call.check_agrees} if call.checked is not None else {}),
            },
        }
        expanded.append(call)
    return _Judged(tuple(expanded), contexts)


def _checked_only(
    context: Mapping[str, Any], recorded: Mapping[str, Any], rerun: Mapping[str, Any]
) -> tuple[tuple[str, float | None, float], tuple[str, str] | None] | None:
    """An output the flight recorder checked but did not keep (``MOEREPLAY_FLIGHT_OUTPUT_BYTES``) and the re-run's
    tensor of that name, else its primary output (the re-run of a layer call kept one level up may name it
    otherwise): ((name, the recorded largest magnitude — None when its check was never read —, the re-run's),
    (the recorded fingerprint, the re-run's) where the recording has one, else None), or None."""
    flight = context.get("flight")
    magnitude = flight.get("magnitude") if isinstance(flight, Mapping) else None
    if not isinstance(magnitude, (int, float)) or isinstance(magnitude, bool):
        magnitude = None
    printed = flight.get("fingerprint") if isinstance(flight, Mapping) else None
    if not (isinstance(printed, str) and len(printed) == 16 and set(printed) <= set("0123456789abcdef")):
        printed = None  # none recorded (or not one the recorder writes: never trusted as a proof)
    for name, value in recorded.items():
        if not is_unkept_marker(value):
            continue
        again = rerun.get(name)
        if not isinstance(again, torch.Tensor):
            primary = primary_output(rerun)
            again = primary[1] if primary is not None else None
        if isinstance(again, torch.Tensor):
            checked = (name, None if magnitude is None else float(magnitude), largest_magnitude(again))
            return checked, None if printed is None else (printed, f"{byte_fingerprint(again):016x}")
    return None
