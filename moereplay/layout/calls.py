"""Finding the calls of one fused MoE layer in a capture: gemm1 (w13), gemm2 (w2) and their parent, if recorded.

A layer is named by any of its calls:

- a parent record (any family's parent op, :func:`moereplay.ops.surface.parent_ops`): its two kernel children,
  in call order;
- a kernel call with a parent: that parent's layer;
- a kernel call without one: it and the neighbouring call of the same op and layer that completes the pair, as the
  op's family tells gemm1 from gemm2 and which pairs fit (``FamilySurface.first_gemm`` / ``pair_fits``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moereplay.errors import ReplayError
from moereplay.ops.surface import layer_family, parent_ops
from moereplay.wording import plural

PARENT_OPS = parent_ops()


@dataclass(frozen=True)
class LayerCalls:
    """Indices of one layer's calls; ``parent`` is None when the capture has no parent record for it.
    ``family``: the name of the kernel family (:class:`moereplay.ops.surface.FamilySurface`)."""

    family: str
    gemm1: int
    gemm2: int
    parent: int | None


def _family(op: str) -> str | None:
    family = layer_family(op)
    return None if family is None else family.name


def _is_first(record: Any) -> bool:
    """Whether a kernel call is its layer's gemm1 (w13), from recorded metadata only."""
    family = layer_family(record.op)
    return family is not None and family.first_gemm is not None and family.first_gemm(record.args)


def _pair_fits(first: Any, second: Any) -> bool:
    if first.op != second.op or not _is_first(first) or _is_first(second):
        return False
    family = layer_family(first.op)
    return family is not None and (family.pair_fits is None or family.pair_fits(first.args, second.args))


def find_layer(reader: Any, call: int) -> LayerCalls:
    """The layer ``call`` belongs to (see the module docstring); :class:`ReplayError` when none can be formed."""
    if call not in reader.indices:
        raise ReplayError(f"{reader.path}: no call {call} (the file holds {plural(len(reader), 'call')})")
    record = reader.call(call)
    parent = call if record.op in PARENT_OPS else record.parent
    if parent is not None and parent in reader.indices and reader.call(parent).op in PARENT_OPS:
        children = [r for r in reader.calls() if r.parent == parent and _family(r.op) is not None]
        if len(children) < 2:
            raise ReplayError(
                f"{reader.path}: the layer of call {parent} ({reader.call(parent).op}) has "
                f"{plural(len(children), 'recorded kernel call')}; the layout probe needs gemm1 and gemm2 — "
                f"run `moereplay expand {reader.path} -o OUT` first and probe the expanded layer in OUT"
            )
        first, second = children[0], children[1]
        family = _family(first.op)
        assert family is not None
        return LayerCalls(family, first.index, second.index, parent)
    family = _family(record.op)
    if family is None:
        raise ReplayError(
            f"{reader.path}: call {call} is a {record.op}, neither a fused MoE parent nor a layer GEMM of a known family"
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
