"""Non-finite values a call was given: where the NaN/Inf of an output come from when the kernel is not at fault.

When a call's output holds NaN or Inf and the exact fp32 reference makes the same ones from the same arguments,
the kernel computed what it was given. The question left is *which* input carries them: a poisoned expert's
weight scales, an activation row a previous layer already broke, a NaN bias. This module scans every argument a
kernel reads (the op's contracts name them, opaque arguments' tensors included under their paths) as the kernel
reads it — a ``uint8`` scale tensor whose contract accepts ``float8_e8m0fnu`` is e8m0, where the byte 0xff is NaN;
fp8 e4m3 has NaN at 0x7f/0xff — and says which slices of dimension 0 hold them when the contract says what that
dimension indexes (experts, or rows). Outputs and scratch buffers are not inputs and are skipped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moereplay.ops.base import Args, OpSpec, TensorContract, contract_args, reads
from moereplay.replay.findings import Finding, FindingKind
from moereplay.wording import row_ranges

_FLOAT8 = tuple(
    dtype
    for dtype in (
        getattr(torch, "float8_e4m3fn", None),
        getattr(torch, "float8_e5m2", None),
        getattr(torch, "float8_e8m0fnu", None),
        getattr(torch, "float8_e4m3fnuz", None),
        getattr(torch, "float8_e5m2fnuz", None),
    )
    if dtype is not None
)

# elements scanned at once: bounds the float32 copy a scan makes of a large weight
_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class InputFault:
    """Non-finite values in one argument, as the kernel reads its bytes.

    ``meaning``: the dtype the bytes were decoded as (``float8_e8m0fnu`` for e8m0 scales stored as ``uint8``).
    ``leading``: what dimension 0 indexes (``"expert"``, ``"row"``) when the contract says; ``indices`` then lists
    the slices holding non-finite values, of ``extent``.
    """

    arg: str
    meaning: torch.dtype
    stored: torch.dtype
    nan: int
    inf: int
    total: int
    leading: str | None = None
    indices: tuple[int, ...] = ()
    extent: int = 0
    used: tuple[int, ...] | None = None

    @property
    def count(self) -> int:
        return self.nan + self.inf

    @property
    def reaches(self) -> bool:
        """Whether the call reads the bad values: an expert-indexed fault only through an expert the call routes
        rows to, a row-indexed one only through a row it reads (``used``: those of ``indices``; ``None``: not
        known, so it may)."""
        return self.leading is None or self.used is None or bool(self.used)

    def describe(self) -> str:
        if self.meaning == torch.float8_e8m0fnu:
            what = f"{self.nan:,} bytes 0xff (e8m0's NaN code; a kernel may upcast it to +Inf)"
        else:
            what = _kinds(self.nan, self.inf)
            if self.meaning != self.stored:
                what += f" ({_dtype_name(self.stored)} bytes read as {_dtype_name(self.meaning)})"
        text = f"{self.arg} holds {what} of {self.total:,}"
        if not self.leading or not self.indices:
            return text
        shown = self.indices if not self.used else self.used
        text += f", in {_noun(self.leading, shown)} {row_ranges(shown, limit=8)} of {self.extent}"
        unused = [i for i in self.indices if self.used and i not in self.used]
        if unused:
            text += (
                f" (and {_noun(self.leading, unused)} {row_ranges(unused, limit=8)}, {_unread(self.leading)})"
            )
        return text

    def unread(self) -> str:
        """Why a fault that does not reach the output is not the cause."""
        return _unread(self.leading)

    def as_evidence(self) -> dict[str, Any]:
        return {
            "argument": self.arg,
            "read_as": _dtype_name(self.meaning),
            "stored_as": _dtype_name(self.stored),
            "nan": self.nan,
            "inf": self.inf,
            "elements": self.total,
            "leading": self.leading,
            "indices": list(self.indices),
            "extent": self.extent,
            "reaches_output": self.reaches,
        }


def _unread(leading: str | None) -> str:
    if leading == "expert":
        return "to which no row of this call is routed"
    return "which this call does not read"


def _noun(leading: str, indices: Sequence[int]) -> str:
    return leading if len(indices) == 1 else leading + "s"


def _kinds(nan: int, inf: int) -> str:
    parts = [f"{nan:,} NaN" if nan else "", f"{inf:,} Inf" if inf else ""]
    return " and ".join(part for part in parts if part)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_WIDE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _can_be_nonfinite(dtype: torch.dtype | None) -> bool:
    """A format with NaN or Inf codes (4-bit float formats have none; packed formats are not elements)."""
    return dtype is not None and (dtype in _WIDE or dtype in _FLOAT8)


def meaning_of(contract: TensorContract, tensor: torch.Tensor, args: Args) -> torch.dtype | None:
    """The number format the kernel decodes ``tensor``'s bytes as, or ``None`` when the scan may claim nothing:
    the contract's ``values`` rule when it has one (``uint8`` scale storage read as e8m0; Marlin's re-encoded
    NVFP4 scales: none); else what the kernel reads the pointer as (``read_as``) when that is a float format of
    the tensor's element size (the tensor's own dtype when there is no rule). A tensor the kernel reads as
    another type of another size (bf16 routing weights read as float32) is the contract finding's case, not
    this one's: no claim."""
    try:
        if contract.values is not None:
            meaning = contract.values(args)
        else:
            read = contract.read_as(args)
            meaning = tensor.dtype if read is None else read
    except Exception:  # a rule that cannot judge this call claims nothing
        return None
    if meaning is None or not _can_be_nonfinite(meaning):
        return None
    if torch.empty((), dtype=meaning).element_size() != tensor.element_size():
        return None
    return meaning


def _row_counts(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row NaN and Inf counts of a ``[rows, elements]`` block of a decoded tensor."""
    wide = rows if rows.dtype == torch.float64 else rows.float()
    return torch.isnan(wide).sum(dim=1), torch.isinf(wide).sum(dim=1)


def scan(arg: str, tensor: torch.Tensor, meaning: torch.dtype, leading: str | None) -> InputFault | None:
    """The non-finite values of ``tensor`` decoded as ``meaning`` (``None`` when there are none), counted per
    slice of dimension 0 in blocks of about ``_CHUNK_ELEMENTS``: where the tensor lives, a block at a time (only
    a block is ever widened or, for a strided view, copied)."""
    data = tensor.detach()
    if data.dtype != meaning:
        data = data.view(meaning)  # the same element size (meaning_of): a view, strided or not
    if data.dim() == 0:
        data = data.reshape(1)
    per_row = max(data[0].numel(), 1) if data.shape[0] else 1
    step = max(1, _CHUNK_ELEMENTS // per_row)
    nan = inf = 0
    indices: list[int] = []
    for start in range(0, data.shape[0], step):
        block = data[start : start + step]
        block_nan, block_inf = _row_counts(block.reshape(block.shape[0], -1))
        nan += int(block_nan.sum())
        inf += int(block_inf.sum())
        hit = torch.nonzero((block_nan + block_inf) > 0).flatten().tolist()
        indices.extend(int(i) + start for i in hit)
    if not nan and not inf:
        return None
    keep = leading is not None
    return InputFault(
        arg,
        meaning,
        tensor.dtype,
        nan,
        inf,
        data.numel(),
        leading if keep else None,
        tuple(indices) if keep else (),
        int(data.shape[0]) if keep else 0,
    )


def scan_inputs(op: OpSpec, args: Args) -> list[InputFault]:
    """Every argument the kernel reads that holds NaN or Inf as the kernel decodes it, in contract order."""
    merged = contract_args(op, args)
    outputs = {op.output_name, *op.scratch}
    known = reads(op, args)
    faults = []
    for contract in op.contracts:
        root = contract.arg.split(".", 1)[0].split("[", 1)[0]
        if root in outputs:
            continue
        tensor = merged.get(contract.arg)
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            continue
        try:
            if not contract.read_by_kernel(args):
                continue
        except Exception:  # a flag rule that cannot judge this call: scan it anyway
            pass
        meaning = meaning_of(contract, tensor, args)
        if meaning is None:
            continue
        try:
            fault = scan(contract.arg, tensor, meaning, contract.leading)
        except RuntimeError:  # out of device memory, a cast the device lacks: the host can do it
            fault = scan(contract.arg, tensor.detach().cpu(), meaning, contract.leading)
        used = {"expert": known.experts, "row": known.rows}.get(fault.leading or "") if fault else None
        if fault is not None and used is not None:
            fault = dataclasses.replace(fault, used=tuple(i for i in fault.indices if i in used))
        if fault is not None:
            faults.append(fault)
    return faults


def given_nonfinite(
    faults: Sequence[InputFault],
    *,
    nan: int,
    inf: int,
    rows: Sequence[int],
    reference_overflows: bool,
    variant: str,
) -> Finding:
    """The diagnosis for an output whose NaN/Inf the exact reference makes too: the inputs that carry them, or,
    none reaching the output, the exact fp32 computation's own overflow (``reference_overflows``: the reference
    is ±Inf where the output is not finite) or a NaN made inside it from finite values."""
    made = _kinds(nan, inf)
    evidence: dict[str, Any] = {"blame": "caller", "nan": nan, "inf": inf}
    if faults:
        evidence["inputs"] = [fault.as_evidence() for fault in faults]
    reaching = [fault for fault in faults if fault.reaches]
    aside = "".join(
        f"; not the cause: {fault.describe()}, {fault.unread()}" for fault in faults if not fault.reaches
    )
    if reaching:
        evidence["cause"] = "inputs"
        message = (
            f"caller: the exact fp32 reference makes the same {made} from this call's arguments, so the kernel "
            f"computed what it was given — " + "; ".join(fault.describe() for fault in reaching) + aside
        )
        return Finding(FindingKind.DIAGNOSIS, message, variant, evidence, rows=tuple(rows))
    evidence["cause"] = "overflow" if reference_overflows else "computation"
    if reference_overflows:
        message = (
            f"caller: the exact fp32 reference makes the same {made}; no value the kernel reads for this call's "
            "rows is one, but the exact computation overflows float32 there: the inputs' magnitudes, not the "
            "kernel" + aside
        )
    else:
        message = (
            f"caller: the exact fp32 reference makes the same {made}; no value the kernel reads for this call's "
            "rows is one, so they arise inside the exact computation from finite values (Inf − Inf or 0 · Inf "
            "after an overflow)" + aside
        )
    return Finding(FindingKind.DIAGNOSIS, message, variant, evidence, rows=tuple(rows), confidence=0.8)
