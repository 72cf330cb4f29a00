"""Several ranks' capture files side by side, and the cross-rank check of a layer call.

A tensor- or expert-parallel ``vllm serve`` writes one capture file per rank (``rank{r}-pid{p}.zst``). Every rank
runs the same forward steps and the same MoE layers in the same order, so the n-th call of (step, layer, op) in one
rank's file is the same logical call as the n-th in another's: :func:`merge_calls` lines them up by that key.

What a rank's layer call returns (vLLM 0.25.1, ``MoERunner._maybe_reduce_final_output``: the all-reduce comes after
the fused experts, when TP or EP size > 1 and no all-to-all kernel reduced already):

- TP: every rank holds a 1/tp slice of each expert's intermediate columns (gate and up sliced alike, w2's rows
  to match) and sees every token: its output is a partial sum over its slice; the sum over ranks is the layer.
- EP (``--enable-expert-parallel`` without DP: vLLM's MoE TP size becomes 1, the EP group is the TP group): every
  rank sees every token but holds only its experts (``expert_map``: global → local, -1 elsewhere); the sum over
  ranks is the layer. With DP + EP vLLM dispatches tokens with all-to-all kernels: a rank's call then holds other
  tokens, which this check refuses (one line) rather than misjudge.

:func:`check_ranks` therefore sums the ranks' recorded outputs in float64 and compares that with the sum of every
rank's float64 layer reference (the family's :class:`~moereplay.ops.layers.LayerReference`) — the single-GPU layer
output, since the slices partition the same computation. Before that it checks what the ranks must agree on: the
replicated inputs (hidden states, routing) bit for bit, and under EP that every global expert lives on exactly one
rank. Each rank's partial is also judged against its own reference, so a bad combination names the rank.
Reads only the tensors of the calls it checks (CPU, no kernel).
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moereplay.errors import SettingsError
from moereplay.format.reader import CaptureReader
from moereplay.format.records import CallRecord


@dataclass(frozen=True)
class RankCall:
    """One rank's call in a merged row: the rank, its file and the call's index there."""

    rank: int
    path: str
    index: int
    status: str


@dataclass(frozen=True)
class MergedCall:
    """The same logical call on every rank that recorded it (ranks in ascending order)."""

    step: Any
    layer: Any
    layer_name: str | None
    op: str
    occurrence: int
    parent: bool
    calls: tuple[RankCall, ...]

    def __post_init__(self) -> None:
        ranks = [call.rank for call in self.calls]
        if ranks != sorted(set(ranks)):
            raise ValueError("a merged call holds each rank once, in ascending order")

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(call.rank for call in self.calls)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "layer": self.layer,
            "layer_name": self.layer_name,
            "op": self.op,
            "occurrence": self.occurrence,
            "parent": self.parent,
            "calls": [
                {"rank": c.rank, "path": c.path, "index": c.index, "status": c.status} for c in self.calls
            ],
        }


_FILE_RANK = re.compile(r"rank(\d+)")


def call_rank(record: CallRecord) -> int | None:
    """The world rank a call's context recorded (``ranks.world``), if any."""
    ranks = record.context.get("ranks")
    world = ranks.get("world") if isinstance(ranks, dict) else None
    return world if isinstance(world, int) and not isinstance(world, bool) else None


def file_rank(reader: CaptureReader, path: str | Path) -> int | None:
    """A file's rank: its first call's recorded world rank, else the header's ``RANK``/``LOCAL_RANK``, else the
    ``rank{r}`` in the file name (how capture names files); None when nothing says."""
    for record in reader.calls():
        found = call_rank(record)
        if found is not None:
            return found
        break
    environment = reader.header.get("rank")
    if isinstance(environment, dict):
        for key in ("rank", "local_rank"):
            value = environment.get(key)
            if isinstance(value, str) and value.isdigit():
                return int(value)
    match = _FILE_RANK.search(Path(path).name)
    return int(match.group(1)) if match else None


def rows_of_rank(path: str | Path, rows: Sequence[Any], rank: int) -> list[Any]:
    """The ``ls`` rows (:class:`~moereplay.format.summary.CallRow`) recorded on world rank ``rank``: a row's own
    ``ranks.world`` when its context has one, else the file's rank (:func:`file_rank`)."""
    with CaptureReader(path) as reader:
        default = file_rank(reader, path)
    kept = []
    for row in rows:
        ranks = row.context.get("ranks")
        world = ranks.get("world") if isinstance(ranks, dict) else None
        if (world if isinstance(world, int) else default) == rank:
            kept.append(row)
    return kept


def _open_ranked(paths: Sequence[str | Path], stack: ExitStack) -> list[tuple[int, str, CaptureReader]]:
    if not paths:
        raise SettingsError("name at least one capture file")
    opened: list[tuple[int, str, CaptureReader]] = []
    for position, path in enumerate(paths):
        if not Path(path).exists():
            raise SettingsError(f"{path}: no such file")
        reader = stack.enter_context(CaptureReader(path))
        rank = file_rank(reader, path)
        opened.append((position if rank is None else rank, str(path), reader))
    seen: dict[int, str] = {}
    for rank, path, _ in opened:
        if rank in seen:
            raise SettingsError(f"{seen[rank]} and {path} are both rank {rank}: name each rank's file once")
        seen[rank] = path
    return sorted(opened, key=lambda item: item[0])


def _key(record: CallRecord) -> tuple[str, str, str]:
    return (str(record.context.get("step")), str(record.context.get("layer")), record.op)


def merge_calls(
    paths: Sequence[str | Path],
    *,
    op: str | None = None,
    layer: Any = None,
    step: Any = None,
    rank: int | None = None,
    parents_only: bool = False,
) -> list[MergedCall]:
    """Rows of the same logical call across rank files, in the first file's order (then calls other ranks alone
    recorded). ``rank``: only rows that rank took part in. Reads call records only, no tensor bytes."""
    with ExitStack() as stack:
        ranked = _open_ranked(paths, stack)
        rows: dict[tuple[str, str, str, int], dict[str, Any]] = {}
        for file_rank_, path, reader in ranked:
            occurrences: dict[tuple[str, str, str], int] = {}
            for record in reader.select(op=op, layer=layer, step=step):
                base = _key(record)
                occurrence = occurrences.get(base, 0)
                occurrences[base] = occurrence + 1
                if parents_only and record.parent is not None:
                    continue
                row = rows.setdefault(
                    (*base, occurrence),
                    {
                        "step": record.context.get("step"),
                        "layer": record.context.get("layer"),
                        "layer_name": record.context.get("layer_name"),
                        "op": record.op,
                        "occurrence": occurrence,
                        "parent": record.parent is None,
                        "calls": [],
                    },
                )
                if row["layer_name"] is None:
                    row["layer_name"] = record.context.get("layer_name")
                row["calls"].append(RankCall(file_rank_, path, record.index, record.status))
        merged = [MergedCall(**{**row, "calls": tuple(row["calls"])}) for row in rows.values()]
    if rank is not None:
        merged = [row for row in merged if rank in row.ranks]
    return merged


# ------------------------------------------------------------------------------------------- the cross-rank check


class ParallelMode(enum.Enum):
    TENSOR = "tp"
    EXPERT = "ep"


@dataclass(frozen=True)
class Judgement:
    """One output judged against its reference: ``ok`` (within the output dtype's tolerance), bad rows of rows
    compared, max / RMS relative error, max absolute error."""

    ok: bool
    bad_rows: int
    rows: int
    max_rel: float
    rms_rel: float
    max_abs: float
    first_bad: str | None = None
    profile: str = ""
    max_bound: float = math.nan
    rms_bound: float = math.nan

    def describe(self) -> str:
        """``N/M bad rows, max rel …, rms rel … (bounds … / …, profile)``: what failed and against what."""
        text = (
            f"{self.bad_rows}/{self.rows} bad rows, max rel {self.max_rel:.2e}, rms rel {self.rms_rel:.2e} "
            f"(bounds {self.max_bound:.0e} / {self.rms_bound:.0e}, {self.profile})"
        )
        return text if self.first_bad is None else f"{text}, first {self.first_bad}"

    def to_json(self) -> dict[str, Any]:
        def number(value: float) -> float | None:
            return None if math.isnan(value) else (value if math.isfinite(value) else str(value))  # type: ignore[return-value]

        return {
            "ok": self.ok,
            "bad_rows": self.bad_rows,
            "rows": self.rows,
            "max_rel": number(self.max_rel),
            "rms_rel": number(self.rms_rel),
            "max_abs": number(self.max_abs),
            "first_bad": self.first_bad,
            "profile": self.profile,
            "max_bound": number(self.max_bound),
            "rms_bound": number(self.rms_bound),
        }


@dataclass(frozen=True)
class CrossRankResult:
    """The cross-rank check of one layer call: the combined output against the single-GPU reference, each rank's
    partial against its own, and what the ranks failed to agree on (``problems``: inputs that differ, experts on
    no rank or on several)."""

    merged: MergedCall
    mode: ParallelMode
    combined: Judgement
    partials: Mapping[int, Judgement]
    problems: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return self.combined.ok and not self.problems and all(p.ok for p in self.partials.values())

    def to_json(self) -> dict[str, Any]:
        return {
            **self.merged.to_json(),
            "mode": self.mode.value,
            "ok": self.ok,
            "combined": self.combined.to_json(),
            "partials": {str(rank): judgement.to_json() for rank, judgement in self.partials.items()},
            "problems": list(self.problems),
        }


def _judge(actual: Any, reference: Any, dtype: Any, roundings: int = 1) -> Judgement:
    from moereplay.reference.compare import compare, profile_for

    profile = profile_for(dtype).chained(roundings)
    comparison = compare(actual, reference, profile=profile)
    first = comparison.first_bad
    return Judgement(
        profile=profile.name,
        max_bound=profile.max_rel,
        rms_bound=profile.rms_rel,
        ok=comparison.ok,
        bad_rows=len(comparison.bad_rows),
        rows=comparison.rows_compared,
        max_rel=comparison.max_rel,
        rms_rel=comparison.rms_rel,
        max_abs=comparison.max_abs,
        first_bad=None if first is None else str(first),
    )


def _recorded_output(outputs: Mapping[str, Any], args: Mapping[str, Any]) -> Any:
    import torch

    for value in (outputs.get("return"), outputs.get("output"), args.get("output")):
        if isinstance(value, torch.Tensor):
            return value
    raise SettingsError("the layer call recorded no output tensor")


def _mode(requested: str, contexts: Sequence[Mapping[Any, Any]], maps: Sequence[Any]) -> ParallelMode:
    if requested != "auto":
        try:
            return ParallelMode(requested)
        except ValueError as error:
            raise SettingsError(f"--mode must be auto, tp or ep, not {requested!r}") from error
    for context in contexts:
        parallel = context.get("parallel")
        if isinstance(parallel, dict) and parallel.get("use_ep") is True:
            return ParallelMode.EXPERT
    return ParallelMode.EXPERT if any(m is not None for m in maps) else ParallelMode.TENSOR


def _expert_map(args: Mapping[str, Any], context: Mapping[Any, Any], name: str | None) -> Any:
    import torch

    value = args.get(name) if name else None
    if isinstance(value, torch.Tensor):
        return value.long().reshape(-1).cpu()  # beside a map from the context (CPU), whatever --device is
    parallel = context.get("parallel")
    recorded = parallel.get("expert_map") if isinstance(parallel, dict) else None
    return torch.tensor(recorded, dtype=torch.long) if isinstance(recorded, list) else None


def _ranges(values: Sequence[int]) -> str:
    return ", ".join(str(v) for v in values[:8]) + (f" …+{len(values) - 8}" if len(values) > 8 else "")


def _coverage_problems(maps: Mapping[int, Any]) -> list[str]:
    import torch

    if any(m is None for m in maps.values()):
        missing = [str(rank) for rank, m in maps.items() if m is None]
        return [f"EP: rank {', '.join(missing)} recorded no expert map"]
    sizes = {int(m.numel()) for m in maps.values()}
    if len(sizes) != 1:
        return [f"EP: the ranks' expert maps cover different numbers of experts ({sorted(sizes)})"]
    held = torch.stack([(m >= 0).long() for m in maps.values()]).sum(0)
    problems = []
    nowhere = torch.nonzero(held == 0).reshape(-1).tolist()
    if nowhere:
        problems.append(f"EP: experts {_ranges(nowhere)} are on no rank (their slots are dropped)")
    twice = torch.nonzero(held > 1).reshape(-1).tolist()
    if twice:
        problems.append(f"EP: experts {_ranges(twice)} are on several ranks (counted more than once)")
    return problems


def _input_problems(replicated: Sequence[str], args: Mapping[int, Mapping[str, Any]]) -> list[str]:
    import torch

    from moereplay.reference.compare import bit_exact

    problems = []
    ranks = sorted(args)
    first = ranks[0]
    for name in replicated:
        base = args[first].get(name)
        for rank in ranks[1:]:
            other = args[rank].get(name)
            if not isinstance(base, torch.Tensor) or not isinstance(other, torch.Tensor):
                continue
            if base.shape != other.shape or base.dtype != other.dtype:
                problems.append(
                    f"{name}: rank {rank} has {other.dtype}{list(other.shape)}, rank {first} "
                    f"{base.dtype}{list(base.shape)} (should be replicated)"
                )
            elif not bit_exact(other, base):
                if base.dim() >= 1:
                    differing = (other != base).reshape(base.shape[0], -1).any(1)
                    rows = torch.nonzero(differing).reshape(-1).tolist()
                    where = f" in rows {_ranges(rows)}" if rows else " (NaN payloads)"
                else:
                    where = ""
                problems.append(
                    f"{name}: rank {rank} differs from rank {first}{where} (should be replicated)"
                )
    return problems


def check_ranks(
    paths: Sequence[str | Path],
    *,
    op: str | None = None,
    layer: Any = None,
    step: Any = None,
    mode: str = "auto",
    device: str | None = None,
) -> list[CrossRankResult]:
    """Check every layer call (a parent call with a family layer reference) that two or more ranks recorded.
    ``device``: where the float64 references run (``cpu``, ``cuda``, ``cuda:N``; None: a GPU when there is one)."""
    from moereplay.ops.layers import get_layer_reference, has_layer_reference

    if len(paths) < 2:
        raise SettingsError("a cross-rank check needs two or more ranks' capture files")
    merged = [
        row
        for row in merge_calls(paths, op=op, layer=layer, step=step, parents_only=True)
        if has_layer_reference(row.op) and len(row.calls) >= 2
    ]
    if not merged:
        raise SettingsError("no layer call with a layer reference was recorded by two or more of these ranks")
    where = _reference_device(device)
    results = []
    with ExitStack() as stack:
        readers = {str(path): stack.enter_context(CaptureReader(path)) for path in paths}
        for row in merged:
            results.append(_check_one(row, readers, get_layer_reference(row.op), mode, where))
    return results


def _reference_device(device: str | None) -> Any:
    """``--device`` checked to one line, then :func:`~moereplay.replay.session.resolve_device` (None: a GPU when
    there is one)."""
    import torch

    from moereplay.replay.session import resolve_device

    if device is not None:
        try:
            chosen = torch.device(device)
        except (RuntimeError, ValueError) as error:
            raise SettingsError(f"--device {device!r}: not a torch device") from error
        if chosen.type == "cuda" and not torch.cuda.is_available():
            raise SettingsError(f"--device {device}: CUDA is not available here")
        if chosen.type == "cuda" and chosen.index is not None and chosen.index >= torch.cuda.device_count():
            raise SettingsError(f"--device {device}: this machine has {torch.cuda.device_count()} GPU(s)")
    return resolve_device(device)


def _on(value: Any, device: Any) -> Any:
    import torch

    return value.to(device) if isinstance(value, torch.Tensor) else value


def _check_one(
    row: MergedCall, readers: Mapping[str, CaptureReader], layer: Any, mode: str, device: Any = "cpu"
) -> CrossRankResult:
    import torch

    args: dict[int, dict[str, Any]] = {}
    contexts: dict[int, Mapping[Any, Any]] = {}
    outputs: dict[int, Any] = {}
    for call in row.calls:
        if call.status != "completed":
            raise SettingsError(f"rank {call.rank}'s call {call.index} did not complete ({call.status})")
        reader = readers[call.path]
        args[call.rank] = {name: _on(value, device) for name, value in reader.load_args(call.index).items()}
        contexts[call.rank] = reader.call(call.index).context
        outputs[call.rank] = _recorded_output(reader.load_outputs(call.index), args[call.rank]).to(device)
    maps = {rank: _expert_map(args[rank], contexts[rank], layer.expert_map) for rank in args}
    chosen = _mode(mode, list(contexts.values()), list(maps.values()))
    for context in contexts.values():
        parallel = context.get("parallel")
        if isinstance(parallel, dict) and parallel.get("use_ep") and int(parallel.get("dp_size", 1)) > 1:
            raise SettingsError(
                "DP + EP: vLLM dispatches tokens between ranks (all-to-all); a rank's call does not see every "
                "token, so its outputs do not sum to the layer's"
            )
    problems = _input_problems(layer.replicated, args)
    if chosen is ParallelMode.EXPERT:
        problems += _coverage_problems(maps)
    shapes = {tuple(output.shape) for output in outputs.values()}
    if len(shapes) != 1:
        raise SettingsError(f"the ranks' layer outputs have different shapes {sorted(shapes)}")
    dtype = next(iter(outputs.values())).dtype
    roundings = int(getattr(layer, "roundings", 1))
    combined = torch.zeros(next(iter(shapes)), dtype=torch.float64, device=device)
    reference = torch.zeros_like(combined)
    partials = {}
    for rank in sorted(args):
        own = layer.reference(args[rank], contexts[rank]).reshape(combined.shape)
        partials[rank] = _judge(outputs[rank], own, dtype, roundings)
        combined += outputs[rank].double()
        reference += own
    return CrossRankResult(
        row, chosen, _judge(combined, reference, dtype, roundings), partials, tuple(problems)
    )


def iter_problems(results: Sequence[CrossRankResult]) -> Iterator[str]:
    """Every problem line, prefixed with its call (for a one-screen summary)."""
    for result in results:
        for problem in result.problems:
            yield f"step {result.merged.step} layer {result.merged.layer}: {problem}"
