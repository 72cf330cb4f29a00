"""A toy op whose tensor hides inside an opaque argument, to test that replay guards every tensor *leaf*.

``toy_boxed_scales``: ``out[r] = (x[r] @ w) * scales.values[r]``, where ``scales`` is a :class:`ScaleBox` — an
opaque argument holding a float32 tensor and ``count``, the number of float32 values the kernel loads from it.
Like the Hopper MXFP4 scale load of triton_kernels' ``matmul_ogs``, the load is unmasked: the kernel reads
``count`` values from the tensor's data pointer and multiplies the ones past the rows by zero weights (added into
the last row) — harmless while they are finite, NaN when the bytes past the end are 0xff. The op declares
``tensor_leaves`` / ``replace_tensor_leaves`` / ``contract_args`` / ``check``, so replay gives ``scales.values``
its own guarded allocation and its contract ("the kernel reads ``count`` values") is checked.

Loaded as a backend with ``python:<this file>#<kernel>``; kernels: ``unmasked`` (the semantics above) and
``oob_write`` (also writes 8 bytes past the end of ``scales.values``). Real computations, not mocks of vLLM's kernels.
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from moereplay.format.codecs import register_codec
from moereplay.ops import register_op
from moereplay.ops.base import (
    ArgKind,
    Args,
    ArgSpec,
    BoolDomain,
    ContractViolation,
    KernelBackend,
    MutableArg,
    ReferenceResult,
    RowMap,
    TensorContract,
    check_contracts,
    fixed_dtype,
)
from moereplay.replay.backends import ModuleBackend

NAME = "toy_boxed_scales"
LEAF = "scales.values"


@dataclass(frozen=True)
class ScaleBox:
    """The opaque argument: per-row scales and how many float32 values the kernel loads from them."""

    values: torch.Tensor
    count: int


def _encode(box: ScaleBox) -> dict[str, Any]:
    return {"values": box.values, "count": box.count}


def _decode(tree: Any) -> ScaleBox:
    return ScaleBox(tree["values"], int(tree["count"]))


register_codec(ScaleBox, _encode, _decode)


@dataclass(frozen=True)
class ScaleBoxCodec:
    """The op's codec: the format already decodes the box; a raw ``CodecValue`` tree is accepted too.

    This file is imported twice in a test process (by the tests, and as the ``python:`` backend file under another
    module name), so a box may arrive as the other import's class: it is re-made as this one's.
    """

    name: str = "replay_opaque_toy.ScaleBox"

    def encode(self, value: Any) -> Any:
        return _encode(value)

    def decode(self, data: Any, *, backend: KernelBackend | None) -> ScaleBox:
        if isinstance(data, ScaleBox):
            return data
        if hasattr(data, "values") and hasattr(data, "count"):  # this file's box, imported under another name
            return ScaleBox(data.values, int(data.count))
        return _decode(getattr(data, "value", data))


def _float32_loads(tensor: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` float32 values from ``tensor``'s data pointer on — past its end if it is shorter (unmasked)."""
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
    start = tensor.storage_offset() * tensor.element_size()
    return raw[start : start + 4 * count].view(torch.float32)


def _kernel(name: str, args: Mapping[str, Any]) -> torch.Tensor:
    x, w, box, out = args["x"], args["w"], args["scales"], args["out"]
    rows = x.shape[0]
    loads = _float32_loads(box.values, box.count)
    result = x @ w
    if args["use_scales"]:
        result = result * loads[:rows].unsqueeze(1)
    extra = loads[rows:]
    result[-1] += (torch.zeros_like(extra) * extra).sum()  # masked-out zero weights × over-read scales
    out.copy_(result)
    if name == "oob_write":
        values = box.values
        raw = torch.empty(0, dtype=torch.uint8).set_(values.untyped_storage())
        end = (values.storage_offset() + values.numel()) * values.element_size()
        raw[end : end + 8] = 0xAB
    return out


def _count_read(args: Args) -> int | None:
    box = args.get("scales")
    return box.count if isinstance(box, ScaleBox) else None


class BoxedScalesOp:
    name = NAME
    arguments = (
        ArgSpec("x", ArgKind.TENSOR),
        ArgSpec("w", ArgKind.TENSOR),
        ArgSpec("scales", ArgKind.OPAQUE, codec=ScaleBoxCodec()),
        ArgSpec("out", ArgKind.TENSOR),
        ArgSpec("use_scales", ArgKind.FLAG),
    )
    mutable = (MutableArg("use_scales", BoolDomain()),)
    derived = ()
    contracts = (
        TensorContract("x", read_as=fixed_dtype(torch.float32), host_checked=True),
        TensorContract(
            LEAF,
            read_as=fixed_dtype(torch.float32),
            host_checked=False,
            numel=_count_read,
            note="loaded unmasked: count values from the data pointer",
        ),
    )
    scratch = ("out",)
    output_name = "out"

    def tensor_leaves(self, args: Args) -> dict[str, torch.Tensor]:
        leaves = {name: value for name, value in args.items() if isinstance(value, torch.Tensor)}
        box = args.get("scales")
        if isinstance(box, ScaleBox):
            leaves[LEAF] = box.values
        return leaves

    def replace_tensor_leaves(self, args: Args, replacements: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        out = {name: replacements.get(name, value) for name, value in args.items()}
        box = args.get("scales")
        if isinstance(box, ScaleBox) and LEAF in replacements:
            out["scales"] = dataclasses.replace(box, values=replacements[LEAF])
        return out

    def contract_args(self, args: Args) -> dict[str, Any]:
        merged = dict(args)
        box = args.get("scales")
        if isinstance(box, ScaleBox):
            merged[LEAF] = box.values
        return merged

    def check(self, args: Args, *, check_device: bool = True) -> list[ContractViolation]:
        return check_contracts(self.contracts, self.contract_args(args), check_device=check_device)

    def rederive(self, args: Args, changed: frozenset[str]) -> dict[str, Any]:
        return dict(args)

    def make_scratch(self, args: Args, device: torch.device) -> dict[str, Any]:
        out = args["out"]
        return {"out": torch.zeros(out.shape, dtype=out.dtype, device=device)}

    def run(self, args: Args, backend: KernelBackend) -> torch.Tensor:
        return backend.module("toy_boxed_kernels").boxed_scales(dict(args))  # type: ignore[no-any-return]

    def reference(self, args: Args) -> ReferenceResult:
        x, w, box = args["x"], args["w"], args["scales"]
        rows = x.shape[0]
        gemm = (x.double() @ w.double()).float()
        coefficient = box.values.reshape(-1)[:rows].float() if args["use_scales"] else torch.ones(rows)
        index = torch.arange(rows)
        row_map = RowMap(
            index, torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long), index
        )
        return ReferenceResult(
            gemm * coefficient.unsqueeze(1),
            torch.ones(rows, dtype=torch.bool),
            row_map,
            {"gemm": gemm},
            {"gemm": coefficient},
        )


BOXED = register_op(BoxedScalesOp(), replace=True)


def backend(device: torch.device, name: str) -> KernelBackend:
    kernel_name = name or "unmasked"
    module = types.ModuleType("toy_boxed_kernels")
    module.boxed_scales = lambda args: _kernel(kernel_name, args)  # type: ignore[attr-defined]
    return ModuleBackend.of_modules(f"toy-boxed:{kernel_name}", device, {"toy_boxed_kernels": module})


def make_args(*, rows: int = 6, k: int = 8, n: int = 5, extra: int = 4, seed: int = 0) -> dict[str, Any]:
    """A call whose kernel loads ``extra`` float32 values past the end of ``scales.values``."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(rows, k, generator=generator),
        "w": torch.randn(k, n, generator=generator),
        "scales": ScaleBox(torch.rand(rows, generator=generator) + 0.5, rows + extra),
        "out": torch.zeros(rows, n),
        "use_scales": True,
    }


def write_capture(path: Any, args: dict[str, Any]) -> Any:
    """A one-call capture; its output computed by the kernel on guarded buffers filled with zeros."""
    from moereplay.format import CaptureWriter
    from moereplay.replay.memory import materialise
    from moereplay.replay.mutations import DEFAULT_FILL

    guarded = materialise(BOXED.tensor_leaves(args), "cpu", DEFAULT_FILL)
    output = _kernel("unmasked", BOXED.replace_tensor_leaves(args, guarded.args)).clone()
    with CaptureWriter(path) as writer:
        index = writer.begin_call(NAME, args, site="tests.toy")
        writer.complete_call(index, {"out": output, "return": output})
    return path


THIS_FILE = os.path.abspath(__file__)


def spec(kernel: str) -> str:
    return f"python:{THIS_FILE}#{kernel}"
