"""A small op with real (pure torch) kernels, to test the replay engine without a GPU.

``toy_scaled_rows``: ``out[r] = (x[r] @ w[expert[r]] + bias[expert[r]]) * weights[r]`` (the weight only with
``mul_weights``). Like Marlin's ``topk_weights``, ``weights`` is *read as float32 from its data pointer* whatever
its dtype — so bf16 weights reproduce the caller-side bug class, and reads past the end land in the guard band.

Loaded as a backend with ``python:<this file>#<kernel>``; kernels:

- ``correct``: the semantics above;
- ``neighbour``: row ``r`` takes the weight of row ``(r + 1) % rows`` (a kernel bug);
- ``bias_twice``: adds the bias twice (a kernel bug);
- ``oob_write``: also writes 8 bytes past the end of ``out``;
- ``crash``: kills its process when ``block == 1`` (stands in for a device fault);
- ``noisy``: nudges row 0 by a random amount each run (nondeterminism);
- ``chunked``: sums the product over K in float32 chunks of ``block`` (the rounding depends on the block size, which
  the op reports as its process state: ``run_state()`` / ``recorded_state`` read from the output ``toy_state``);
- ``env_scaled``: multiplies the result by ``$VLLM_TOY_SCALE`` (1 when unset): output that depends on the
  environment.

These are real computations run by the engine, not mocks of vLLM's kernels.
"""

from __future__ import annotations

import os
import types
from typing import Any, ClassVar

import torch

from moereplay.ops import register_op
from moereplay.ops.base import (
    ArgKind,
    Args,
    ArgSpec,
    BoolDomain,
    ChoiceDomain,
    CoefficientSource,
    KernelBackend,
    MutableArg,
    ReferenceResult,
    RowMap,
    TensorContract,
    dtype_of,
    fixed_dtype,
)
from moereplay.replay.backends import ModuleBackend

NAME = "toy_scaled_rows"


def _float32_view(tensor: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` float32 values from ``tensor``'s data pointer on — past its end if it is shorter."""
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
    start = tensor.storage_offset() * tensor.element_size()
    return raw[start : start + 4 * count].view(torch.float32)


def _kernel(name: str, args: dict[str, Any]) -> torch.Tensor:
    x, w, bias, expert, out = args["x"], args["w"], args["bias"], args["expert"], args["out"]
    rows = x.shape[0]
    if name == "crash" and args["block"] == 1:
        os._exit(17)
    experts = expert.to(torch.long)
    if name == "chunked":
        step = int(args["block"])
        result = torch.zeros(rows, w.shape[-1], dtype=torch.float32)
        for start in range(0, x.shape[1], step):
            chunk = torch.bmm(x[:, None, start : start + step], w[experts, start : start + step]).squeeze(1)
            result = result + chunk
    else:
        result = torch.bmm(x.unsqueeze(1), w[experts]).squeeze(1)
    if bias is not None:
        result = result + bias[experts] * (2.0 if name == "bias_twice" else 1.0)
    if args["mul_weights"]:
        weights = _float32_view(args["weights"], rows)
        if name == "neighbour":
            weights = weights[(torch.arange(rows) + 1) % rows]
        result = result * weights.unsqueeze(1)
    if name == "noisy":
        result[0] += torch.rand(()) * 1e-3
    if name == "env_scaled":
        result = result * float(os.environ.get("VLLM_TOY_SCALE", "1"))
    out.copy_(result.to(out.dtype))
    if name == "oob_write":
        raw = torch.empty(0, dtype=torch.uint8, device=out.device).set_(out.untyped_storage())
        end = (out.storage_offset() + out.numel()) * out.element_size()
        raw[end : end + 8] = 0xAB
    return out


class ToyOp:
    name = NAME
    arguments = (
        ArgSpec("x", ArgKind.TENSOR),
        ArgSpec("w", ArgKind.TENSOR),
        ArgSpec("bias", ArgKind.TENSOR, optional=True),
        ArgSpec("expert", ArgKind.TENSOR),
        ArgSpec("weights", ArgKind.TENSOR),
        ArgSpec("out", ArgKind.TENSOR),
        ArgSpec("mul_weights", ArgKind.FLAG),
        ArgSpec("block", ArgKind.SCALAR),
    )
    mutable = (
        MutableArg("mul_weights", BoolDomain()),
        MutableArg("block", ChoiceDomain((1, 2, 4), "the block sizes the toy kernel supports")),
    )
    derived = ()
    contracts = (
        TensorContract("x", read_as=fixed_dtype(torch.float32), host_checked=True),
        TensorContract("w", read_as=fixed_dtype(torch.float32), host_checked=True),
        TensorContract("bias", read_as=fixed_dtype(torch.float32), host_checked=False, required=False),
        TensorContract("expert", read_as=fixed_dtype(torch.int32), host_checked=False),
        TensorContract(
            "weights",
            read_as=fixed_dtype(torch.float32),
            host_checked=False,
            numel=lambda args: args["x"].shape[0] if isinstance(args.get("x"), torch.Tensor) else None,
        ),
        TensorContract("out", read_as=dtype_of("x"), host_checked=False),
    )
    scratch = ("out",)
    output_name = "out"
    reference_ignores = frozenset({"out", "block"})
    state_pins: ClassVar[dict[str, str]] = {"block": "block"}

    def __init__(self) -> None:
        self.last_state: dict[str, Any] = {}

    def run_state(self) -> dict[str, Any]:
        return dict(self.last_state)

    def recorded_state(self, outputs: Any, context: Any) -> dict[str, Any] | None:
        state = outputs.get("toy_state")
        return dict(state) if isinstance(state, dict) else None

    def rederive(self, args: Args, changed: frozenset[str]) -> dict[str, Any]:
        return dict(args)

    def make_scratch(self, args: Args, device: torch.device) -> dict[str, Any]:
        out = args["out"]
        return {"out": torch.zeros(out.shape, dtype=out.dtype, device=device)}

    def run(self, args: Args, backend: KernelBackend) -> torch.Tensor:
        kernels = backend.module("toy_kernels")
        self.last_state = {"block": int(args["block"])}
        return kernels.scaled_rows(dict(args))  # type: ignore[no-any-return]

    def reference(self, args: Args) -> ReferenceResult:
        x, w, bias, expert = args["x"], args["w"], args["bias"], args["expert"].to(torch.long)
        rows = x.shape[0]
        gemm = torch.bmm(x.double().unsqueeze(1), w.double()[expert]).squeeze(1).float()
        terms = {"gemm": gemm}
        ones = torch.ones(rows)
        coefficient = args["weights"].reshape(-1)[:rows].float() if args["mul_weights"] else ones
        coefficients = {"gemm": coefficient}
        output = gemm * coefficient.unsqueeze(1)
        if bias is not None:
            terms["bias"] = bias.float()[expert]
            coefficients["bias"] = coefficient
            output = output + terms["bias"] * coefficient.unsqueeze(1)
        sources = {}
        if args["mul_weights"]:
            source = CoefficientSource("weights", torch.arange(rows), torch.float32)
            sources = {name: source for name in terms}
        row_map = RowMap(
            torch.arange(rows), expert, torch.zeros(rows, dtype=torch.long), torch.arange(rows) // 2
        )
        return ReferenceResult(
            output, torch.ones(rows, dtype=torch.bool), row_map, terms, coefficients, sources
        )


TOY = register_op(ToyOp(), replace=True)


def backend(device: torch.device, name: str) -> KernelBackend:
    """The toy kernels as a backend: ``module("toy_kernels").scaled_rows(args)`` runs kernel ``name``."""
    kernel_name = name or "correct"
    module = types.ModuleType("toy_kernels")
    module.scaled_rows = lambda args: _kernel(kernel_name, args)  # type: ignore[attr-defined]
    return ModuleBackend.of_modules(f"toy:{kernel_name}", device, {"toy_kernels": module})


def make_args(
    *,
    rows: int = 8,
    k: int = 16,
    n: int = 24,
    experts: int = 3,
    weights_dtype: torch.dtype = torch.float32,
    bias: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    weights = torch.rand(rows, generator=generator) * 0.9 + 0.1
    return {
        "x": torch.randn(rows, k, generator=generator),
        "w": torch.randn(experts, k, n, generator=generator),
        "bias": torch.randn(experts, n, generator=generator) if bias else None,
        "expert": torch.randint(0, experts, (rows,), generator=generator, dtype=torch.int32),
        "weights": weights.to(weights_dtype),
        "out": torch.zeros(rows, n),
        "mul_weights": True,
        "block": 1,
    }


def write_capture(
    path: Any,
    args: dict[str, Any],
    kernel: str = "correct",
    *,
    ran_with: dict[str, Any] | None = None,
    state: dict[str, Any] | None = None,
    header: dict[str, Any] | None = None,
) -> Any:
    """A one-call capture of the toy op, its output computed by ``kernel`` (on CPU, guard-free). ``ran_with``:
    argument values the recorded run used instead of the recorded ones; ``state``: the process state recorded
    beside the output (``toy_state``); ``header``: merged into the capture's header (e.g. ``{"env": …}``)."""
    from moereplay.format import CaptureWriter
    from moereplay.replay.memory import materialise
    from moereplay.replay.mutations import DEFAULT_FILL

    guarded = materialise(args, "cpu", DEFAULT_FILL)
    output = _kernel(kernel, {**dict(guarded.args), **(ran_with or {})}).clone()
    outputs: dict[str, Any] = {"out": output, "return": output}
    if state is not None:
        outputs["toy_state"] = state
    with CaptureWriter(path, header=header) as writer:
        index = writer.begin_call(NAME, args, site="tests.toy")
        writer.complete_call(index, outputs)
    return path


THIS_FILE = os.path.abspath(__file__)


def spec(kernel: str) -> str:
    return f"python:{THIS_FILE}#{kernel}"
