"""The worker process that runs kernels for a replay session, so a device fault cannot kill the session.

Started as ``python -m moereplay.replay.worker REPLY_FD``. Requests arrive as JSON lines on stdin, replies leave as
JSON lines on file descriptor ``REPLY_FD`` (stdout is left to whatever the kernel library prints). Nothing is
pickled: the call comes from a capture file, mutations as their text specs, outputs go back as raw little-endian
bytes in files under the session folder with dtype and shape in the reply.

Requests::

    {"cmd": "init", "capture": PATH, "call": N, "backend": SPEC, "device": "cuda:0", "out_dir": DIR, "guard": 4096}
    {"cmd": "run", "id": K, "variant": [SPEC, ...], "fill": "0x00", "fills": {ARG: FILL}, "repeat": 1,
     "windows": [[ARG, "after", START, STOP, FILL], ...]}
    {"cmd": "exit"}

``python -m moereplay.replay.worker --oneshot CAPTURE CALL BACKEND DEVICE`` runs the captured call once, without
guard bands, printing ``MOEREPLAY-ARG NAME ADDRESS BYTES`` for every tensor first: the form compute-sanitizer runs
(its report names allocations by address; these lines name them by argument).

Replies: ``{"status": "ready"}`` / ``{"status": "error", "error": TEXT}`` to init; to run: ``{"id": K, "status":
"ran"|"rejected"|"crash"|"invalid", "error": TEXT, "elapsed_s": S, "outputs": [{"path", "dtype", "shape"}],
"damage": [[ARG, SIDE, FIRST, LAST, COUNT, SPAN], ...], "phases": {PHASE: SECONDS}, "state": {KEY: VALUE}}``
(``state``: the op's ``run_state()`` after the run, e.g. the opt_flags triton_kernels chose).

The worker keeps a :class:`~moereplay.replay.memory.BufferPool` (guarded allocations reused between runs, every byte
rewritten before each) and the call's re-derived arguments (:mod:`moereplay.replay.memo`) while it serves one call.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, TextIO

from moereplay.replay.mutations import dtype_name


def _reply(stream: TextIO, message: dict[str, Any]) -> None:
    stream.write(json.dumps(message) + "\n")
    stream.flush()


class _Session:
    def __init__(self, request: dict[str, Any]) -> None:
        import torch

        from moereplay.replay.backends import load_backend, parse_backend
        from moereplay.replay.source import load_call

        self.device = torch.device(request["device"])
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)
        # the backend first: loading it may register the op the capture names
        self.backend = load_backend(parse_backend(request["backend"]), self.device)
        self.call = load_call(request["capture"], int(request["call"]), device=self.device)
        self.out_dir = Path(request["out_dir"])
        self.guard = int(request.get("guard", 4096))
        self.counter = 0
        from moereplay.replay.memo import ArgsCache
        from moereplay.replay.memory import BufferPool

        self.pool = BufferPool()
        self.derived: ArgsCache[dict[str, Any]] = ArgsCache(limit=64)

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        import time

        import torch

        from moereplay.replay.execution import execute
        from moereplay.replay.memory import GuardWindow
        from moereplay.replay.mutations import apply_variant, parse_fill, variant_from_specs

        start = time.perf_counter()
        op = self.call.op
        variant = variant_from_specs(op, request.get("variant", []))
        applied = apply_variant(op, self.call.args, variant, derived_cache=self.derived)
        if applied.invalid_reason is not None:
            return {"status": "invalid", "error": applied.invalid_reason}
        fill = parse_fill(request["fill"]) if request.get("fill") else applied.fill
        fills = {name: parse_fill(text) for name, text in (request.get("fills") or {}).items()}
        windows = [
            GuardWindow(arg, side, int(start), int(stop), parse_fill(pattern))
            for arg, side, start, stop, pattern in request.get("windows") or []
        ]
        run = execute(
            op,
            applied.args,
            self.backend,
            fill=fill,
            fills=fills,
            windows=windows,
            repeat=int(request.get("repeat", 1)),
            guard=self.guard,
            pool=self.pool,
        )
        clock = time.perf_counter()
        phases = {"apply": clock - start - sum(run.phases.values()), **run.phases}
        outputs = []
        for tensor in run.outputs:
            self.counter += 1
            path = self.out_dir / f"out-{os.getpid()}-{self.counter}.bin"
            data = tensor.contiguous().cpu()
            path.write_bytes(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
            outputs.append({"path": str(path), "dtype": dtype_name(data.dtype), "shape": list(data.shape)})
        phases["write_outputs"] = time.perf_counter() - clock
        return {
            "status": run.status,
            "error": run.error,
            "elapsed_s": run.elapsed_s,
            "outputs": outputs,
            "damage": [[d.arg, d.side, d.first, d.last, d.count, d.span_bytes] for d in run.damage],
            "phases": phases,
            "state": dict(run.state),
        }


def oneshot(capture: str, call: int, backend: str, device: str) -> int:
    """Run the baseline once on unguarded buffers (for compute-sanitizer); print each argument's address."""
    import torch

    from moereplay.ops.base import replace_tensor_leaves, tensor_leaves
    from moereplay.replay.backends import load_backend, parse_backend
    from moereplay.replay.memory import materialise
    from moereplay.replay.mutations import DEFAULT_FILL
    from moereplay.replay.source import load_call

    target = torch.device(device)
    if target.type == "cuda" and target.index is not None:
        torch.cuda.set_device(target)
    kernel = load_backend(parse_backend(backend), target)
    loaded = load_call(capture, call, device=target)
    op = loaded.op
    args = dict(loaded.args)
    args.update(op.make_scratch(args, target))
    guarded = materialise(tensor_leaves(op, args), target, DEFAULT_FILL, guard=0)
    for name, value in guarded.args.items():
        nbytes = value.untyped_storage().nbytes()
        print(f"MOEREPLAY-ARG {name} {value.untyped_storage().data_ptr():#x} {nbytes}", flush=True)
    op.run(replace_tensor_leaves(op, args, guarded.args), kernel)
    if target.type == "cuda":
        torch.cuda.synchronize(target)
    print("MOEREPLAY-DONE", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--oneshot":
        return oneshot(args[1], int(args[2]), args[3], args[4])
    reply_stream = os.fdopen(int(args[0]), "w", encoding="utf-8")
    session: _Session | None = None
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        command = request.get("cmd")
        if command == "exit":
            break
        try:
            if command == "init":
                session = _Session(request)
                _reply(reply_stream, {"status": "ready"})
            elif command == "run":
                if session is None:
                    _reply(
                        reply_stream, {"id": request.get("id"), "status": "error", "error": "not initialised"}
                    )
                    continue
                message = session.run(request)
                message["id"] = request.get("id")
                _reply(reply_stream, message)
            else:
                _reply(reply_stream, {"status": "error", "error": f"unknown command {command!r}"})
        except Exception as error:
            detail = traceback.format_exc(limit=4)
            _reply(
                reply_stream,
                {
                    "id": request.get("id"),
                    "status": "error",
                    "error": f"{type(error).__name__}: {error}",
                    "trace": detail,
                },
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
