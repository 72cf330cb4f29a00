"""The Marlin MoE reference's products on a GPU without dense weights: one Triton kernel reads the packed codes.

The dense path (:mod:`.marlin_decode`, then one float32 matmul per used expert) writes every used expert's weights
as float32 and reads them again: at gpt-oss shapes (32 experts, 2880 × 5888) 2.2 GB each way, 46–74× the Marlin
kernel's own time on an H200. :func:`expert_rows` computes the same rows from the packed and stored tensors
(:mod:`.marlin_rows_kernel`): each weight is formed in registers with the dense decoder's float32 operations (the
same code value; the same scale, decoded from its stored byte or 16-bit value and multiplied by NVFP4's per-expert
factor or FP8's compensation as :meth:`MarlinExpertWeights.scale_parts` describes; with integer zero points the same
``−zero · scale`` offset), so the weights are the dense decoder's bits; only the order of the float32 sum differs
from cuBLAS's (IEEE float32 fused multiply-adds per 16-row tile, then tile by tile), and it is the same
for every row whatever else the call holds.

Used on CUDA devices with Triton present for the formats the fast decoder handles (no act order, no float zero
points; :meth:`MarlinExpertWeights.fast_kind`); ``MOEREPLAY_REFERENCE_FUSED=0`` (the switch of
:mod:`.dequant_dense`) keeps the dense path everywhere.

Where the products run here and the weights have no integer zero points, the call is routed on the GPU too
(:func:`route_on_device`, one program of :func:`.marlin_rows_kernel.route_rows`): the host's numpy routing read the
routing arrays back first (a sync) and worked on them before the first product launch: about 0.5 ms of host time
on an H100 machine, where the Marlin kernel's own call at 32 tokens takes 0.10 ms (gemm2) to 0.15 ms (gemm1).
The device routing makes the same tables, grouped order and row blocks; its summary of anomalies is read with the
call's one sync at the end, and only a summary that shows one sends the routing arrays to the host for the notes'
words.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moereplay.errors import ReferenceError_
from moereplay.reference import marlin_decode
from moereplay.reference import marlin_layout as layout
from moereplay.reference.dequant_dense import FUSED_DEVICE_TYPES, SWITCH_VARIABLE
from moereplay.reference.launch import launch
from moereplay.reference.marlin_formats import MarlinExpertWeights

TILE_K, TILE_N = 16, 64
"""One Marlin tile of 16-bit activations: 16 rows of K by 64 columns of N."""

BLOCK_ROWS = (4, 8, 16)
"""Rows of one expert a program multiplies: the smallest of these that holds the expert's rows, larger experts in
blocks of the last (a program decodes each weight once for all its rows)."""

BLOCK_N = 128
"""Columns of one program."""

ARITHMETIC_KINDS = {"e2m1": (1, 0), "uint4b8": (2, 8), "uint4": (2, 0)}
"""4-bit kinds the kernel decodes with integer operations (``DECODE``, ``BIAS`` of ``_value4``) instead of a table
lookup: a warp's lookups of random codes are one load each, its arithmetic a few register operations."""

ARITHMETIC_DECODE = True
"""Whether :data:`ARITHMETIC_KINDS` are decoded arithmetically (False: every kind through its table)."""

NUM_WARPS = 4
"""Warps of one program: one column of :data:`BLOCK_N` a thread. Device time of the products (H100, reference_bench
``--rows-variants``, at most 11 K splits; nvfp4-gemm1 / nvfp4-gemm2 / mxfp4-gemm2): 4 warps × 128 columns 498 / 271
/ 283 µs, 2 × 256 587 / 318 / 273, 2 × 128 624 / 389 / 365, 4 × 256 613 / 335 / 334, 1 × 256 500 / 310 / 311."""

STAGE_BLOCK_K = 64
"""K elements of one staging program."""

MAX_SPLITS, MIN_TILES_PER_SPLIT = 16, 16
"""K's 16-row tiles are cut into at most this many splits of at least that many tiles (more programs in flight;
the splits' partial sums are added in order). The cut depends on K alone, never on the rows of a call. A decode
call has few row blocks, so its programs fill the GPU only with many splits: at gpt-oss's K (11 splits) the products
took 587 / 318 / 273 µs against 697 / 433 / 312 µs with at most 4 (2 warps × 256 columns; as in :data:`NUM_WARPS`)."""


_FAILED: list[str] = []
"""Why the kernel could not run in this process (then the dense path runs from there on), empty while it can."""


def available(device: torch.device, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the kernel may run on ``device``: a CUDA device, Triton importable, not switched off
    (``environ``: default ``os.environ``, read when called)."""
    environment = os.environ if environ is None else environ
    if device.type not in FUSED_DEVICE_TYPES or environment.get(SWITCH_VARIABLE, "1").strip() == "0":
        return False
    if _FAILED:
        return False
    try:
        from moereplay.reference import marlin_rows_kernel  # noqa: F401
    except ImportError:
        return False
    return True


def usable(weights: MarlinExpertWeights) -> bool:
    """Whether the kernel reads these weights: a format of the fast decoder in the 16-bit-activation layout."""
    return (
        weights.fast_kind() is not None
        and weights.size_k % TILE_K == 0
        and weights.size_n % TILE_N == 0
        and weights.group_size % TILE_K == 0
    )


@functools.cache
def _byte_table_cpu(num_bits: int) -> torch.Tensor:
    sources = layout.tile_slot_sources(num_bits)  # slot -> k * 64 + n
    slots = torch.empty_like(sources)
    slots[sources] = torch.arange(sources.numel())
    # 4-bit: byte slot // 2, the code's nibble is the slot's low bit; 8-bit: byte slot
    entries = (slots // 2) * 8 + (slots % 2) * 4 if num_bits == 4 else slots * 8
    return entries.to(torch.int32).view(TILE_K, TILE_N)


def byte_table(num_bits: int) -> torch.Tensor:
    """int32 ``[16, 64]``: for row ``k`` and column ``n`` of a Marlin tile, ``byte · 8 + shift`` — the byte of the
    packed tile holding that code and the bit its code starts at (4-bit: 0 or 4; 8-bit: 0)."""
    return _byte_table_cpu(num_bits).clone()


@functools.cache
def _entries_cpu(num_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    table = _byte_table_cpu(num_bits)
    columns, rows = (table[0] - table[0, 0]).contiguous(), table[:, 0].contiguous()
    if not torch.equal(table, rows[:, None] + columns[None, :]) or bool((columns & 7).any()):
        raise ReferenceError_(
            f"the {num_bits}-bit Marlin tile permutation does not separate into rows and columns"
        )
    if num_bits == 4:  # what the kernel's 4-bit path assumes
        if not (torch.equal(rows[8:], rows[:8] + 4) and not bool((rows[:8] & 7).any())):
            raise ReferenceError_("4-bit Marlin rows k and k + 8 are not a byte's low and high nibbles")
        if not torch.equal(table[0::2] >> 5, table[1::2] >> 5):
            raise ReferenceError_("4-bit Marlin rows 2j and 2j + 1 of a column are not in one 32-bit word")
        step, half = four_bit_row_steps(rows)
        k = torch.arange(8)
        if int(rows[0]) != 0 or step % 32 or not torch.equal(rows[:8], step * (k // 2) + half * (k % 2)):
            raise ReferenceError_("4-bit Marlin rows 2j + h are not at j · step + h · half bits of a tile")
    return columns, rows


def four_bit_row_steps(rows: torch.Tensor) -> tuple[int, int]:
    """``(ROW_STEP, ROW_HALF)`` of the 4-bit row entries: the bits from row 2j to row 2j + 2, and from row 2j to
    row 2j + 1 (the kernel's constants; :func:`_entries_cpu` checks that they describe rows 0–7)."""
    return int(rows[2] - rows[0]), int(rows[1] - rows[0])


@functools.cache
def _four_bit_steps() -> tuple[int, int]:
    return four_bit_row_steps(_entries_cpu(4)[1])


def tile_entries(num_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`byte_table` as ``column_entries[n] + row_entries[k]`` (int32 ``[64]`` and ``[16]``; the column
    part's shift is 0): the kernel reads the column part once; the row part per row of a tile (8-bit) or, for
    4-bit codes, from :func:`four_bit_row_steps`' two constants."""
    columns, rows = _entries_cpu(num_bits)
    return columns.clone(), rows.clone()


@functools.cache
def _value_table_cpu(kind: str) -> torch.Tensor:
    values = marlin_decode.code_values(kind)
    return values[torch.arange(256) % 16] if values.numel() == 16 else values


def value_table(kind: str) -> torch.Tensor:
    """float32 ``[256]``: the exact value of each code of ``kind`` (4-bit kinds repeat every 16 entries)."""
    return _value_table_cpu(kind).clone()


@functools.cache
def _device_tables(
    num_bits: int, kind: str, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    columns, rows = _entries_cpu(num_bits)
    return columns.to(device), rows.to(device), _value_table_cpu(kind).to(device)


Tile = tuple[int, int, int, int]
"""A program's row block: (start in the grouped order, rows, expert, position among the used experts)."""


def plan_tiles(per_expert: Sequence[int], experts: Sequence[int]) -> dict[int, list[Tile]]:
    """Programs' row blocks by height: ``{BLOCK_M: [(start, count, expert, position), ...]}``. ``per_expert[u]``
    rows of expert ``experts[u]`` start at the sum of the earlier counts in the grouped order; they go to the
    smallest :data:`BLOCK_ROWS` height that holds them, or in blocks of the largest."""
    plan: dict[int, list[Tile]] = {height: [] for height in BLOCK_ROWS}
    start = 0
    for position, (count, expert) in enumerate(zip(per_expert, experts, strict=True)):
        height = _HEIGHTS[count] if count < len(_HEIGHTS) else BLOCK_ROWS[-1]
        for first in range(0, count, height):
            plan[height].append((start + first, min(height, count - first), int(expert), position))
        start += count
    return {height: tiles for height, tiles in plan.items() if tiles}


_HEIGHTS = [next(h for h in BLOCK_ROWS if h >= count) for count in range(BLOCK_ROWS[-1] + 1)]
""":func:`plan_tiles`' block height by row count, up to the largest height."""


def k_splits(k_tiles: int) -> tuple[int, int]:
    """``(splits, tiles per split)`` for K's ``k_tiles`` 16-row tiles (:data:`MAX_SPLITS`)."""
    splits = max(1, min(MAX_SPLITS, k_tiles // MIN_TILES_PER_SPLIT))
    per_split = -(-k_tiles // splits)
    return -(-k_tiles // per_split), per_split


PARTIAL_BYTES = 1 << 30
"""Largest buffer of split partial sums (``splits × rows × N`` float32) one pass of launches writes; a call with more
rows (a long prefill) goes in passes of whole row blocks, which changes no row's value. A pass also stages its
activations (``16 × K`` float32 a row block: about the pass's rows × K × 4 bytes, plus up to 15 padding rows per
used expert)."""


def passes(plan: dict[int, list[Tile]], row_budget: int) -> list[dict[int, list[Tile]]]:
    """The plan's row blocks in grouped order cut into runs of whole blocks of at most ``row_budget`` rows (at
    least one block each), each run again by block height."""
    if sum(tile[1] for tiles in plan.values() for tile in tiles) <= row_budget:  # the usual case: one pass
        return [{height: list(tiles) for height, tiles in plan.items()}] if plan else []
    runs: list[dict[int, list[Tile]]] = []
    rows = 0
    for height, tile in sorted(
        ((height, tile) for height, tiles in plan.items() for tile in tiles), key=lambda item: item[1][0]
    ):
        if not runs or rows + tile[1] > row_budget:
            runs.append({})
            rows = 0
        runs[-1].setdefault(height, []).append(tile)
        rows += tile[1]
    return runs


COUNT_BLOCK = 8192
"""Scale bytes one program of :func:`count_scale_bytes` examines."""


def count_scale_bytes(scales: torch.Tensor, experts: torch.Tensor, e8m0_nan: bool) -> torch.Tensor | None:
    """How many of ``experts``' scale bytes (uint8 ``[E, ...]``, on a GPU) are NVFP4 scales with the top bit clear
    and non-zero, or e8m0 0xFF (``e8m0_nan``): a 0-d int64 on the device, one launch, no sync — or None where the
    kernel cannot run (the caller counts with torch)."""
    if not available(scales.device) or experts.numel() == 0:
        return None
    total = torch.zeros((), dtype=torch.int64, device=scales.device)
    flat = scales.contiguous().view(scales.shape[0], -1)
    per_expert = flat.shape[1]
    if per_expert == 0:
        return total
    if -(-per_expert // COUNT_BLOCK) > 65535:  # the grid's second dimension; torch counts such giants
        return None
    try:
        from moereplay.reference.marlin_rows_kernel import count_scale_bytes as kernel

        with _current(scales.device):
            launch(
                kernel,
                (experts.numel(), -(-per_expert // COUNT_BLOCK)),
                flat,
                experts.contiguous(),
                per_expert,
                total,
                E8M0_NAN=e8m0_nan,
                BLOCK=COUNT_BLOCK,
            )
    except _launch_errors() as error:
        _give_up(error)
        return None
    return total


def _current(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Triton launches on the current device's current stream: ``device`` made current for the launches where it
    is another GPU (a context switch costs a few µs a launch, so none where it is current already; the CPU:
    Triton's interpreter, for tests)."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _give_up(
    error: BaseException,
    failed: list[str] | None = None,
    what: str = "the packed-code Marlin reference kernel",
    instead: str = "the reference dequantises to dense weights instead",
) -> None:
    """Remember in ``failed`` (default :data:`_FAILED`: the reference takes the dense path from now on) why a
    kernel could not run here and say so once."""
    failed = _FAILED if failed is None else failed
    failed.append(f"{type(error).__name__}: {error}".splitlines()[0][:300])
    warnings.warn(f"moereplay: {what} cannot run here ({failed[0]}); {instead}", RuntimeWarning, stacklevel=3)


def _launch_errors() -> tuple[type[BaseException], ...]:
    """What a kernel that cannot be built or launched on this machine raises (its module missing, Triton's compiler
    or resource errors); anything else is a bug or a device fault and is not caught."""
    errors: list[type[BaseException]] = [ImportError]
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources
    except ImportError:
        return tuple(errors)
    return (*errors, CompilationError, OutOfResources)


@dataclass(frozen=True)
class Pass:
    """One pass of :func:`expert_rows`' launches: its rows' first place in the grouped order (``row_base``), how
    many rows its partial sums hold, its row blocks (``tiles``, consecutive entries of the fields) and, in launch
    order, each block height with its number of blocks."""

    row_base: int
    rows: int
    tiles: int
    heights: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class RowPlan:
    """How :func:`expert_rows` launches a call's rows: the passes (:class:`Pass`), the fields of their row blocks
    in launch order (int64 ``[tiles, 4]``: start in the grouped order, rows, expert, position among the used experts)
    and K's splits (:func:`k_splits`). Made on the host (:func:`plan_rows`: ``fields`` goes to the device with the
    caller's other host tables) or, for a routing that never leaves the device (:func:`route_on_device`), one pass
    over upper bounds whose spare blocks have no rows (``fields`` None: they are on the device)."""

    fields: np.ndarray | None
    splits: int
    per_split: int
    passes: tuple[Pass, ...]


def row_budget(size_k: int, size_n: int) -> int:
    """Rows one pass holds at K, N: its split partial sums stay within :data:`PARTIAL_BYTES`."""
    splits, _ = k_splits(size_k // TILE_K)
    return max(BLOCK_ROWS[-1], PARTIAL_BYTES // (splits * size_n * 4))


def plan_rows(per_expert: Sequence[int], experts: Sequence[int], size_k: int, size_n: int) -> RowPlan:
    """The :class:`RowPlan` of ``per_expert[u]`` rows of expert ``experts[u]`` (grouped order) at K, N."""
    splits, per_split = k_splits(size_k // TILE_K)
    runs = passes(plan_tiles(per_expert, experts), row_budget(size_k, size_n))
    fields = np.array(
        [tile for run in runs for height in sorted(run) for tile in run[height]], dtype=np.int64
    ).reshape(-1, 4)
    launches = tuple(
        Pass(
            row_base=min(tile[0] for tiles in run.values() for tile in tiles),
            rows=sum(tile[1] for tiles in run.values() for tile in tiles),
            tiles=sum(len(tiles) for tiles in run.values()),
            heights=tuple((height, len(run[height])) for height in sorted(run)),
        )
        for run in runs
    )
    return RowPlan(fields, splits, per_split, launches)


SUMMARY = (
    "negative",
    "after_padding",
    "dropped",
    "kept",
    "written",
    "past_buffers",
    "not_multiple",
    "used",
    "total",
)
"""What :func:`route_rows`' summary holds, in order: negative ``sorted_token_ids`` entries; valid entries right after
padding in their block; valid entries of a block whose expert is out of range; the entries kept; the output rows
written (fewer than kept: rows written twice); whether the blocks ran past the buffers; whether the padded total is
not a multiple of the block size; the used experts; the padded total."""

ROUTE_ON_DEVICE = True
"""Whether :func:`route_on_device` routes at all (False: every call routes on the host; for comparisons)."""

ROUTE_MAX_SLOTS, ROUTE_MAX_EXPERTS = 1 << 16, 1024
"""Largest output rows and experts routed on the device (one program; larger calls route on the host, where a
long call's host work is small beside its products)."""

ROUTE_BLOCK, ROUTE_CELLS = 1024, 4096
"""Entries one step of the routing program reads; the one-hot cells (rows × experts) of one step of its ranking."""


@dataclass(frozen=True)
class RoutedRows:
    """A call's routing made on its device by :func:`route_on_device` (no host round trip). Everything the
    host-routed reference holds, on the device: ``tables`` (int64 ``[5, rows]``: input row, expert, k slot, block,
    written, as the host's row tables), ``row_experts`` (``tables[1]`` on an aligned start), the grouped order's
    ``source`` and ``destination`` rows, the row blocks' ``fields`` and their :class:`RowPlan`, ``used`` (the used
    experts ascending, −1 after them: every list of experts the call's launches need has this length) and
    ``summary`` (:data:`SUMMARY`, read with the call's one sync at its end)."""

    tables: torch.Tensor
    row_experts: torch.Tensor
    source: torch.Tensor
    destination: torch.Tensor
    fields: torch.Tensor
    used: torch.Tensor
    summary: torch.Tensor
    plan: RowPlan

    def summary_of(self, values: Sequence[int]) -> dict[str, int]:
        """The summary's values (read from :attr:`summary`) by name."""
        return dict(zip(SUMMARY, values, strict=True))


_ROUTING_DTYPES = (torch.int32, torch.int64)

_ROUTE_FAILED: list[str] = []
"""Why the routing kernel could not run in this process (then every call routes on the host), empty while it can."""


def route_on_device(
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_past_padded: torch.Tensor | int,
    block_size: int,
    num_slots: int,
    top_k: int,
    num_experts: int,
    size_k: int,
    size_n: int,
) -> RoutedRows | None:
    """The call's routing and row plan on the routing arrays' device, one launch, no sync (:func:`route_rows`):
    the same rows, tables, grouped order and row blocks as the host's numpy routing. The plan is one pass over
    upper bounds of the row blocks each height can have (a spare block has no rows and costs its programs an
    exit). None where it does not apply (arrays on another device or of another type, a call past
    :data:`ROUTE_MAX_SLOTS` or :data:`ROUTE_MAX_EXPERTS` or one pass) or the kernel cannot run: the caller routes
    on the host."""
    device = sorted_token_ids.device
    if (
        not ROUTE_ON_DEVICE
        or _ROUTE_FAILED
        or not available(device)
        or expert_ids.device != device
        or sorted_token_ids.numel() >= (1 << 31) - ROUTE_BLOCK  # the kernel's positions are int32
        or sorted_token_ids.dtype not in _ROUTING_DTYPES
        or expert_ids.dtype not in _ROUTING_DTYPES
        or not 0 < num_slots <= min(ROUTE_MAX_SLOTS, row_budget(size_k, size_n))
        or not 0 < num_experts <= ROUTE_MAX_EXPERTS
        or block_size < 1
        or top_k < 1
    ):
        return None
    total_tensor = None
    if isinstance(num_tokens_past_padded, torch.Tensor):
        if num_tokens_past_padded.numel() < 1 or num_tokens_past_padded.dtype not in _ROUTING_DTYPES:
            return None
        if num_tokens_past_padded.device == device:
            total_tensor = num_tokens_past_padded.reshape(-1)
            total_value = 0
        elif num_tokens_past_padded.device.type == "cpu":
            total_value = int(num_tokens_past_padded.reshape(-1)[0])
        else:
            return None
    else:
        total_value = int(num_tokens_past_padded)
    if not -(1 << 62) < total_value < 1 << 62:
        return None
    splits, per_split = k_splits(size_k // TILE_K)
    tiles4 = min(num_experts, num_slots)
    tiles8 = min(num_experts, num_slots // 5)
    # the 16-row blocks: the sum of ceil(n / 16) over experts of n > 8 rows (at most S // 9 of them)
    tiles16 = num_slots // 16 + min(num_experts, num_slots // 9)
    tiles = tiles4 + tiles8 + tiles16
    stride = _even(num_slots)
    # int64 words each part takes, an even number (every part starts 16-byte aligned); the int32 scratch in halves
    sizes = {
        "tables": 5 * stride,
        "source": stride,
        "destination": stride,
        "fields": 4 * tiles,
        "used": _even(num_experts),
        "summary": 16,
        "last": _even(-(-num_slots // 2)),
        "rank": _even(-(-num_slots // 2)),
        "start": _even(-(-num_experts // 2)),
    }
    buffer = torch.empty(sum(sizes.values()), dtype=torch.int64, device=device)
    parts: dict[str, torch.Tensor] = {}
    at = 0
    for name, size in sizes.items():
        parts[name] = buffer[at : at + size]
        at += size
    experts_block = max(16, 1 << (num_experts - 1).bit_length())  # a power of two, as Triton's blocks are
    try:
        from moereplay.reference.marlin_rows_kernel import route_rows

        with _current(device):
            launch(
                route_rows,
                (1,),
                sorted_token_ids.reshape(-1).contiguous(),  # read flat in logical order (strided: a copy)
                expert_ids.reshape(-1).contiguous(),
                total_tensor if total_tensor is not None else parts["summary"],
                total_value,
                sorted_token_ids.numel(),
                expert_ids.numel(),
                num_slots,
                top_k,
                num_experts,
                block_size,
                parts["last"].view(torch.int32),
                parts["rank"].view(torch.int32),
                parts["start"].view(torch.int32),
                parts["tables"],
                stride,
                parts["source"],
                parts["destination"],
                parts["fields"],
                tiles4,
                tiles8,
                tiles16,
                parts["used"],
                parts["summary"],
                TOTAL_IN_MEMORY=total_tensor is not None,
                BLOCK=ROUTE_BLOCK,
                ROWS=max(1, ROUTE_CELLS // experts_block),
                EXPERTS=experts_block,
                num_warps=4,
            )
    except _launch_errors() as error:
        # the products kernel may still run: only the routing goes back to the host, from now on
        _give_up(
            error,
            _ROUTE_FAILED,
            "the Marlin reference's device routing",
            "calls are routed on the host instead",
        )
        return None
    tables = parts["tables"].view(5, stride)[:, :num_slots]
    heights = tuple(
        (height, count) for height, count in zip(BLOCK_ROWS, (tiles4, tiles8, tiles16), strict=True) if count
    )
    plan = RowPlan(None, splits, per_split, (Pass(0, num_slots, tiles, heights),))
    return RoutedRows(
        tables=tables,
        row_experts=tables[1],
        source=parts["source"][:num_slots],
        destination=parts["destination"][:num_slots],
        fields=parts["fields"].view(tiles, 4),
        used=parts["used"][:num_experts],
        summary=parts["summary"][: len(SUMMARY)],
        plan=plan,
    )


def _even(count: int) -> int:
    """``count`` rounded up to an even number."""
    return count + count % 2


SUM_BLOCK = 1024
"""Columns of one program of the kernel that adds a pass's K splits."""


def expert_rows(
    input: torch.Tensor,
    weights: MarlinExpertWeights,
    experts_used: torch.Tensor,
    plan: RowPlan,
    fields: torch.Tensor,
    source_rows: torch.Tensor,
    destination: torch.Tensor,
    num_rows: int,
    every_row: bool = False,
) -> torch.Tensor | None:
    """float32 ``[num_rows, N]``: row ``destination[g]`` is ``input[source_rows[g]] @ W[e]`` for the ``g``-th row
    of the grouped order (``plan`` from :func:`plan_rows`, its ``fields`` on the device; rows of
    ``experts_used[u]`` after one another), the rows no ``destination`` names zero (``every_row``: the caller
    knows ``destination`` names every row, so none is zeroed first). Per pass of
    :data:`PARTIAL_BYTES`: one launch staging the activations, one per block height, one adding the K splits in
    order into their rows; no sync.
    None when the kernel cannot be built or launched here (said once as a warning; the caller takes the dense
    path, from then on)."""
    device = input.device
    size_n = weights.size_n
    out = (torch.empty if every_row and plan.passes else torch.zeros)(
        (num_rows, size_n), dtype=torch.float32, device=device
    )
    if not plan.passes:
        return out
    k_tiles = weights.size_k // TILE_K
    splits, per_split = plan.splits, plan.per_split
    kind = weights.fast_kind()
    assert kind is not None
    num_bits = weights.format.num_bits
    column_entries, row_entries, lut = _device_tables(num_bits, kind, device)
    decode, bias = ARITHMETIC_KINDS.get(kind, (0, 0)) if ARITHMETIC_DECODE and num_bits == 4 else (0, 0)
    row_step, row_half = _four_bit_steps() if num_bits == 4 else (0, 0)
    scale_table, columns, multipliers, factor = _scale_parts(weights)
    offsets = None
    if weights.b_qzeros is not None:  # integer zero points: −zero · scale per used expert, from the host
        offsets = weights.fast_factors(experts_used)[1]
        assert offsets is not None
        offsets = offsets.contiguous()
    stored = weights.b_scales.view(torch.uint8) if weights.scales_are_bytes else weights.b_scales
    # 4-bit: read as 32-bit words (a word holds four rows of two columns); 8-bit: byte by byte
    packed = weights.b_qweight.contiguous().view(torch.int32 if num_bits == 4 else torch.uint8)
    source = source_rows.contiguous()
    first = 0
    try:
        from moereplay.reference.marlin_rows_kernel import STAGED_ROWS, add_splits, marlin_rows, stage_rows

        # Triton launches on the current device's current stream (the CPU: Triton's interpreter, for tests)
        with _current(device):
            for run in plan.passes:
                row_base, rows, run_tiles = run.row_base, run.rows, run.tiles
                # the run's activations, float32, K-major per row block (one launch for every height)
                staged = torch.empty(
                    (run_tiles, weights.size_k, int(STAGED_ROWS)), dtype=torch.float32, device=device
                )
                launch(
                    stage_rows,
                    (run_tiles, -(-weights.size_k // STAGE_BLOCK_K)),
                    input,
                    input.stride(0),
                    input.stride(1),
                    source,
                    fields[first : first + run_tiles],
                    staged,
                    weights.size_k,
                    BLOCK_K=STAGE_BLOCK_K,
                )
                staged_pairs = staged.view(torch.int64)
                run_first = first
                partial = torch.empty((splits, rows, size_n), dtype=torch.float32, device=device)
                for height, tiles in run.heights:
                    launch(
                        marlin_rows,
                        (tiles, -(-size_n // BLOCK_N), splits),
                        staged_pairs[first - run_first :],
                        row_base,
                        partial,
                        partial.stride(0),
                        partial.stride(1),
                        packed,
                        column_entries,
                        row_entries,
                        lut,
                        stored,
                        *stored.stride(),
                        columns,
                        scale_table if scale_table is not None else lut,  # never read for 16-bit scales
                        multipliers,
                        factor,
                        offsets if offsets is not None else lut,  # never read without zero points
                        fields[first : first + tiles],
                        k_tiles,
                        per_split,
                        size_n // TILE_N,
                        size_n,
                        weights.num_groups,
                        weights.group_size // TILE_K,
                        FOUR_BIT=num_bits == 4,
                        SCALE_BYTES=scale_table is not None,
                        HAS_OFFSET=offsets is not None,
                        TILE_BYTES=TILE_K * TILE_N * num_bits // 8,
                        BLOCK_M=height,
                        BLOCK_N=BLOCK_N,
                        DECODE=decode,
                        BIAS=bias,
                        ROW_STEP=row_step,
                        ROW_HALF=row_half,
                        num_warps=NUM_WARPS,
                    )
                    first += tiles
                launch(
                    add_splits,
                    (rows, -(-size_n // SUM_BLOCK)),
                    partial,
                    partial.stride(0),
                    partial.stride(1),
                    destination[row_base:],
                    out,
                    out.stride(0),
                    size_n,
                    SPLITS=splits,
                    BLOCK=SUM_BLOCK,
                )
    except _launch_errors() as error:
        _give_up(error)
        return None
    return out


FINISH_BLOCK = 1024
"""Columns of one program of the kernel that finishes the output rows."""

_FINISH_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Bias and routing-weight types :func:`finish_rows` converts (exactly, as ``.to(torch.float32)`` does)."""


def finish_rows(
    gemm: torch.Tensor,
    row_experts: torch.Tensor,
    bias: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor] | None:
    """The output rows from the product rows in one launch: ``(total, bias rows, row weights, written)`` with
    ``total = (gemm + bias rows) · row weights`` as the kernel orders them. ``row_experts`` (int64 per row, −1 where
    no block writes the row), ``bias`` the stored ``[E, N]`` Marlin-order bias (or None), ``topk_weights`` read flat
    by row, NaN past their end (None: weight 1 for written rows). All on ``gemm``'s device; the values
    :func:`~moereplay.reference.marlin_moe.reference_moe_wna16_marlin_gemm`'s torch operations give, bit for bit.
    None where the kernel does not apply (another bias or weight type, another device) or cannot run; no sync."""
    device = gemm.device
    rows, size_n = gemm.shape
    for tensor in (bias, topk_weights):
        if tensor is not None and (tensor.dtype not in _FINISH_DTYPES or tensor.device != device):
            return None
    if not available(device) or not gemm.is_contiguous() or rows == 0:
        return None
    total = torch.empty_like(gemm)
    bias_rows = torch.empty_like(gemm) if bias is not None else None
    row_weights = torch.empty(rows, dtype=torch.float32, device=device)
    written = torch.empty(rows, dtype=torch.bool, device=device)
    # read flat in logical order (a strided tensor as its copy); never read without weights
    weights = topk_weights.reshape(-1).contiguous() if topk_weights is not None else row_weights
    try:
        from moereplay.reference.marlin_rows_kernel import finish_rows as kernel

        with _current(device):
            launch(
                kernel,
                (rows, -(-size_n // FINISH_BLOCK)),
                gemm,
                row_experts,
                bias if bias is not None else gemm,
                bias.stride(0) if bias is not None else 0,
                bias.stride(1) if bias is not None else 0,
                _bias_columns(size_n, device) if bias is not None else row_experts,
                weights,
                weights.numel(),
                total,
                bias_rows if bias_rows is not None else total,
                row_weights,
                written,
                size_n,
                HAS_BIAS=bias is not None,
                MUL_WEIGHTS=topk_weights is not None,
                BLOCK=FINISH_BLOCK,
            )
    except _launch_errors() as error:
        _give_up(error)
        return None
    return total, bias_rows, row_weights, written


@functools.cache
def _bias_columns(size_n: int, device: torch.device) -> torch.Tensor:
    """int64 ``[N]``: the stored (Marlin-order) column of each logical bias column."""
    return layout.unpermute_bias(torch.arange(size_n)).to(device)


_SCALE_LAYOUTS: dict[tuple[object, ...], tuple[torch.Tensor | None, torch.Tensor]] = {}
"""Device copies of :meth:`MarlinExpertWeights.scale_layout`, by what it depends on (and the device)."""


def _scale_parts(
    weights: MarlinExpertWeights,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, float]:
    """:meth:`MarlinExpertWeights.scale_layout` (kept per format, dtype, groups, N and device) and the experts'
    multipliers as :meth:`MarlinExpertWeights.scale_multiplier_parts` (the kernel multiplies the two), on the
    weights' device; no launch, no sync."""
    device = weights.b_qweight.device
    key = (weights.format, weights.activation_dtype, weights.num_groups, weights.size_n, device)
    if key not in _SCALE_LAYOUTS:
        table, columns = weights.scale_layout()
        _SCALE_LAYOUTS[key] = (None if table is None else table.to(device)), columns.to(device)
    table, columns = _SCALE_LAYOUTS[key]
    return table, columns, *weights.scale_multiplier_parts()
