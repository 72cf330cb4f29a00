"""Where a replayed call comes from: a capture file (by index or selector), or arguments handed to the API.

Either way the call ends up in a capture file, because that is how a worker process receives it: arguments given
in memory are written to a temporary capture with :class:`~moereplay.format.CaptureWriter` (never pickled).
"""

from __future__ import annotations

import hashlib
import tempfile
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moereplay.errors import CaptureFileError, MoereplayError, ReplayError
from moereplay.ops import get_op
from moereplay.ops.base import ArgKind, OpSpec


@dataclass(frozen=True)
class LoadedCall:
    """One call ready to replay: its op, decoded arguments and (when recorded) its output.

    ``args`` hold tensors on ``device`` and enum/opaque values decoded by the op's codecs. ``captured_output`` is
    the kernel output recorded after the call (``None`` when the call never completed). ``recorded_state``: the
    process state the recorded call ran with, as the op's ``recorded_state`` hook reads it from the call's
    non-tensor outputs and context (``None``: not recorded, or the op declares no such state). ``environment``: the
    environment variables the capture's header recorded (the process's ``VLLM_*`` …, secrets redacted).
    """

    op: OpSpec
    args: dict[str, Any]
    captured_output: torch.Tensor | None
    capture_path: Path
    index: int
    site: str = ""
    context: Mapping[Any, Any] = field(default_factory=dict)
    status: str = "completed"
    recorded_state: Mapping[str, Any] | None = None
    environment: Mapping[str, str] = field(default_factory=dict)


def decode_args(op: OpSpec, args: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """Arguments with ENUM/OPAQUE values run through the op's codecs (``decode(..., backend=None)``), then through
    the op's optional ``recorded_args`` hook (the recorded launcher arguments as the op's schema names them, e.g. a
    launch ``config`` dict split into pseudo-arguments; idempotent).

    A value a codec cannot decode (a damaged or hostile capture) raises :class:`CaptureFileError` naming
    ``where`` (the file and call) and the argument."""
    decoded = dict(args)
    for spec in op.arguments:
        if spec.kind in (ArgKind.ENUM, ArgKind.OPAQUE) and spec.codec is not None:
            value = decoded.get(spec.name)
            if value is not None:
                try:
                    decoded[spec.name] = spec.codec.decode(value, backend=None)
                except MoereplayError:
                    raise
                except Exception as error:
                    raise CaptureFileError(
                        f"{where}argument {spec.name}: the recorded value does not decode as {spec.kind.value} "
                        f"({type(error).__name__}: {str(error)[:200]})"
                    ) from error
    hook = getattr(op, "recorded_args", None)
    if hook is not None:
        normalised: dict[str, Any] = hook(decoded)
        return normalised
    return decoded


def check_argument_kinds(op: OpSpec, args: Mapping[str, Any], where: str) -> None:
    """Every tensor argument the op declares holds a tensor (or ``None`` where that is legal): a file that holds
    an int, an enum or an undecoded codec value there is refused here, by name, before a kernel or reference
    touches it."""
    for spec in op.arguments:
        if spec.kind is not ArgKind.TENSOR or spec.name not in args:
            continue
        value = args[spec.name]
        if isinstance(value, torch.Tensor) or (value is None and spec.optional):
            continue
        found = "None" if value is None else type(value).__name__
        raise CaptureFileError(f"{where}argument {spec.name} should be a tensor; the file holds {found}")


def captured_output(op: OpSpec, outputs: Mapping[str, Any] | None) -> torch.Tensor | None:
    """The kernel's output among a call's recorded outputs: the returned tensor, else the output argument — as the
    op's optional ``output_rows`` hook lays it out as rows (e.g. ``[M, top_k, N]`` → ``[M · top_k, N]``)."""
    if not outputs:
        return None
    hook = getattr(op, "output_rows", None)
    for key in ("return", op.output_name):
        value = outputs.get(key)
        if isinstance(value, torch.Tensor):
            return value if hook is None else hook(value)
    return None


def select_calls(
    path: str | Path,
    *,
    call: Sequence[int] | None = None,
    op: str | None = None,
    layer: Any = None,
    every: bool = False,
) -> list[int]:
    """Call indices a ``moereplay run`` selection names: in file order, except ``call``: the calls given, each
    once, in the order given.

    With no selector a capture holding exactly one replayable call selects it; otherwise the caller must choose
    (one-line :class:`ReplayError` listing how).
    """
    from moereplay.format import CaptureReader
    from moereplay.ops.surface import parent_ops

    parents = parent_ops()
    with CaptureReader(path) as reader:
        if call:
            wanted = list(dict.fromkeys(call))
            for index in wanted:
                if index not in reader.indices:
                    raise ReplayError(f"{path}: no call {index} (calls: {_index_summary(reader.indices)})")
            records = [reader.call(index) for index in wanted]
            layer_calls = [record for record in records if record.op in parents]
            if layer_calls:
                raise _layer_call_error(path, reader, layer_calls)
            return wanted
        if op is not None or layer is not None:
            records = list(reader.select(op=op, layer=layer))
            if not records:
                raise ReplayError(f"{path}: no call matches op={op!r} layer={layer!r}")
            chosen = [record.index for record in records if record.op not in parents]
            if not chosen:  # layer calls only: their kernel calls are what replays
                raise _layer_call_error(path, reader, records)
            return chosen
        known = [record.index for record in reader.calls() if _replayable(record.op)]
        if not known:
            layers = [record for record in reader.calls() if record.op in parents]
            if layers:
                raise _layer_call_error(path, reader, layers)
        if every:
            if not known:
                raise ReplayError(f"{path}: no call of an op moereplay can replay")
            return known
        if len(known) == 1:
            return known
        raise ReplayError(
            f"{path} holds {len(known)} replayable calls ({_index_summary(known)}); choose with --call N, --op, "
            "--layer or --all"
        )


def _layer_call_error(path: str | Path, reader: Any, records: list[Any]) -> ReplayError:
    """Layer (parent) calls are not kernel calls: name their kernel calls, or say to expand them first."""
    first = records[0]
    wanted = {record.index for record in records}
    children = [record.index for record in reader.calls() if record.parent in wanted]
    what = (
        f"call {first.index} is a {first.op} layer call"
        if len(records) == 1
        else f"calls {_index_summary([record.index for record in records])} are layer calls ({first.op} …)"
    )
    if children:
        return ReplayError(
            f"{path}: {what}; replay the kernel calls ({_index_summary(children)}), e.g. "
            f"moereplay run {path} --call {children[0]}"
        )
    return ReplayError(
        f"{path}: {what} recorded without kernel calls; run `moereplay expand {path} -o OUT` first and replay the "
        "kernel calls in OUT"
    )


def _replayable(op_name: str) -> bool:
    try:
        get_op(op_name)
    except ReplayError:
        return False
    return True


def _index_summary(indices: list[int]) -> str:
    from moereplay.replay.findings import row_ranges

    return row_ranges(indices, limit=6)


def load_call(path: str | Path, index: int, device: str | torch.device = "cpu") -> LoadedCall:
    """Read call ``index`` of a capture, decode its arguments, find its recorded output."""
    from moereplay.format import CaptureReader

    path = Path(path)
    with CaptureReader(path) as reader:
        record = reader.call(index)
        op = get_op(record.op)
        where = f"{path}: call {index}: "
        args = decode_args(op, reader.load_args(index, device=device), where)
        check_argument_kinds(op, args, where)
        output = None
        state = None
        if record.status == "completed":
            outputs = reader.load_outputs(index, device=device)
            output = captured_output(op, outputs)
            state = _recorded_state(op, outputs, record.context)
        header = reader.header if isinstance(reader.header, Mapping) else {}
        environment = header.get("env")
    return LoadedCall(
        op,
        args,
        output,
        path,
        index,
        record.site,
        dict(record.context),
        record.status,
        state,
        {str(k): str(v) for k, v in environment.items()} if isinstance(environment, Mapping) else {},
    )


def _recorded_state(
    op: OpSpec, outputs: Mapping[str, Any], context: Mapping[Any, Any]
) -> Mapping[str, Any] | None:
    hook = getattr(op, "recorded_state", None)
    if hook is None:
        return None
    plain = {name: value for name, value in outputs.items() if not isinstance(value, torch.Tensor)}
    state = hook(plain, context)
    return None if state is None else dict(state)


CALL_CACHE_SIZE = 2
"""Loaded calls :func:`load_call_cached` keeps in this process (each holds its tensors on its device)."""


@dataclass
class _CachedCall:
    identity: tuple[Any, ...]
    call: LoadedCall
    values: dict[str, Any]  # the argument objects as loaded (``is``-compared)
    versions: dict[str, int]  # their tensors' version counters
    output_version: int | None

    def unchanged(self) -> bool:
        """Nobody replaced an argument or changed a tensor in place since the load."""
        args = self.call.args
        if args.keys() != self.values.keys() or any(args[name] is not v for name, v in self.values.items()):
            return False
        if any(args[name]._version != version for name, version in self.versions.items()):
            return False
        output = self.call.captured_output
        return (output._version if output is not None else None) == self.output_version


_CALLS: OrderedDict[tuple[Any, ...], _CachedCall] = OrderedDict()


_TAIL_BYTES = 1 << 16


def _file_identity(path: Path, index: int, device: torch.device) -> tuple[Any, ...] | None:
    """(path, call, device, inode, size, mtime, digest of the last 64 KiB — the index and footer, which name every
    blob by its content hash): a file rewritten in place within the clock's granularity still differs."""
    try:
        stat = path.stat()
        with open(path, "rb") as handle:
            handle.seek(max(0, stat.st_size - _TAIL_BYTES))
            tail = hashlib.sha1(handle.read()).hexdigest()
    except OSError:
        return None
    return (str(path.resolve()), index, str(device), stat.st_ino, stat.st_size, stat.st_mtime_ns, tail)


def load_call_cached(path: str | Path, index: int, device: str | torch.device = "cpu") -> LoadedCall:
    """:func:`load_call`, but the same :class:`LoadedCall` object again while the file (path, inode, size, mtime,
    its last 64 KiB) and the loaded arguments (objects and tensor version counters) are unchanged — later sessions
    over one call skip the decode and the host→device copies, and share its caches
    (:func:`moereplay.replay.memo.memos_for`). At most :data:`CALL_CACHE_SIZE` calls are kept;
    :func:`clear_call_cache` drops them."""
    path = Path(path)
    target = torch.device(device)
    identity = _file_identity(path, index, target)
    if identity is None:
        return load_call(path, index, target)
    entry = _CALLS.get(identity)
    if entry is not None and entry.unchanged():
        _CALLS.move_to_end(identity)
        return entry.call
    _CALLS.pop(identity, None)
    loaded = load_call(path, index, target)
    output = loaded.captured_output
    _CALLS[identity] = _CachedCall(
        identity,
        loaded,
        dict(loaded.args),
        {name: value._version for name, value in loaded.args.items() if isinstance(value, torch.Tensor)},
        output._version if output is not None else None,
    )
    while len(_CALLS) > CALL_CACHE_SIZE:
        _CALLS.popitem(last=False)
    return loaded


def clear_call_cache() -> None:
    """Forget every call :func:`load_call_cached` kept (frees their tensors once nothing else holds them)."""
    _CALLS.clear()


def write_call(
    op: OpSpec,
    args: Mapping[str, Any],
    output: torch.Tensor | None,
    directory: str | Path | None = None,
) -> Path:
    """Write one call (and its output, when known) as a temporary capture file; returns its path."""
    from moereplay.format import CaptureWriter

    folder = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="moereplay-call-"))
    path = folder / "call.moe.zst"
    with CaptureWriter(path, header={"purpose": "moereplay replay hand-off"}) as writer:
        index = writer.begin_call(op.name, dict(args), site="moereplay.replay")
        if output is not None:
            writer.complete_call(index, {op.output_name: output})
    return path


def call_from_memory(
    op_name: str,
    args: Mapping[str, Any],
    output: torch.Tensor | None,
    device: str | torch.device = "cpu",
    directory: str | Path | None = None,
) -> LoadedCall:
    """A :class:`LoadedCall` for arguments given in memory, backed by a temporary capture file."""
    op = get_op(op_name)
    decoded = decode_args(op, args)
    path = write_call(op, decoded, output, directory)
    return load_call(path, 0, device)
