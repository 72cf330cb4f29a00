"""The one extension point: what an op module declares about a kernel family.

An op module (``moereplay/ops/<family>.py``) builds one object satisfying :class:`OpSpec` and registers it
with :func:`moereplay.ops.register_op`. Everything the capture plugin, the replay engine, the findings and the
TUI know about a kernel comes from that object:

- ``name``: the op name its records carry (where vLLM calls it — patch points per vLLM release, codecs, process
  state — is the family's torch-free declaration, :mod:`moereplay.ops.surface`);
- ``arguments``: the argument schema, in the kernel's positional order (tensor / scalar / flag / enum / opaque);
- ``mutable``: which arguments a replay may change, each with a legal :class:`Domain`;
- ``derived`` and ``rederive``: arguments computed from others (recomputed when an input they depend on changes);
- ``contracts``: for each tensor argument, the dtype the *kernel* reads it as, its shape, contiguity and device,
  and whether the host code checks it or silently reinterprets the bytes;
- ``scratch`` and ``make_scratch``: the buffers every replay variant must get fresh (outputs, zeroed workspaces);
- ``run(args, backend)``: call the real kernel; ``reference(args)``: an exact fp32 answer needing no kernel;
- ``output_name`` and the reference's :class:`RowMap`: what each output row means (token / expert / slot);
- optionally ``reference_ignores``: a frozenset of arguments that do not change the reference's answer (thread
  configs, workspaces, block sizes whose derived ids are re-derived) so replay reuses one reference across them;
- optionally ``derivation_inputs``: a frozenset of every argument ``rederive`` reads (the derived arguments'
  dependencies and whatever else it derives them from), so replay keys re-derived arguments by those alone and a
  sweep over launch flags re-derives the routing once per block size, not once per variant;
- optionally ``error_allowance(args, reference, output_dtype)`` (a rounding allowance for launch modes that round
  partial sums, :mod:`moereplay.reference.tolerance`) and ``error_allowance_key(args)``: the hashable launch values
  it reads among ``reference_ignores`` (replay caches allowances by the reference's key plus this);
- optionally, for ops whose opaque arguments hold tensors: ``tensor_leaves(args) -> {path: tensor}``,
  ``replace_tensor_leaves(args, {path: tensor}) -> args`` (replay guards every leaf, not only top-level tensors),
  ``contract_args(args) -> {name or path: value}`` (the arguments plus every leaf, as contracts and findings name
  them) and ``check(args, *, check_device) -> [ContractViolation]`` (contracts over the leaves).
  :func:`tensor_leaves`, :func:`replace_tensor_leaves`, :func:`contract_args` and :func:`contract_violations` fall
  back to top-level tensors, the arguments themselves and ``check_contracts`` for ops without them;
- optionally ``recorded_args(args) -> args``: the arguments as the op's schema names them, from what the capture
  wrapper recorded (the launcher's own signature) — e.g. a launch ``config`` dict split into one pseudo-argument per
  setting so replay can mutate them; must be idempotent (replay hands decoded calls back through it);
- optionally ``output_rows(output) -> tensor``: a recorded output laid out as the reference's ``[rows, cols]``
  (an op whose output buffer splits rows over several dimensions);
- optionally, for the shape bisection: ``shape_dimensions(args) -> [(name, legal values, original)]`` and
  ``shrink(args, {name: value}) -> args`` (a valid call of that shape), and ``shape_legal({name: value}) -> bool``;
- optionally, for the fidelity check (why a replay is not bit-exact with the recording): ``run_state() ->
  {key: value}`` (plain JSON: the process state the last ``run`` used — e.g. the opt_flags triton_kernels chose),
  ``recorded_state(outputs, context) -> {key: value} | None`` (the same keys as the recorded call ran them, from
  its non-tensor outputs and context), ``state_pins``: a mapping state key → mutable argument that pins it in a
  replay; and ``rederive_routing(args) -> args`` (the routing metadata — offsets, tile maps, inverse indices —
  recomputed from the routing itself, to test recorded metadata against it).

Argument values, as the replay engine hands them to an op (``Args``, a name → value mapping):
tensors are ``torch.Tensor``; scalars ``int``/``float``; flags ``bool``; enums their integer id (e.g. a vLLM
``ScalarType.id``), converted to the library object inside ``run``; opaque values whatever their codec decodes.

Nothing here imports vLLM: an op module imports the kernel only inside ``run``, through the backend.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from moereplay.errors import InvalidMutationError

Args = Mapping[str, Any]
"""Argument name → value, as described in the module docstring."""


# --------------------------------------------------------------------------------------------------------------
# argument schema
# --------------------------------------------------------------------------------------------------------------


class ArgKind(enum.Enum):
    """How an argument is recorded and replayed."""

    TENSOR = "tensor"
    SCALAR = "scalar"  # int or float
    FLAG = "flag"  # bool
    ENUM = "enum"  # an integer id of a library enum object (codec converts object <-> id)
    OPAQUE = "opaque"  # a structured object with a codec (triton_kernels RoutingData, PrecisionConfig, ...)


@runtime_checkable
class ValueCodec(Protocol):
    """Converts a library object to plain, recordable data and back.

    ``encode`` runs in the serving process (must be cheap, never pickle): it returns msgpack-able data whose leaves
    may be ``torch.Tensor`` (the format stores those as tensor blobs). ``decode`` runs at replay time and may need
    the backend's library modules (``backend.module("vllm.scalar_type")``); with ``backend=None`` it returns a
    plain stand-in good enough for the reference.
    """

    @property
    def name(self) -> str: ...

    def encode(self, value: Any) -> Any: ...

    def decode(self, data: Any, *, backend: KernelBackend | None) -> Any: ...


@dataclass(frozen=True)
class ArgSpec:
    """One argument of the kernel call, in positional order.

    ``optional`` means ``None`` is a legal value. ``codec`` is required for ENUM and OPAQUE kinds.
    ``default`` (with ``has_default=True``) fills a trailing argument a capture of an older vLLM lacks.
    """

    name: str
    kind: ArgKind
    optional: bool = False
    description: str = ""
    codec: ValueCodec | None = None
    default: Any = None
    has_default: bool = False

    def __post_init__(self) -> None:
        if self.kind in (ArgKind.ENUM, ArgKind.OPAQUE) and self.codec is None:
            raise ValueError(f"argument {self.name!r} of kind {self.kind.value} needs a codec")


# --------------------------------------------------------------------------------------------------------------
# legal domains of mutable arguments
# --------------------------------------------------------------------------------------------------------------


@runtime_checkable
class Domain(Protocol):
    """The legal values of a mutable argument, possibly depending on the rest of the call.

    ``check`` returns ``None`` when legal, else a one-line reason naming the rule (shown as verdict ``invalid``).
    ``parse`` turns CLI text into a value of the right Python type (raises ``InvalidMutationError``).
    ``candidates`` enumerates the legal values for sweeps when the domain is finite, else ``None``.
    """

    def check(self, value: Any, args: Args) -> str | None: ...

    def parse(self, text: str) -> Any: ...

    def candidates(self, args: Args) -> tuple[Any, ...] | None: ...

    def describe(self) -> str: ...


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise InvalidMutationError(f"{text!r} is not a boolean (use true/false, 1/0)")


def parse_int(text: str) -> int:
    try:
        return int(text.strip(), 0)
    except ValueError as error:
        raise InvalidMutationError(f"{text!r} is not an integer") from error


@dataclass(frozen=True)
class BoolDomain:
    """``True`` or ``False``."""

    def check(self, value: Any, args: Args) -> str | None:
        return None if isinstance(value, bool) else f"{value!r} is not a bool"

    def parse(self, text: str) -> bool:
        return parse_bool(text)

    def candidates(self, args: Args) -> tuple[Any, ...]:
        return (False, True)

    def describe(self) -> str:
        return "bool"


@dataclass(frozen=True)
class ChoiceDomain:
    """One of a finite set of integers (e.g. the block sizes a kernel is compiled for)."""

    values: tuple[int, ...]
    why: str = ""

    def check(self, value: Any, args: Args) -> str | None:
        if isinstance(value, bool) or value not in self.values:
            reason = f"{value!r} is not one of {', '.join(map(str, self.values))}"
            return f"{reason} ({self.why})" if self.why else reason
        return None

    def parse(self, text: str) -> int:
        return parse_int(text)

    def candidates(self, args: Args) -> tuple[Any, ...]:
        return self.values

    def describe(self) -> str:
        return "{" + ", ".join(map(str, self.values)) + "}"


@dataclass(frozen=True)
class IntRangeDomain:
    """An integer in ``[low, high]`` (inclusive; ``None`` = open), optionally a multiple of ``multiple_of``.

    ``extra`` values are legal besides the range (e.g. ``-1`` for "let the kernel choose").
    """

    low: int | None = None
    high: int | None = None
    multiple_of: int = 1
    extra: tuple[int, ...] = ()

    def check(self, value: Any, args: Args) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{value!r} is not an integer"
        if value in self.extra:
            return None
        if self.low is not None and value < self.low:
            return f"{value} < {self.low}"
        if self.high is not None and value > self.high:
            return f"{value} > {self.high}"
        if value % self.multiple_of:
            return f"{value} is not a multiple of {self.multiple_of}"
        return None

    def parse(self, text: str) -> int:
        return parse_int(text)

    def candidates(self, args: Args) -> tuple[Any, ...] | None:
        if self.low is None or self.high is None or (self.high - self.low) // self.multiple_of > 4096:
            return None
        start = -(-self.low // self.multiple_of) * self.multiple_of
        return self.extra + tuple(range(start, self.high + 1, self.multiple_of))

    def describe(self) -> str:
        parts = [f"[{'' if self.low is None else self.low}, {'' if self.high is None else self.high}]"]
        if self.multiple_of != 1:
            parts.append(f"multiple of {self.multiple_of}")
        if self.extra:
            parts.append("or " + ", ".join(map(str, self.extra)))
        return " ".join(parts)


@dataclass(frozen=True)
class Rule:
    """A condition on (value, whole call): ``holds(value, args)`` must be true, else ``reason`` applies.

    ``reason`` may use ``{value}`` and any argument name as ``str.format`` fields.
    """

    holds: Callable[[Any, Args], bool]
    reason: str


@dataclass(frozen=True)
class PredicateDomain:
    """A base domain narrowed by rules that depend on the rest of the call (e.g. ``thread_k`` divides ``size_k``)."""

    base: Domain
    rules: tuple[Rule, ...]

    def check(self, value: Any, args: Args) -> str | None:
        reason = self.base.check(value, args)
        if reason is not None:
            return reason
        for rule in self.rules:
            if not rule.holds(value, args):
                fields = {k: v for k, v in args.items() if not isinstance(v, torch.Tensor)}
                try:
                    return rule.reason.format(value=value, **fields)
                except (KeyError, IndexError, ValueError):
                    return rule.reason
        return None

    def parse(self, text: str) -> Any:
        return self.base.parse(text)

    def candidates(self, args: Args) -> tuple[Any, ...] | None:
        base = self.base.candidates(args)
        if base is None:
            return None
        return tuple(v for v in base if self.check(v, args) is None)

    def describe(self) -> str:
        return self.base.describe() + " with rules: " + "; ".join(rule.reason for rule in self.rules)


@dataclass(frozen=True)
class MutableArg:
    """An argument a replay may change, and its legal domain."""

    name: str
    domain: Domain
    description: str = ""


@dataclass(frozen=True)
class DerivedArg:
    """An argument computed from others; ``rederive`` recomputes it when any of ``depends_on`` changes."""

    name: str
    depends_on: tuple[str, ...]
    description: str = ""


# --------------------------------------------------------------------------------------------------------------
# contracts: what the kernel actually reads
# --------------------------------------------------------------------------------------------------------------

DtypeRule = Callable[[Args], "torch.dtype | None"]
"""The dtype the kernel reads an argument as, given the call (None: no rule for this call)."""

ShapeRule = Callable[[Args], "tuple[int | None, ...] | None"]
"""The expected shape given the call (``None`` dims are free; ``None`` overall: no rule for this call)."""

NumelRule = Callable[[Args], "int | None"]
"""The element count the kernel indexes given the call (``None``: no rule), for arguments read as flat arrays."""


ContractAspect = Literal["dtype", "shape", "contiguity", "device", "presence"]


def fixed_dtype(dtype: torch.dtype) -> DtypeRule:
    """A dtype rule that is the same for every call."""
    return lambda args: dtype


def dtype_of(argument: str) -> DtypeRule:
    """A dtype rule "the same dtype as ``argument``" (e.g. the bias is read as the activation type)."""

    def rule(args: Args) -> torch.dtype | None:
        value = args.get(argument)
        return value.dtype if isinstance(value, torch.Tensor) else None

    return rule


@dataclass(frozen=True)
class TensorContract:
    """How the kernel reads one tensor argument.

    ``read_as``: the element type the device code uses for the pointer. ``accepted``: dtypes whose bytes mean the
    right thing for that reader (usually just ``read_as``; e.g. int32 ids read as int32). ``host_checked``: the host
    code rejects a wrong dtype with an error; if ``False`` a wrong dtype is *silently reinterpreted*, which is
    exactly the class of bug a contract finding must name. ``host_checks``: optionally, every aspect the host code
    checks (shape, contiguity …), when it checks more than the dtype. ``required``: ``None`` is illegal.
    ``contiguous``: the kernel indexes the storage densely from ``data_ptr`` (row-major, no gaps). ``read_when``:
    whether the kernel reads the argument at all under this call's flags (e.g. Marlin reads ``topk_weights`` only
    with ``mul_topk_weights``); when it says no, the contract holds whatever was passed — nothing is checked
    (``None``: read whenever present). ``leading``: what dimension 0 of the tensor indexes (``"expert"`` for
    per-expert weights, scales and biases; ``"row"`` for activations), so a finding can say which experts or rows
    hold a bad value (``None``: nothing in particular). ``values``: the number format whose NaN/Inf codes the
    kernel's reading of these bytes can hold, for the scan of non-finite inputs (e8m0 for ``uint8`` scale bytes;
    ``None`` from the rule: the bytes hold no such code, e.g. Marlin's re-encoded NVFP4 scales); without a rule,
    the tensor's own dtype when it is a floating one.
    """

    arg: str
    read_as: DtypeRule
    host_checked: bool
    accepted: Callable[[Args], tuple[torch.dtype, ...]] | None = None
    shape: ShapeRule | None = None
    numel: NumelRule | None = None
    contiguous: bool = True
    device: Literal["cuda", "any"] = "cuda"
    required: bool = True
    note: str = ""
    host_checks: frozenset[ContractAspect] | None = None
    read_when: Callable[[Args], bool] | None = None
    leading: Literal["expert", "row"] | None = None
    values: DtypeRule | None = None

    def read_by_kernel(self, args: Args) -> bool:
        """Whether this call makes the kernel read the argument (see ``read_when``)."""
        return self.read_when is None or bool(self.read_when(args))

    def checked_by_host(self, aspect: ContractAspect) -> bool:
        """Whether the host code rejects a call breaking ``aspect`` (``host_checks`` when given; else the dtype per
        ``host_checked``, and device and presence always)."""
        if self.host_checks is not None:
            return aspect in self.host_checks
        return aspect in ("device", "presence") or (aspect == "dtype" and self.host_checked)

    def accepted_dtypes(self, args: Args) -> tuple[torch.dtype, ...]:
        if self.accepted is not None:
            return self.accepted(args)
        dtype = self.read_as(args)
        return () if dtype is None else (dtype,)


@dataclass(frozen=True)
class ContractViolation:
    """A captured (or mutated) call breaks a contract; ``consequence`` says what the kernel does with it.

    ``reads_past_end``: bytes the kernel is predicted to read beyond the tensor's last byte (a wider dtype read
    over the same elements, fewer elements than it indexes, rows shorter than its unmasked loads), ``None`` when
    the violation predicts no such read. Such a call's output may depend on memory outside its tensors
    (:attr:`predicts_memory_dependence`), which replay tests by varying the guard bytes after every tensor.
    """

    arg: str
    aspect: ContractAspect
    expected: str
    actual: str
    host_checked: bool
    consequence: str
    reads_past_end: int | None = None

    def __post_init__(self) -> None:
        if self.reads_past_end is not None and self.reads_past_end < 0:
            raise ValueError(f"reads_past_end {self.reads_past_end} is negative")

    @property
    def predicts_memory_dependence(self) -> bool:
        """The kernel runs (the host code lets the call through) and reads bytes past the tensor's end."""
        return not self.host_checked and bool(self.reads_past_end)

    def describe(self) -> str:
        return (
            f"{self.arg}: {self.aspect} is {self.actual}, kernel expects {self.expected} — {self.consequence}"
        )


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "?" if dtype is None else str(dtype).removeprefix("torch.")


def check_contract(
    contract: TensorContract, args: Args, *, check_device: bool = True
) -> list[ContractViolation]:
    """All ways ``args[contract.arg]`` breaks ``contract`` (empty when it holds, or when the call's flags make the
    kernel leave the argument unread). Cheap: metadata only."""
    if not contract.read_by_kernel(args):
        return []
    value = args.get(contract.arg)
    name = contract.arg
    host = contract.checked_by_host

    def rejected_or(consequence: str, aspect: ContractAspect) -> str:
        return "the host code rejects the call" if host(aspect) else consequence

    if value is None:
        if contract.required:
            return [
                ContractViolation(
                    name, "presence", "a tensor", "None", host("presence"), "the kernel needs it"
                )
            ]
        return []
    if not isinstance(value, torch.Tensor):
        return [ContractViolation(name, "presence", "a tensor", type(value).__name__, True, "not a tensor")]
    violations: list[ContractViolation] = []
    accepted = contract.accepted_dtypes(args)
    read_size = _read_size(contract, args, value)
    if accepted and value.dtype not in accepted:
        read_as = contract.read_as(args)
        past_end = None
        if read_as is not None and read_as.itemsize > value.element_size():
            past_end = value.numel() * (read_as.itemsize - value.element_size())
        if read_as is not None and read_as.itemsize != value.element_size():
            consequence = (
                f"the kernel silently reads these {value.element_size()}-byte {_dtype_name(value.dtype)} "
                f"bytes as {read_as.itemsize}-byte {_dtype_name(read_as)} values (wrong values, and reads "
                f"{'past the end' if read_as.itemsize > value.element_size() else 'only part'} of the data)"
            )
        else:
            consequence = f"the kernel silently reads the {_dtype_name(value.dtype)} bytes as {_dtype_name(read_as)} values"
        violations.append(
            ContractViolation(
                name,
                "dtype",
                " or ".join(_dtype_name(d) for d in accepted),
                _dtype_name(value.dtype),
                host("dtype"),
                rejected_or(consequence, "dtype"),
                past_end,
            )
        )
    if contract.shape is not None:
        expected = contract.shape(args)
        if expected is not None:
            actual = tuple(value.shape)
            matches = len(expected) == len(actual) and all(
                e is None or e == a for e, a in zip(expected, actual, strict=True)
            )
            if not matches:
                shown = "(" + ", ".join("*" if e is None else str(e) for e in expected) + ")"
                indexed = _elements_indexed(expected, actual)
                short = None if indexed is None or indexed <= value.numel() else indexed - value.numel()
                violations.append(
                    ContractViolation(
                        name,
                        "shape",
                        shown,
                        str(actual),
                        host("shape"),
                        rejected_or(
                            "the kernel indexes by the expected shape: misplaced or out-of-bounds accesses",
                            "shape",
                        ),
                        None if short is None else short * read_size,
                    )
                )
    if contract.numel is not None:
        expected_numel = contract.numel(args)
        if expected_numel is not None and value.numel() != expected_numel:
            short = value.numel() < expected_numel
            violations.append(
                ContractViolation(
                    name,
                    "shape",
                    f"{expected_numel} elements",
                    f"{value.numel()} elements",
                    host("shape"),
                    rejected_or(
                        "the kernel indexes it as a flat array of that length: "
                        + ("it reads past the end" if short else "extra elements are ignored"),
                        "shape",
                    ),
                    (expected_numel - value.numel()) * read_size if short else None,
                )
            )
    if contract.contiguous and not value.is_contiguous():
        violations.append(
            ContractViolation(
                name,
                "contiguity",
                "contiguous",
                f"strides {tuple(value.stride())}",
                host("contiguity"),
                rejected_or(
                    "the kernel indexes densely from data_ptr and reads the wrong elements", "contiguity"
                ),
            )
        )
    if check_device and contract.device == "cuda" and value.device.type != "cuda":
        violations.append(
            ContractViolation(
                name, "device", "cuda", str(value.device), host("device"), "the host code rejects the call"
            )
        )
    return violations


def _read_size(contract: TensorContract, args: Args, value: torch.Tensor) -> int:
    """Bytes per element as the kernel reads them (its ``read_as`` dtype, else the tensor's own)."""
    read_as = contract.read_as(args)
    return read_as.itemsize if read_as is not None else value.element_size()


def _elements_indexed(expected: tuple[int | None, ...], actual: tuple[int, ...]) -> int | None:
    """Elements a kernel indexes by the expected shape (free dimensions as the tensor has them); ``None`` when the
    ranks differ (nothing to say about the extent)."""
    if len(expected) != len(actual):
        return None
    count = 1
    for wanted, have in zip(expected, actual, strict=True):
        count *= have if wanted is None else wanted
    return count


def check_contracts(
    contracts: Iterable[TensorContract], args: Args, *, check_device: bool = True
) -> list[ContractViolation]:
    """Every contract violation of a call, in contract order."""
    violations: list[ContractViolation] = []
    for contract in contracts:
        violations.extend(check_contract(contract, args, check_device=check_device))
    return violations


# --------------------------------------------------------------------------------------------------------------
# the reference answer and what output rows mean
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowMap:
    """What each output row is: int64 tensors of length ``rows``; ``-1`` where a row has no such meaning."""

    token: torch.Tensor
    expert: torch.Tensor
    slot: torch.Tensor
    block: torch.Tensor

    def __post_init__(self) -> None:
        lengths = {t.shape[0] for t in (self.token, self.expert, self.slot, self.block)}
        if len(lengths) != 1:
            raise ValueError("RowMap fields must have one length")

    @property
    def rows(self) -> int:
        return int(self.token.shape[0])

    def describe(self, row: int) -> str:
        parts = [f"row {row}"]
        for label, values in (("token", self.token), ("slot", self.slot), ("expert", self.expert)):
            value = int(values[row])
            if value >= 0:
                parts.append(f"{label} {value}")
        return " ".join(parts[:1]) + (" (" + ", ".join(parts[1:]) + ")" if len(parts) > 1 else "")


@dataclass(frozen=True)
class CoefficientSource:
    """Where the kernel should take a term's per-row coefficient from.

    Row ``r`` should be multiplied by ``args[arg].flatten()[index[r]]`` read as ``read_as`` (``index[r] = -1``:
    coefficient 1, not read from memory). The findings use this to test "another row's weight", "zero" and
    "these bytes read as another dtype" explanations of a wrong fitted coefficient.
    """

    arg: str
    index: torch.Tensor
    read_as: torch.dtype
    applies: bool = True  # False: the call asks the kernel NOT to apply it (coefficient 1 expected)


@dataclass(frozen=True)
class ReferenceResult:
    """An exact answer for one call, with its ingredients so a wrong output can be decomposed.

    ``output``: fp32 ``[rows, cols]``, the value every written row should have. ``written``: bool ``[rows]``, rows
    the kernel writes (others: compare nothing). ``terms``: name → fp32 ``[rows, cols]`` ingredient whose
    coefficient-weighted sum is ``output`` (e.g. ``"gemm"``: the unweighted product, ``"bias"``: the bias row).
    ``coefficients``: name → fp32 ``[rows]`` coefficient expected for each term. ``sources``: optional, where the
    kernel reads each coefficient from (see :class:`CoefficientSource`). ``scales``: optional, name → fp32 ``[rows]``
    per-row factors the kernel applies somewhere (e.g. NVFP4's per-expert global scale), so the findings can test
    "this scale was applied to the wrong term".
    """

    output: torch.Tensor
    written: torch.Tensor
    rows: RowMap
    terms: Mapping[str, torch.Tensor] = field(default_factory=dict)
    coefficients: Mapping[str, torch.Tensor] = field(default_factory=dict)
    sources: Mapping[str, CoefficientSource] = field(default_factory=dict)
    scales: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.output.dim() != 2:
            raise ValueError("reference output must be 2-D [rows, cols]")
        if self.written.shape != (self.output.shape[0],) or self.rows.rows != self.output.shape[0]:
            raise ValueError("written / row map must have one entry per output row")
        if set(self.terms) != set(self.coefficients):
            raise ValueError("every term needs its expected coefficients")


# --------------------------------------------------------------------------------------------------------------
# backends and the op protocol
# --------------------------------------------------------------------------------------------------------------


@runtime_checkable
class KernelBackend(Protocol):
    """Where an op's real kernel comes from: the installed vLLM, or a kernel pack.

    ``module(name)`` imports a module of that vLLM (``"vllm._custom_ops"``) — from the pack when the backend is
    one. ``device`` is where tensors must live for ``run``.
    """

    @property
    def name(self) -> str: ...

    @property
    def device(self) -> torch.device: ...

    def module(self, name: str) -> types.ModuleType: ...


@runtime_checkable
class OpSpec(Protocol):
    """Everything moereplay knows about one kernel family (see the module docstring)."""

    @property
    def name(self) -> str: ...

    @property
    def arguments(self) -> tuple[ArgSpec, ...]: ...

    @property
    def mutable(self) -> tuple[MutableArg, ...]: ...

    @property
    def derived(self) -> tuple[DerivedArg, ...]: ...

    @property
    def contracts(self) -> tuple[TensorContract, ...]: ...

    @property
    def scratch(self) -> tuple[str, ...]: ...

    @property
    def output_name(self) -> str: ...

    def rederive(self, args: Args, changed: frozenset[str]) -> dict[str, Any]:
        """``args`` with every derived argument that depends on ``changed`` recomputed (a new dict)."""
        ...

    def make_scratch(self, args: Args, device: torch.device) -> dict[str, Any]:
        """Fresh replacements for ``scratch`` arguments, sized for this call and this device, zeroed as the kernel
        expects (lock counters 0, output zeroed)."""
        ...

    def run(self, args: Args, backend: KernelBackend) -> torch.Tensor:
        """Call the real kernel; returns the output tensor (``args[output_name]`` when one was passed)."""
        ...

    def reference(self, args: Args) -> ReferenceResult:
        """The exact fp32 answer for this call, with its ingredients. Needs no kernel; runs on any device."""
        ...


def argument_names(op: OpSpec) -> tuple[str, ...]:
    return tuple(spec.name for spec in op.arguments)


def argument_spec(op: OpSpec, name: str) -> ArgSpec:
    for spec in op.arguments:
        if spec.name == name:
            return spec
    raise InvalidMutationError(
        f"{op.name} has no argument {name!r} (arguments: {', '.join(argument_names(op))})"
    )


def mutable_arg(op: OpSpec, name: str) -> MutableArg | None:
    for candidate in op.mutable:
        if candidate.name == name:
            return candidate
    return None


def derived_names(op: OpSpec) -> frozenset[str]:
    return frozenset(d.name for d in op.derived)


def positional(op: OpSpec, args: Args) -> list[Any]:
    """The call's arguments in the kernel's positional order (defaults filled for missing trailing ones)."""
    values: list[Any] = []
    for spec in op.arguments:
        if spec.name in args:
            values.append(args[spec.name])
        elif spec.has_default:
            values.append(spec.default)
        else:
            raise InvalidMutationError(f"{op.name} call lacks argument {spec.name!r}")
    return values


def tensor_leaves(op: OpSpec, args: Args) -> dict[str, torch.Tensor]:
    """Every tensor of a call by path: the op's ``tensor_leaves`` hook, else the top-level tensor arguments."""
    hook = getattr(op, "tensor_leaves", None)
    if hook is not None:
        leaves: dict[str, torch.Tensor] = hook(args)
        return leaves
    return {name: value for name, value in args.items() if isinstance(value, torch.Tensor)}


def replace_tensor_leaves(op: OpSpec, args: Args, replacements: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """``args`` with the tensors at the given paths swapped (the op's hook, else top-level names)."""
    hook = getattr(op, "replace_tensor_leaves", None)
    if hook is not None:
        replaced: dict[str, Any] = hook(args, replacements)
        return replaced
    return {**args, **replacements}


def contract_args(op: OpSpec, args: Args) -> dict[str, Any]:
    """``args`` plus every tensor inside opaque arguments under its path (the op's ``contract_args`` hook), so a
    contract or a coefficient source may name ``precision_config.weight_scale.storage`` like ``x``."""
    hook = getattr(op, "contract_args", None)
    if hook is not None:
        merged: dict[str, Any] = hook(args)
        return merged
    return dict(args)


@dataclass(frozen=True)
class Reads:
    """What a call reads for its rows: the experts whose weights it uses and the rows of its row-indexed inputs
    (the activation ``[rows, K]``); ``None`` where the op cannot say. A bad value elsewhere cannot reach the
    output."""

    experts: frozenset[int] | None = None
    rows: frozenset[int] | None = None


def reads(op: OpSpec, args: Args) -> Reads:
    """The op's ``reads`` hook (see :class:`Reads`); nothing known when it has none or cannot read the call."""
    hook = getattr(op, "reads", None)
    if hook is None:
        return Reads()
    try:
        found = hook(args)
    except Exception:  # a call the hook cannot read: no claim either way
        return Reads()
    return found if isinstance(found, Reads) else Reads()


def tokens_by_activation_rows(token: torch.Tensor, activation: Any, batch: int) -> torch.Tensor | None:
    """The layer's token of each output row for an op whose row map's ``token`` is a row of its activation
    ``[rows, K]`` and whose activation is token-major: ``batch`` tokens (the layer's padded batch) of
    ``rows // batch`` rows each — the layer's hidden states (one row a token) or its intermediate ``[tokens ·
    top_k, N]`` (row ``token · top_k + k``). ``-1`` stays -1 (no token); None when the activation's rows are not
    a multiple of ``batch`` (the call is not one of that batch's)."""
    if not isinstance(activation, torch.Tensor) or activation.dim() != 2 or batch < 1:
        return None
    rows = int(activation.shape[0])
    if rows < batch or rows % batch:
        return None
    per_token = rows // batch
    token = token.to(torch.int64)
    return torch.where(token >= 0, torch.div(token, per_token, rounding_mode="floor"), -1)


def layer_tokens(op: OpSpec, args: Args, rows: RowMap, batch: int) -> torch.Tensor | None:
    """The op's ``layer_tokens`` hook: per output row the token of the layer's ``batch``-token batch it belongs to
    (``-1``: none), or None when the op has no hook or cannot say for this call."""
    hook = getattr(op, "layer_tokens", None)
    if hook is None:
        return None
    try:
        found = hook(args, rows, batch)
    except Exception:  # a call the hook cannot read: no claim
        return None
    if not isinstance(found, torch.Tensor) or found.shape != (rows.rows,):
        return None
    return found


def _scalar_int(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        return int(value.reshape(-1)[0]) if value.numel() else None
    return value if isinstance(value, int) else None


def block_reads(
    sorted_ids: Any,
    expert_ids: Any,
    padded_rows: Any,
    block: Any,
    valid: int | None,
    top_k: Any,
    *,
    partial_block: bool,
) -> Reads:
    """:class:`Reads` of a block-sorted launch (Marlin, vLLM's Triton fused MoE) — ``rows`` are the activation's
    (a routing-weight tensor read flat by row id is not indexed by them): block ``b`` runs when it starts
    below ``padded_rows`` (``partial_block``: a block that starts below it runs whole, Triton's test; else only
    whole blocks, Marlin's ``padded_rows // block``), with expert ``expert_ids[b]`` (``-1``: skipped), on the row
    ids ``sorted_ids[b·block:(b+1)·block]`` below ``valid``; row id ``i`` reads input row ``i // top_k``."""
    padded, k = _scalar_int(padded_rows), top_k if isinstance(top_k, int) and top_k > 0 else None
    if not isinstance(expert_ids, torch.Tensor) or not isinstance(block, int) or block <= 0 or padded is None:
        return Reads()
    blocks = -(-max(padded, 0) // block) if partial_block else max(padded, 0) // block
    experts = expert_ids.reshape(-1)[:blocks].to("cpu", torch.long)
    running = experts >= 0
    used = frozenset(int(e) for e in experts[running].tolist())
    if not isinstance(sorted_ids, torch.Tensor) or valid is None or k is None:
        return Reads(used, None)
    ids = sorted_ids.reshape(-1).to("cpu", torch.long)[: experts.numel() * block]
    keep = running.repeat_interleave(block)[: ids.numel()] & (ids >= 0) & (ids < valid)
    return Reads(used, frozenset((ids[keep] // k).tolist()))


def contract_violations(op: OpSpec, args: Args, *, check_device: bool = True) -> list[ContractViolation]:
    """Every contract violation of a call: the op's ``check`` hook, else :func:`check_contracts`."""
    hook = getattr(op, "check", None)
    if hook is not None:
        violations: list[ContractViolation] = hook(args, check_device=check_device)
        return violations
    return check_contracts(op.contracts, args, check_device=check_device)
