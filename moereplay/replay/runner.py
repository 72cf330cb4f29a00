"""Runners execute variants' kernels for the engine: in this process, or in a worker process that may die.

:class:`WorkerRunner` keeps one worker alive across variants (start-up — importing torch and vLLM, creating a
CUDA context — is paid once); a variant that kills it is reported as a crash and the next variant gets a new
worker. Replies are awaited with a timeout, so a kernel that hangs (e.g. on a lock counter that was not zero)
becomes a crash too.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from moereplay.errors import ReplayError
from moereplay.format.tensors import torch_dtype
from moereplay.ops.base import Args, KernelBackend, OpSpec
from moereplay.replay.execution import KernelRun, execute
from moereplay.replay.memo import ArgsCache
from moereplay.replay.memory import DEFAULT_GUARD_BYTES, BufferPool, GuardDamage, GuardWindow
from moereplay.replay.mutations import FillPattern, Variant, apply_variant


@dataclass(frozen=True)
class RunRequest:
    """Run ``variant`` (guard fill: ``fill`` if given, else the variant's), ``repeat`` times."""

    variant: Variant
    repeat: int = 1
    fill: FillPattern | None = None
    fills: Mapping[str, FillPattern] = field(default_factory=dict)
    windows: tuple[GuardWindow, ...] = ()


class Runner(Protocol):
    device: torch.device

    def run(self, request: RunRequest) -> KernelRun: ...

    def close(self) -> None: ...


class InProcessRunner:
    """Runs kernels here. Fast; a device fault ends the session (use for trusted calls and tests)."""

    def __init__(
        self, op: OpSpec, args: Args, backend: KernelBackend, guard: int = DEFAULT_GUARD_BYTES
    ) -> None:
        self.op = op
        self.args = args
        self.backend = backend
        self.device = backend.device
        self.guard = guard
        self.pool = BufferPool()
        self._derived: ArgsCache[dict[str, Any]] = ArgsCache(limit=64)

    def run(self, request: RunRequest) -> KernelRun:
        applied = apply_variant(self.op, self.args, request.variant, derived_cache=self._derived)
        if applied.invalid_reason is not None:
            return KernelRun("rejected", error=applied.invalid_reason)
        return execute(
            self.op,
            applied.args,
            self.backend,
            fill=request.fill or applied.fill,
            fills=request.fills,
            windows=request.windows,
            repeat=request.repeat,
            guard=self.guard,
            pool=self.pool,
        )

    def close(self) -> None:
        self.pool.clear()


def _scratch_dir() -> Path:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="moereplay-run-", dir=base))


class WorkerRunner:
    """Runs kernels in a worker process (``python -m moereplay.replay.worker``), restarted after a crash.

    ``env``: variables set (a value) or unset (``None``) in the worker's environment, over this process's."""

    def __init__(
        self,
        capture: Path,
        call: int,
        backend: str,
        device: torch.device | str,
        *,
        timeout_s: float = 600.0,
        guard: int = DEFAULT_GUARD_BYTES,
        env: Mapping[str, str | None] | None = None,
    ) -> None:
        self.capture = Path(capture)
        self.call = call
        self.backend = backend
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.guard = guard
        self.env = dict(env or {})
        self.folder = _scratch_dir()
        self.log_path = self.folder / "worker.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._reply_fd: int | None = None
        self._buffer = b""
        self._next_id = 0
        self._serving: tuple[str, int, int, int] | None = None
        self.starts = 0  # worker processes started
        self.inits = 0  # calls loaded into a worker

    # -- process management -----------------------------------------------------------------------------------

    def use(self, capture: Path, call: int) -> None:
        """Serve another call (the worker process, its CUDA context and imports stay). The call the worker holds
        already (same file, unchanged, same index) is not loaded again."""
        self.capture = Path(capture)
        self.call = call
        if self._process is not None and self._process.poll() is None and self._serving != self._identity():
            self._init()

    def _identity(self) -> tuple[str, int, int, int] | None:
        """(path, call, mtime_ns, size) of the call to serve; ``None`` when the file cannot be read."""
        try:
            stat = self.capture.stat()
        except OSError:
            return None
        return (str(self.capture.resolve()), self.call, stat.st_mtime_ns, stat.st_size)

    def _init(self) -> None:
        self._serving = None
        self.inits += 1
        reply = self._request(
            {
                "cmd": "init",
                "capture": str(self.capture),
                "call": self.call,
                "backend": self.backend,
                "device": str(self.device),
                "out_dir": str(self.folder),
                "guard": self.guard,
            }
        )
        if reply is None or reply.get("status") != "ready":
            detail = (reply or {}).get("error") or self._log_tail()
            self._stop()
            raise ReplayError(f"the replay worker did not start: {detail}")
        self._serving = self._identity()

    def _start(self) -> None:
        read_fd, write_fd = os.pipe()
        environment = dict(os.environ)
        for name, value in self.env.items():  # None: the variable is unset in the worker
            if value is None:
                environment.pop(name, None)
            else:
                environment[name] = value
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "moereplay.replay.worker", str(write_fd)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=log,
                pass_fds=(write_fd,),
                env=environment,
            )
        finally:
            os.close(write_fd)
            log.close()
        self._reply_fd = read_fd
        self._buffer = b""
        self.starts += 1
        self._init()

    def _stop(self) -> None:
        process = self._process
        if process is not None:
            if process.poll() is None:
                try:
                    assert process.stdin is not None
                    process.stdin.write(b'{"cmd": "exit"}\n')
                    process.stdin.flush()
                    process.wait(timeout=10)
                except (OSError, subprocess.TimeoutExpired):
                    process.kill()
                    process.wait()
            if process.stdin is not None:
                process.stdin.close()
        if self._reply_fd is not None:
            os.close(self._reply_fd)
        self._process = None
        self._reply_fd = None
        self._serving = None

    def _kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._stop()

    def _log_tail(self, lines: int = 6) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        interesting = [line for line in text if line.strip()][-lines:]
        return " | ".join(interesting)[-600:]

    def _request(self, message: dict[str, Any]) -> dict[str, Any] | None:
        """Send one request and wait for its reply; ``None`` when the worker died or timed out."""
        process = self._process
        assert process is not None and process.stdin is not None and self._reply_fd is not None
        try:
            process.stdin.write((json.dumps(message) + "\n").encode())
            process.stdin.flush()
        except OSError:
            return None
        deadline = time.monotonic() + self.timeout_s
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return {"status": "timeout"}
            ready, _, _ = select.select([self._reply_fd], [], [], min(remaining, 1.0))
            if not ready:
                if process.poll() is not None:
                    return None
                continue
            chunk = os.read(self._reply_fd, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    # -- the Runner protocol ----------------------------------------------------------------------------------

    def run(self, request: RunRequest) -> KernelRun:
        if self._process is None or self._process.poll() is not None:
            self._stop()
            self._start()
        self._next_id += 1
        message = {
            "cmd": "run",
            "id": self._next_id,
            "variant": list(request.variant.specs),
            "fill": request.fill.name if request.fill is not None else None,
            "fills": {name: fill.name for name, fill in request.fills.items()},
            "windows": [[w.arg, w.side, w.start, w.stop, w.pattern.name] for w in request.windows],
            "repeat": request.repeat,
        }
        reply = self._request(message)
        if reply is None:
            tail = self._log_tail()
            self._kill()
            return KernelRun("crash", error="the worker process died" + (f": {tail}" if tail else ""))
        if reply.get("status") == "timeout":
            self._kill()
            return KernelRun(
                "crash", error=f"no result within {self.timeout_s:g} s (hung kernel?); worker killed"
            )
        status = reply.get("status")
        if status == "error":
            return KernelRun("rejected", error=str(reply.get("error", "")))
        if status == "invalid":
            return KernelRun("rejected", error=str(reply.get("error", "")))
        outputs = tuple(self._read_output(item) for item in reply.get("outputs", []))
        damage = tuple(
            GuardDamage(arg, side, first, last, count, span)
            for arg, side, first, last, count, span in reply.get("damage", [])
        )
        if status == "crash":
            self._kill()  # the context is gone; the next run starts a new worker
        phases = {str(name): float(value) for name, value in (reply.get("phases") or {}).items()}
        state = reply.get("state")
        return KernelRun(
            status,  # type: ignore[arg-type]
            outputs,
            damage,
            str(reply.get("error", "")),
            reply.get("elapsed_s"),
            phases,
            dict(state) if isinstance(state, dict) else {},
        )

    def _read_output(self, item: Mapping[str, Any]) -> torch.Tensor:
        path = Path(item["path"])
        dtype = torch_dtype(item["dtype"])
        if dtype is None:
            raise ReplayError(f"the worker reported an output of dtype {str(item['dtype'])[:64]!r}")
        shape = tuple(int(size) for size in item["shape"])
        data = path.read_bytes()
        path.unlink(missing_ok=True)
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)

    def close(self) -> None:
        self._stop()
        shutil.rmtree(self.folder, ignore_errors=True)


_POOL: dict[tuple[str, str, int], WorkerRunner] = {}


def pooled_worker(
    capture: Path, call: int, backend: str, device: torch.device, *, timeout_s: float, guard: int
) -> WorkerRunner:
    """A worker kept alive across ``replay()`` calls in this process (one per backend, device and guard size), so
    a second replay pays no start-up. Closed when the process exits."""
    key = (backend, str(device), guard)
    runner = _POOL.get(key)
    if runner is None:
        if not _POOL:
            atexit.register(close_pool)
        runner = WorkerRunner(capture, call, backend, device, timeout_s=timeout_s, guard=guard)
        _POOL[key] = runner
    runner.timeout_s = timeout_s
    runner.use(capture, call)
    return runner


def close_pool() -> None:
    """Stop every pooled worker."""
    for runner in _POOL.values():
        runner.close()
    _POOL.clear()
