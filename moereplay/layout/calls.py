"""Finding the calls of one fused MoE layer in a capture: gemm1 (w13), gemm2 (w2) and their parent, if recorded.

A layer is named by any of its calls:

- a parent record (``fused_marlin_moe``, ``batched_fused_marlin_moe``, ``triton_kernel_fused_experts``,
  ``unfused_oai_triton_experts``): its two kernel children, in call order;
- a kernel call with a parent: that parent's layer;
- a kernel call without one: it and the neighbouring call of the same op and layer that completes the pair —
  Marlin: gemm1 has ``top_k > 1`` rows per token and ``size_n = 2 · gemm2's size_k``, gemm2 ``top_k = 1``;
  ``matmul_ogs``: gemm1 gathers (and fuses the activation), gemm2 scatters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from moereplay.errors import ReplayError
from moereplay.ops.surface import parent_ops

PARENT_OPS = (
    frozenset(
        {
            "fused_marlin_moe",
            "batched_fused_marlin_moe",
            "triton_kernel_fused_experts",
            "unfused_oai_triton_experts",
        }
    )
    | parent_ops()
)
MARLIN = "moe_wna16_marlin_gemm"
OGS = "matmul_ogs"
Family = Literal["marlin", "ogs"]


@dataclass(frozen=True)
class LayerCalls:
    """Indices of one layer's calls; ``parent`` is None when the capture has no parent record for it."""

    family: Family
    gemm1: int
    gemm2: int
    parent: int | None


def _family(op: str) -> Family | None:
    return "marlin" if op == MARLIN else "ogs" if op == OGS else None


def _is_first(record: Any) -> bool:
    """Whether a kernel call is its layer's gemm1 (w13), from recorded metadata only."""
    args = record.args
    if record.op == MARLIN:
        return isinstance(args.get("top_k"), int) and args["top_k"] > 1
    return args.get("gather_indx") is not None or args.get("fused_activation") is not None


def _pair_fits(first: Any, second: Any) -> bool:
    if first.op != second.op or not _is_first(first) or _is_first(second):
        return False
    if first.op == MARLIN:
        size_n, size_k = first.args.get("size_n"), second.args.get("size_k")
        return isinstance(size_n, int) and isinstance(size_k, int) and size_n == 2 * size_k
    return True


def find_layer(reader: Any, call: int) -> LayerCalls:
    """The layer ``call`` belongs to (see the module docstring); :class:`ReplayError` when none can be formed."""
    if call not in reader.indices:
        raise ReplayError(f"{reader.path}: no call {call} (the file holds {len(reader)} calls)")
    record = reader.call(call)
    parent = call if record.op in PARENT_OPS else record.parent
    if parent is not None and parent in reader.indices and reader.call(parent).op in PARENT_OPS:
        children = [r for r in reader.calls() if r.parent == parent and _family(r.op) is not None]
        if len(children) < 2:
            raise ReplayError(
                f"{reader.path}: the layer of call {parent} ({reader.call(parent).op}) has {len(children)} recorded "
                f"kernel calls; the layout probe needs gemm1 and gemm2 — run `moereplay expand {reader.path} -o OUT` "
                "first and probe the expanded layer in OUT"
            )
        first, second = children[0], children[1]
        family = _family(first.op)
        assert family is not None
        return LayerCalls(family, first.index, second.index, parent)
    family = _family(record.op)
    if family is None:
        raise ReplayError(
            f"{reader.path}: call {call} is a {record.op}, neither a fused MoE parent nor a Marlin / matmul_ogs call"
        )
    neighbours = [
        r
        for r in reader.calls()
        if r.op == record.op and r.index != call and str(r.layer) == str(record.layer)
    ]
    if _is_first(record):
        later = [r for r in neighbours if r.index > call and _pair_fits(record, r)]
        if later:
            return LayerCalls(family, call, later[0].index, None)
    else:
        earlier = [r for r in neighbours if r.index < call and _pair_fits(r, record)]
        if earlier:
            return LayerCalls(family, earlier[-1].index, call, None)
    raise ReplayError(
        f"{reader.path}: call {call} has no parent record and no matching {'gemm2' if _is_first(record) else 'gemm1'} "
        "call in its layer; the layout probe needs both GEMMs of one layer"
    )
