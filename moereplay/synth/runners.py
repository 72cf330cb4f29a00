"""Who computes a synthesized call's output: the real kernel (a replay backend) or the fp32 reference.

- :class:`KernelRunner` loads a replay backend (``vllm`` or ``pack:DIR``) with
  :func:`moereplay.replay.backends.load_backend` and runs the op once with
  :func:`moereplay.replay.execution.execute` — fresh scratch buffers, guarded copies — so the recorded output is
  exactly what the kernel wrote. A kernel that refuses the call or faults raises :class:`ReplayError`.
- :class:`ReferenceRunner` computes ``op.reference(args)`` and writes it, cast to the output buffer's dtype, into a
  zeroed copy of the output buffer (rows the kernel would not write stay zero), returned as ``[rows, cols]`` like the
  kernels return it. Such a capture's "captured output"
  is the reference's, not a kernel's: the header says so (``synth.output_source``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from moereplay.errors import ReplayError, SettingsError


class CallRunner(Protocol):
    """Runs one call of a registered op and returns its output as the kernel leaves it."""

    @property
    def device(self) -> torch.device: ...

    @property
    def output_source(self) -> str: ...

    def run(self, op_name: str, args: Mapping[str, Any]) -> torch.Tensor: ...


def _output_buffer(op: Any, args: Mapping[str, Any]) -> torch.Tensor:
    buffer = args.get(op.output_name)
    if not isinstance(buffer, torch.Tensor):
        raise ReplayError(f"{op.name}: the synthesized call has no {op.output_name} buffer")
    return buffer


class ReferenceRunner:
    """The fp32 reference, cast into the output buffer (see the module docstring)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._device = torch.device(device)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def output_source(self) -> str:
        return "reference (fp32 reference cast to the output dtype; no kernel ran)"

    def run(self, op_name: str, args: Mapping[str, Any]) -> torch.Tensor:
        from moereplay.ops import get_op

        op = get_op(op_name)
        reference = op.reference(args)
        buffer = _output_buffer(op, args)
        out = torch.zeros_like(buffer)
        columns = reference.output.shape[1]
        rows = out.view(-1, columns)
        written = reference.written.to(out.device)
        rows[written] = reference.output.to(out.device)[written].to(out.dtype)
        return rows  # [rows, cols], as the kernels return it (matmul_ogs drops y's batch axis for 2-D x)


class KernelRunner:
    """The real kernel through a replay backend spec (``vllm`` | ``pack:DIR``) on a CUDA device."""

    def __init__(self, backend: str, device: torch.device | str | None = None) -> None:
        from moereplay.replay.backends import load_backend, parse_backend

        spec = parse_backend(backend)
        if not spec.runs_kernels:
            raise SettingsError(f"backend {backend!r} runs no kernel; use ReferenceRunner")
        if not torch.cuda.is_available():
            raise SettingsError(f"the {spec.text} backend runs CUDA kernels; no CUDA device here")
        target = torch.device(device if device is not None else "cuda")
        if target.type == "cuda" and target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        self.spec = spec
        self._device = target
        self.backend = load_backend(spec, target)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def output_source(self) -> str:
        return f"kernel ({self.spec.text})"

    def run(self, op_name: str, args: Mapping[str, Any]) -> torch.Tensor:
        from moereplay.ops import get_op
        from moereplay.replay.execution import execute
        from moereplay.replay.mutations import DEFAULT_FILL

        op = get_op(op_name)
        run = execute(op, args, self.backend, fill=DEFAULT_FILL)
        if run.status != "ran" or not run.outputs:
            raise ReplayError(
                f"{op_name}: the kernel did not run the synthesized call ({run.status}: {run.error})"
            )
        return run.outputs[0]


def runner_for(backend: str, device: torch.device | str | None = None) -> CallRunner:
    """``reference`` → :class:`ReferenceRunner` (on ``device``, default CPU); a kernel spec → :class:`KernelRunner`."""
    if backend.strip() == "reference":
        return ReferenceRunner(device or "cpu")
    return KernelRunner(backend, device)
