"""Mutations: one change to a captured call, and the variants they make.

A :class:`Variant` is a set of mutations applied together; the baseline is the empty variant. The CLI makes one
variant per option (``--flip A``, ``--set A=V``, ``--cast A=DTYPE``, ``--fill BYTE``); ``+`` joins several changes
of one kind into one variant (``--set thread_k=128+thread_n=64``) and ``--sweep A=v1,v2[+B=w1,w2]`` zips the value
lists into one variant per position.

Two kinds of wrong input are kept apart on purpose:
- a malformed mutation, an unknown argument, or one the op does not declare mutable is a usage error
  (:class:`~moereplay.errors.InvalidMutationError`, exit 2);
- a well-formed mutation whose value leaves the op's legal domain yields a variant with verdict ``invalid`` and the
  domain's reason (:func:`apply_variant` returns it) — never a pass.

Each mutation has a canonical text form (``Mutation.spec``) that :func:`parse_spec` reads back: it is how variants
travel to the worker process and into JSON reports.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moereplay.errors import InvalidMutationError, ReplayError
from moereplay.ops.base import ArgKind, Args, OpSpec, argument_spec, derived_names, mutable_arg
from moereplay.replay.memo import ArgsCache, args_key

# --------------------------------------------------------------------------------------------------------------
# fill patterns for guard bands
# --------------------------------------------------------------------------------------------------------------

_NAN_BITS: dict[torch.dtype, bytes] = {
    torch.float32: (0x7FC00000).to_bytes(4, "little"),
    torch.float64: (0x7FF8000000000000).to_bytes(8, "little"),
    torch.float16: (0x7E00).to_bytes(2, "little"),
    torch.bfloat16: (0x7FC0).to_bytes(2, "little"),
    torch.float8_e4m3fn: bytes([0x7F]),
    torch.float8_e5m2: bytes([0x7F]),
    torch.float8_e8m0fnu: bytes([0xFF]),
}


@dataclass(frozen=True)
class FillPattern:
    """What guard bands are filled with: one byte value repeated, or ``nan`` (each dtype's quiet NaN; 0xff bytes
    for integer and packed types, whose bytes have no NaN)."""

    byte: int | None

    def __post_init__(self) -> None:
        if self.byte is not None and not 0 <= self.byte <= 0xFF:
            raise InvalidMutationError(f"fill byte {self.byte} is outside 0x00..0xff")

    @property
    def name(self) -> str:
        return "nan" if self.byte is None else f"0x{self.byte:02x}"

    def element_bytes(self, dtype: torch.dtype) -> bytes:
        """The bytes of one element of ``dtype`` filled with this pattern."""
        if self.byte is not None:
            return bytes([self.byte]) * dtype.itemsize
        return _NAN_BITS.get(dtype, b"\xff" * dtype.itemsize)

    def pattern(self, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        """``nbytes`` (a multiple of the dtype's size) of pattern as a CPU uint8 tensor."""
        unit = self.element_bytes(dtype)
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        if nbytes % len(unit):
            raise ValueError(f"{nbytes} bytes is not a whole number of {dtype} elements")
        return torch.frombuffer(bytearray(unit * (nbytes // len(unit))), dtype=torch.uint8)


DEFAULT_FILL = FillPattern(0x00)
"""Guard fill of the baseline and of variants that do not set one: zeros, like freshly cleared memory."""


def parse_fill(text: str) -> FillPattern:
    lowered = text.strip().lower()
    if lowered == "nan":
        return FillPattern(None)
    try:
        value = int(lowered, 16) if lowered.startswith("0x") else int(lowered, 10)
    except ValueError as error:
        raise InvalidMutationError(f"fill {text!r} is not a byte (0x00..0xff) or 'nan'") from error
    return FillPattern(value)


# --------------------------------------------------------------------------------------------------------------
# dtype names for --cast
# --------------------------------------------------------------------------------------------------------------

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "fp64": torch.float64,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "float8_e8m0fnu": torch.float8_e8m0fnu,
}


def parse_dtype(text: str) -> torch.dtype:
    key = text.strip().lower().removeprefix("torch.")
    dtype = _DTYPE_ALIASES.get(key)
    if dtype is None:
        raise InvalidMutationError(f"unknown dtype {text!r} (known: {', '.join(sorted(_DTYPE_ALIASES))})")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------------------------
# mutations
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Flip:
    """Negate a flag."""

    arg: str

    @property
    def spec(self) -> str:
        return f"flip {self.arg}"


@dataclass(frozen=True)
class SetValue:
    """Set a scalar, flag or enum argument to a value (already parsed by the argument's domain)."""

    arg: str
    value: Any

    @property
    def spec(self) -> str:
        value = str(self.value).lower() if isinstance(self.value, bool) else str(self.value)
        return f"set {self.arg}={value}"


@dataclass(frozen=True)
class Cast:
    """Convert a tensor argument's values to another dtype (``tensor.to(dtype)``: same values, new bytes)."""

    arg: str
    dtype: torch.dtype

    @property
    def spec(self) -> str:
        return f"cast {self.arg}={dtype_name(self.dtype)}"


@dataclass(frozen=True)
class Fill:
    """Fill every guard band with another pattern (out-of-bounds reads then see other values)."""

    pattern: FillPattern

    @property
    def spec(self) -> str:
        return f"fill {self.pattern.name}"


@dataclass(frozen=True)
class Rederive:
    """Recompute the call's routing metadata from its routing (the op's ``rederive_routing``): tests whether the
    recorded metadata is what the routing implies."""

    what: str = "routing"

    @property
    def spec(self) -> str:
        return f"rederive {self.what}"


Mutation = Flip | SetValue | Cast | Fill | Rederive


@dataclass(frozen=True)
class Variant:
    """Mutations applied together to the captured call. The empty variant is the baseline."""

    mutations: tuple[Mutation, ...] = ()
    label: str = ""

    def __post_init__(self) -> None:
        if not self.label:
            object.__setattr__(self, "label", "; ".join(m.spec for m in self.mutations) or "baseline")

    @property
    def is_baseline(self) -> bool:
        return not self.mutations

    @property
    def specs(self) -> tuple[str, ...]:
        return tuple(m.spec for m in self.mutations)

    @property
    def fill(self) -> FillPattern:
        fills = [m.pattern for m in self.mutations if isinstance(m, Fill)]
        return fills[-1] if fills else DEFAULT_FILL


BASELINE = Variant()


def _split_arg_value(text: str, option: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise InvalidMutationError(f"--{option} expects ARG=VALUE, got {text!r}")
    return name.strip(), value.strip()


def _checked_arg(op: OpSpec, name: str, option: str) -> None:
    spec = argument_spec(op, name)  # raises for unknown names
    if name in derived_names(op):
        raise InvalidMutationError(
            f"--{option} {name}: {name} is derived by {op.name} from other arguments; mutate what it derives from"
        )
    if option in ("flip", "set", "sweep") and mutable_arg(op, name) is None:
        mutable = ", ".join(m.name for m in op.mutable) or "none"
        raise InvalidMutationError(
            f"--{option} {name}: {op.name} does not declare {name} mutable (mutable: {mutable})"
        )
    if option == "flip" and spec.kind is not ArgKind.FLAG:
        raise InvalidMutationError(f"--flip {name}: {name} is a {spec.kind.value}, not a flag; use --set")
    if option == "cast" and spec.kind is not ArgKind.TENSOR:
        raise InvalidMutationError(f"--cast {name}: {name} is a {spec.kind.value}, not a tensor")


def _parse_value(op: OpSpec, name: str, text: str) -> Any:
    mutable = mutable_arg(op, name)
    assert mutable is not None
    return mutable.domain.parse(text)


def parse_option(op: OpSpec, option: str, text: str) -> list[Variant]:
    """Variants made by one CLI option (``flip``, ``set``, ``cast``, ``fill`` or ``sweep``) and its value — or by
    ``rederive routing`` (API only)."""
    parts = [part.strip() for part in text.split("+")]
    if any(not part for part in parts):
        raise InvalidMutationError(f"--{option} {text!r}: empty part around '+'")
    if option == "flip":
        mutations: list[Mutation] = []
        for name in parts:
            _checked_arg(op, name, "flip")
            mutations.append(Flip(name))
        return [Variant(tuple(mutations))]
    if option == "set":
        mutations = []
        for part in parts:
            name, value = _split_arg_value(part, "set")
            _checked_arg(op, name, "set")
            mutations.append(SetValue(name, _parse_value(op, name, value)))
        return [Variant(tuple(mutations))]
    if option == "cast":
        mutations = []
        for part in parts:
            name, value = _split_arg_value(part, "cast")
            _checked_arg(op, name, "cast")
            mutations.append(Cast(name, parse_dtype(value)))
        return [Variant(tuple(mutations))]
    if option == "rederive":
        if parts != ["routing"]:
            raise InvalidMutationError(f"rederive {text!r}: only 'rederive routing' is known")
        if getattr(op, "rederive_routing", None) is None:
            raise InvalidMutationError(f"{op.name} declares no routing metadata to re-derive")
        return [Variant((Rederive(),))]
    if option == "fill":
        if len(parts) != 1:
            raise InvalidMutationError("--fill takes one pattern per option; repeat --fill for more")
        return [Variant((Fill(parse_fill(parts[0])),))]
    if option == "sweep":
        columns: list[tuple[str, list[Any]]] = []
        for part in parts:
            name, values = _split_arg_value(part, "sweep")
            _checked_arg(op, name, "sweep")
            items = [v.strip() for v in values.split(",")]
            if any(not v for v in items):
                raise InvalidMutationError(f"--sweep {part!r}: empty value in the list")
            columns.append((name, [_parse_value(op, name, v) for v in items]))
        lengths = {len(values) for _, values in columns}
        if len(lengths) != 1:
            raise InvalidMutationError(f"--sweep {text!r}: zipped value lists must have one length")
        count = lengths.pop()
        return [Variant(tuple(SetValue(name, values[i]) for name, values in columns)) for i in range(count)]
    raise InvalidMutationError(f"unknown mutation option --{option}")


def parse_spec(op: OpSpec, spec: str) -> Mutation:
    """Read back one ``Mutation.spec`` (``"flip A"``, ``"set A=V"``, ``"cast A=DT"``, ``"fill 0xff"``,
    ``"rederive routing"``)."""
    kind, _, rest = spec.strip().partition(" ")
    if kind not in ("flip", "set", "cast", "fill", "rederive") or not rest:
        raise InvalidMutationError(f"malformed mutation {spec!r}")
    variants = parse_option(op, kind, rest.strip())
    (variant,) = variants
    (mutation,) = variant.mutations
    return mutation


def variant_from_specs(op: OpSpec, specs: Sequence[str], label: str = "") -> Variant:
    return Variant(tuple(parse_spec(op, spec) for spec in specs), label)


def sweep_domain(op: OpSpec, name: str, args: Args) -> list[Variant]:
    """One variant per legal value of ``name`` for this call (finite domains only)."""
    _checked_arg(op, name, "sweep")
    mutable = mutable_arg(op, name)
    assert mutable is not None
    candidates = mutable.domain.candidates(args)
    if candidates is None:
        raise InvalidMutationError(
            f"{name}'s domain ({mutable.domain.describe()}) is not finite; list values"
        )
    return [Variant((SetValue(name, value),)) for value in candidates]


# --------------------------------------------------------------------------------------------------------------
# applying a variant
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AppliedVariant:
    """A variant's arguments, or why the variant is outside the op's domain (``invalid_reason``)."""

    variant: Variant
    args: dict[str, Any]
    changed: frozenset[str]
    fill: FillPattern
    invalid_reason: str | None = None
    notes: tuple[str, ...] = field(default=())


def apply_variant(
    op: OpSpec, args: Args, variant: Variant, *, derived_cache: ArgsCache[dict[str, Any]] | None = None
) -> AppliedVariant:
    """Apply ``variant`` to a copy of ``args``, check every changed argument's domain against the *final* call
    (rules may relate arguments, e.g. ``thread_k`` with ``thread_n``), then re-derive derived arguments.

    Tensors are not copied unless cast. Cost: one ``rederive`` when a dependency changed — none when
    ``derived_cache`` (see :mod:`moereplay.replay.memo`) already holds it for these arguments (all of them, or the
    op's ``derivation_inputs`` when it declares them); the derived tensors are then shared between variants
    (nothing writes them: kernels get guarded copies).
    """
    new_args = dict(args)
    changed: set[str] = set()
    for mutation in variant.mutations:
        if isinstance(mutation, Fill):
            continue
        if isinstance(mutation, Rederive):
            hook = getattr(op, "rederive_routing", None)
            if hook is None:
                missing = f"{op.name} declares no routing metadata to re-derive"
                return AppliedVariant(variant, new_args, frozenset(changed), variant.fill, missing)
            try:
                new_args = dict(hook(new_args))
            except (InvalidMutationError, ReplayError) as error:
                return AppliedVariant(variant, new_args, frozenset(changed), variant.fill, str(error))
            changed.add("routing")
            continue
        if isinstance(mutation, Flip):
            current = new_args.get(mutation.arg)
            if not isinstance(current, bool):
                return AppliedVariant(
                    variant,
                    new_args,
                    frozenset(changed),
                    variant.fill,
                    f"{mutation.arg} is {current!r} in this call, not a bool",
                )
            new_args[mutation.arg] = not current
            changed.add(mutation.arg)
        elif isinstance(mutation, SetValue):
            new_args[mutation.arg] = mutation.value
            changed.add(mutation.arg)
        elif isinstance(mutation, Cast):
            current = new_args.get(mutation.arg)
            if not isinstance(current, torch.Tensor):
                return AppliedVariant(
                    variant,
                    new_args,
                    frozenset(changed),
                    variant.fill,
                    f"{mutation.arg} is {'None' if current is None else type(current).__name__} in this call; "
                    "nothing to cast",
                )
            new_args[mutation.arg] = current.to(mutation.dtype)
            changed.add(mutation.arg)
    for name in sorted(changed):
        mutable = mutable_arg(op, name)
        if mutable is None:
            continue  # casts need no domain: contracts judge them
        reason = mutable.domain.check(new_args[name], new_args)
        if reason is not None:
            return AppliedVariant(
                variant, new_args, frozenset(changed), variant.fill, f"{name}={new_args[name]!r}: {reason}"
            )
    frozen_changed = frozenset(changed)
    if any(frozen_changed & set(derived.depends_on) for derived in op.derived):
        new_args = _rederive(op, new_args, frozen_changed, derived_cache)
    return AppliedVariant(variant, new_args, frozen_changed, variant.fill)


def _rederive(
    op: OpSpec, args: dict[str, Any], changed: frozenset[str], cache: ArgsCache[dict[str, Any]] | None
) -> dict[str, Any]:
    if cache is None:
        return op.rederive(args, changed)
    inputs: frozenset[str] | None = getattr(op, "derivation_inputs", None)
    if inputs is None:
        key, pins = args_key(args)
        full_key = (key, tuple(sorted(changed)))
    else:  # rederive reads only ``inputs``, and of ``changed`` only what a derived argument depends on
        key, pins = args_key({name: args[name] for name in inputs if name in args})
        depends = {name for derived in op.derived for name in derived.depends_on}
        full_key = (key, tuple(sorted(changed & depends)))
    made = cache.get(full_key)
    if made is None:
        result = op.rederive(args, changed)
        made = {name: value for name, value in result.items() if name not in args or value is not args[name]}
        if len(result) != len(args) or any(name not in result for name in args):
            return result  # a rederive that drops arguments is not a delta: no caching
        cache.put(full_key, pins, made)
    return {**args, **made}


def expand(variants: Iterable[Variant]) -> list[Variant]:
    """Variants in order, duplicates (same mutation specs) removed."""
    seen: set[tuple[str, ...]] = set()
    result: list[Variant] = []
    for variant in variants:
        if variant.specs in seen:
            continue
        seen.add(variant.specs)
        result.append(variant)
    return result


_MUTATION_KINDS = ("flip", "set", "cast", "fill", "sweep", "rederive")


def parse_variants(
    op: OpSpec, mutations: Sequence[str | Variant], fills: Sequence[str | FillPattern] = ()
) -> list[Variant]:
    """Variants from mutation texts (``"flip mul_topk_weights"``, ``"sweep moe_block_size=8,16"`` …), Variant
    objects and fill patterns, in order, without duplicates and without the baseline."""
    variants: list[Variant] = []
    for item in mutations:
        if isinstance(item, Variant):
            variants.append(item)
            continue
        kind, _, rest = item.strip().partition(" ")
        if kind.startswith("--"):
            kind = kind[2:]
        if kind not in _MUTATION_KINDS or not rest.strip():
            raise InvalidMutationError(
                f"mutation {item!r}: expected one of {', '.join(_MUTATION_KINDS)} and a value"
            )
        variants.extend(parse_option(op, kind, rest.strip()))
    for fill in fills:
        pattern = fill if isinstance(fill, FillPattern) else parse_fill(fill)
        variants.append(Variant((Fill(pattern),)))
    return [variant for variant in expand(variants) if not variant.is_baseline]


def is_fill_only(variant: Variant) -> bool:
    """A variant that only changes the guard fill (its story is the output's dependence on guard bytes)."""
    return bool(variant.mutations) and all(isinstance(m, Fill) for m in variant.mutations)
