"""The first check of a replay's mutation texts, made before torch is imported (well under a second).

``moereplay run FILE --flip topk_weights`` should fail on the typo at once, not after a second of imports. This
reads the op names of the file's calls (record headers only) and the mutable argument names each family declares
in its torch-free surface (:attr:`moereplay.ops.surface.FamilySurface.mutable_names`), and rejects a ``flip``,
``set`` or ``sweep`` of a name that no kernel op of the file declares mutable; and a ``cast`` of a name that no
kernel call of the file has among its recorded arguments, or to a dtype name ``--cast`` does not know
(:data:`CAST_DTYPES`). Everything else — values, flags versus integers, whether a cast argument is a tensor,
fills, ops a ``python:`` backend brings — is left to the full check against the OpSpecs
(:func:`moereplay.replay.engine.check_mutations`), which runs next; this one only ever rejects what that one
would reject too, with the same words for a dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from moereplay.errors import InvalidMutationError

_NAMED_KINDS = ("flip", "set", "sweep")

CAST_DTYPES = frozenset({
    "float32", "fp32", "float", "float64", "fp64", "float16", "fp16", "half", "bfloat16", "bf16", "int64", "int32",
    "int", "int16", "int8", "uint8", "float8_e4m3fn", "fp8", "float8_e5m2", "float8_e8m0fnu",
})  # fmt: skip
"""The dtype names ``--cast`` takes (``torch.`` prefix and case aside): the keys of
``moereplay.replay.mutations``' dtype table, named here without torch (a test holds the two equal)."""


def unknown_dtype(text: str) -> str | None:
    """The full check's words for a dtype name ``--cast`` does not know, or None when it knows it."""
    if text.strip().lower().removeprefix("torch.") in CAST_DTYPES:
        return None
    return f"unknown dtype {text!r} (known: {', '.join(sorted(CAST_DTYPES))})"


def check_casts(arguments: dict[str, set[str]], mutations: Sequence[str]) -> None:
    """Raise :class:`InvalidMutationError` for a ``cast`` of a name none of ``arguments``' ops (op → its calls'
    recorded argument names) has, or to an unknown dtype — in the order the full check meets them."""
    for text in mutations:
        kind, _, rest = text.strip().partition(" ")
        if kind.removeprefix("--") != "cast":
            continue
        for part in rest.split("+"):
            name, sep, value = part.partition("=")
            name, value = name.strip(), value.strip()
            if not sep or not name or not value:
                return  # malformed: the full check words it
            if arguments and not any(name in names for names in arguments.values()):
                listing = "; ".join(
                    f"{op}: {', '.join(sorted(names))}" for op, names in sorted(arguments.items())
                )
                raise InvalidMutationError(
                    f"--cast {name}: no call's op has an argument {name!r} ({listing})"
                )
            problem = unknown_dtype(value)
            if problem is not None:
                raise InvalidMutationError(problem)


def mutated_names(text: str) -> tuple[str, list[str]]:
    """``(kind, argument names)`` of one mutation text (``"flip a+b"``, ``"set a=1+b=2"``, ``"sweep a=1,2"``);
    no names for other kinds or malformed texts (the full check words those errors)."""
    kind, _, rest = text.strip().partition(" ")
    kind = kind.removeprefix("--")
    if kind not in _NAMED_KINDS:
        return kind, []
    names = []
    for part in rest.split("+"):
        name = part.partition("=")[0].strip() if kind != "flip" else part.strip()
        if name:
            names.append(name)
    return kind, names


def check_names(ops: Iterable[str], mutations: Sequence[str]) -> None:
    """Raise :class:`InvalidMutationError` for a flipped, set or swept name that none of ``ops`` declares
    mutable. Silent when some op has no declaration (its OpSpec is the judge)."""
    from moereplay.ops.surface import mutable_names

    declared: dict[str, tuple[str, ...]] = {}
    for op in sorted(set(ops)):
        declaration = mutable_names(op)
        if declaration is None:
            return
        declared[op] = declaration
    if not declared:
        return
    allowed = {name for names in declared.values() for name in names}
    for text in mutations:
        kind, mutated = mutated_names(text)
        for name in mutated:
            if name not in allowed:
                listing = "; ".join(f"{op}: {', '.join(names) or 'none'}" for op, names in declared.items())
                raise InvalidMutationError(
                    f"--{kind} {name}: no call's op declares {name} mutable ({listing})"
                )


def check_file(path: str | Path, mutations: Sequence[str], call: Sequence[int] | None = None) -> None:
    """:func:`check_names` against the kernel ops of the calls in ``path`` (layer calls are not mutated; a
    record-only op is not replayed), or of the chosen call(s) ``call`` alone. Silent when the file holds an op
    no family declares (a ``python:`` backend may bring it), when a chosen call is not a kernel call of the file, or
    when the file cannot be read: the selection's and the reader's own errors say those first."""
    chosen = list(call) if call else None
    casts = any(text.strip().removeprefix("--").startswith("cast ") for text in mutations)
    if not casts and not any(mutated_names(text)[1] for text in mutations):
        return
    from moereplay.errors import MoereplayError
    from moereplay.format import CaptureReader
    from moereplay.ops.surface import families

    kernel: set[str] = set()
    other: set[str] = set()
    for family in families():
        kernel.update(family.kernel_ops)
        other.update(family.parent_ops, family.record_only_ops)
    ops: set[str] = set()
    arguments: dict[
        str, set[str]
    ] = {}  # kernel op -> its calls' recorded argument names (one pass, no records kept)
    try:
        with CaptureReader(path) as reader:
            if chosen is not None and any(index not in reader.indices for index in chosen):
                return
            for record in reader.calls() if chosen is None else [reader.call(index) for index in chosen]:
                ops.add(record.op)
                if record.op in kernel:
                    arguments.setdefault(record.op, set()).update(record.args)
    except MoereplayError:
        return
    if chosen is not None and not ops <= kernel:
        return
    if any(op not in kernel and op not in other for op in ops):
        return
    check_names((op for op in ops if op in kernel), mutations)
    check_casts(arguments, mutations)
