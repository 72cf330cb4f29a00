"""Where a replayed call comes from: a capture file (by index or selector), or arguments handed to the API.

Either way the call ends up in a capture file, because that is how a worker process receives it: arguments given
in memory are written to a temporary capture with :class:`~moereplay.format.CaptureWriter` (never pickled).
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moereplay.errors import ReplayError
from moereplay.ops import get_op
from moereplay.ops.base import ArgKind, OpSpec


@dataclass(frozen=True)
class LoadedCall:
    """One call ready to replay: its op, decoded arguments and (when recorded) its output.

    ``args`` hold tensors on ``device`` and enum/opaque values decoded by the op's codecs. ``captured_output`` is
    the kernel output recorded after the call (``None`` when the call never completed).
    """

    op: OpSpec
    args: dict[str, Any]
    captured_output: torch.Tensor | None
    capture_path: Path
    index: int
    site: str = ""
    context: Mapping[Any, Any] = field(default_factory=dict)
    status: str = "completed"


def decode_args(op: OpSpec, args: Mapping[str, Any]) -> dict[str, Any]:
    """Arguments with ENUM/OPAQUE values run through the op's codecs (``decode(..., backend=None)``)."""
    decoded = dict(args)
    for spec in op.arguments:
        if spec.kind in (ArgKind.ENUM, ArgKind.OPAQUE) and spec.codec is not None:
            value = decoded.get(spec.name)
            if value is not None:
                decoded[spec.name] = spec.codec.decode(value, backend=None)
    return decoded


def captured_output(op: OpSpec, outputs: Mapping[str, Any] | None) -> torch.Tensor | None:
    """The kernel's output among a call's recorded outputs: the returned tensor, else the output argument."""
    if not outputs:
        return None
    for key in ("return", op.output_name):
        value = outputs.get(key)
        if isinstance(value, torch.Tensor):
            return value
    return None


def select_calls(
    path: str | Path,
    *,
    call: int | None = None,
    op: str | None = None,
    layer: Any = None,
    every: bool = False,
) -> list[int]:
    """Call indices a ``moereplay run`` selection names, in file order.

    With no selector a capture holding exactly one replayable call selects it; otherwise the caller must choose
    (one-line :class:`ReplayError` listing how).
    """
    from moereplay.format import CaptureReader

    with CaptureReader(path) as reader:
        if call is not None:
            if call not in reader.indices:
                raise ReplayError(f"{path}: no call {call} (calls: {_index_summary(reader.indices)})")
            return [call]
        if op is not None or layer is not None:
            chosen = [record.index for record in reader.select(op=op, layer=layer)]
            if not chosen:
                raise ReplayError(f"{path}: no call matches op={op!r} layer={layer!r}")
            return chosen
        known = [record.index for record in reader.calls() if _replayable(record.op)]
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
        args = decode_args(op, reader.load_args(index, device=device))
        output = None
        if record.status == "completed":
            output = captured_output(op, reader.load_outputs(index, device=device))
    return LoadedCall(op, args, output, path, index, record.site, dict(record.context), record.status)


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
