"""The argument tree of one call: its recorded values, the op's schema around them, and contract violations.

:func:`argument_nodes` turns a :class:`~moereplay.format.CallRecord` (metadata only, no tensor bytes) and the op's
declarations into plain nodes the tree widget draws. :func:`contract_violations` is the slow half: it loads the
call's arguments through the replay engine's loader and asks the op's contracts (``ops.base.check_contracts``)
what the kernel would read wrongly; the screens run it in a worker and mark the nodes when it answers.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moereplay.format import CallRecord, CodecValue, EnumValue, TensorMeta, Unsupported
from moereplay.format.summary import generated_tensor

if TYPE_CHECKING:
    from moereplay.ops.base import ContractViolation, OpSpec

MAX_CHILDREN = 64
"""Items of a list or map shown before the rest is summarised."""


@dataclass(frozen=True)
class ArgumentNode:
    """One node of the tree: ``label`` (name and short value), ``details`` (key, value) lines, children.

    ``tags``: ``static`` (a weight stored once), ``mutable`` / ``derived`` (from the op), ``aliased by output``,
    ``non-contiguous``. ``violations``: the contract violations about this argument.
    """

    name: str
    kind: str
    value: str
    details: tuple[tuple[str, str], ...] = ()
    children: tuple[ArgumentNode, ...] = ()
    tags: tuple[str, ...] = ()
    violations: tuple[ContractViolation, ...] = field(default=())
    description: str = ""

    @property
    def flagged(self) -> bool:
        return bool(self.violations) or any(child.flagged for child in self.children)


def _tensor(name: str, meta: TensorMeta, tags: list[str]) -> ArgumentNode:
    if not meta.is_contiguous:
        tags.append("non-contiguous")
    details = (
        ("dtype", meta.dtype),
        ("shape", "(" + ", ".join(str(size) for size in meta.shape) + ")"),
        ("stride", "(" + ", ".join(str(stride) for stride in meta.stride) + ")"),
        ("storage offset", str(meta.storage_offset)),
        ("device", meta.device),
        ("storage id", str(meta.storage)),
        ("bytes", f"{meta.nbytes:,}"),
    )
    return ArgumentNode(name, "tensor", meta.describe(), details, tags=tuple(tags))


def _node(name: str, value: Any, tags: list[str]) -> ArgumentNode:
    if isinstance(value, TensorMeta):
        return _tensor(name, value, tags)
    if value is None:
        return ArgumentNode(name, "none", "None", tags=tuple(tags))
    if isinstance(value, bool):
        return ArgumentNode(name, "flag", str(value), tags=tuple(tags))
    if isinstance(value, (int, float)):
        return ArgumentNode(name, "scalar", repr(value), tags=tuple(tags))
    if isinstance(value, str):
        return ArgumentNode(name, "text", repr(value), tags=tuple(tags))
    if isinstance(value, EnumValue):
        return ArgumentNode(
            name, "enum", f"{value.type_name.rsplit('.', 1)[-1]}.{value.name}", tags=tuple(tags)
        )
    if isinstance(value, enum.Enum):
        return ArgumentNode(name, "enum", f"{type(value).__name__}.{value.name}", tags=tuple(tags))
    if isinstance(value, Unsupported):
        return ArgumentNode(
            name,
            "unsupported",
            f"<{value.type_name}> (no codec)",
            (("repr", value.repr_excerpt),),
            tags=tuple(tags),
        )
    if isinstance(value, CodecValue) and (generated := generated_tensor(value)) is not None:
        tree = value.value  # a seeded recipe: the tensor's dtype and shape, generated at load time
        details = (
            ("dtype", str(tree.get("dtype"))),
            ("shape", "(" + ", ".join(str(size) for size in tree.get("shape", ())) + ")"),
            ("stored as", f"{tree.get('generator', '?')} recipe, expanded when loaded"),
            ("codec", value.type_name),
        )
        return ArgumentNode(name, "tensor", generated, details, tags=tuple(tags))
    if isinstance(value, CodecValue):
        inner = _node(name, value.value, [])
        return ArgumentNode(
            name,
            "opaque",
            f"<{value.type_name.rsplit('.', 1)[-1]}>",
            (("codec", value.type_name),),
            inner.children if inner.children else (inner,),
            tuple(tags),
        )
    if isinstance(value, Mapping):
        items = list(value.items())
        children = tuple(_node(str(key), item, []) for key, item in items[:MAX_CHILDREN])
        rest = () if len(items) <= MAX_CHILDREN else (("…", f"{len(items) - MAX_CHILDREN} more"),)
        return ArgumentNode(name, "map", f"{{{len(items)} items}}", rest, children, tuple(tags))
    if isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
        children = tuple(
            _node(f"[{position}]", item, []) for position, item in enumerate(items[:MAX_CHILDREN])
        )
        rest = () if len(items) <= MAX_CHILDREN else (("…", f"{len(items) - MAX_CHILDREN} more"),)
        return ArgumentNode(name, "list", f"[{len(items)} items]", rest, children, tuple(tags))
    return ArgumentNode(name, type(value).__name__, repr(value)[:80], tags=tuple(tags))


def argument_nodes(
    record: CallRecord, op: OpSpec | None, violations: Sequence[ContractViolation] = ()
) -> tuple[ArgumentNode, ...]:
    """One node per argument, in the op's positional order when the op is known (recorded order otherwise)."""
    order = list(record.args)
    descriptions: dict[str, str] = {}
    kinds: dict[str, str] = {}
    mutable: set[str] = set()
    derived: set[str] = set()
    if op is not None:
        declared = [spec.name for spec in op.arguments]
        order = [name for name in declared if name in record.args] + [
            name for name in record.args if name not in declared
        ]
        descriptions = {spec.name: spec.description for spec in op.arguments}
        kinds = {spec.name: spec.kind.value for spec in op.arguments}
        mutable = {m.name for m in op.mutable}
        derived = {d.name for d in op.derived}
    aliased = {path for paths in record.aliases().values() for path in paths}
    by_arg: dict[str, list[ContractViolation]] = {}
    for violation in violations:
        by_arg.setdefault(violation.arg, []).append(violation)
    nodes = []
    for name in order:
        tags = []
        if name in record.static:
            tags.append("static")
        if name in mutable:
            tags.append("mutable")
        if name in derived:
            tags.append("derived")
        if name in aliased:
            tags.append("written in place")
        node = _node(name, record.args[name], tags)
        kind = kinds.get(name, node.kind)
        nodes.append(
            ArgumentNode(
                node.name,
                kind if node.kind != "none" else "none",
                node.value,
                node.details,
                node.children,
                node.tags,
                tuple(by_arg.pop(name, ())),
                descriptions.get(name, ""),
            )
        )
    for name, remaining in by_arg.items():  # violations about arguments the call lacks
        nodes.append(ArgumentNode(name, "missing", "not recorded", violations=tuple(remaining)))
    return tuple(nodes)


def contract_violations(capture: Path, index: int) -> tuple[ContractViolation, ...]:
    """Every contract the call breaks (loads its arguments on the CPU; blocking). Raises ``MoereplayError``."""
    from moereplay.ops.base import check_contracts
    from moereplay.replay.source import load_call

    loaded = load_call(capture, index, "cpu")
    return tuple(check_contracts(loaded.op.contracts, loaded.args, check_device=False))
