"""Start, drive and stop a ``vllm serve`` process tree from a test or benchmark; standard library only.

Used by the CPU probe (``serve_probe.py``), the GPU harness (``tools/gpu/serve_gpu.py``) and the serving
benchmark (``tools/bench/serve_bench.py``). Import it by path (``tools/`` is not a package)::

    sys.path.insert(0, str(REPOSITORY / "tools" / "serve")); import harness

What it knows about vLLM, from vLLM 0.25.1's sources: the OpenAI server answers ``GET /health`` with 200 once the
engine is up; ``POST /v1/completions`` takes ``prompt``, ``max_tokens``, ``temperature``, ``ignore_eos`` and
returns ``usage.prompt_tokens`` / ``usage.completion_tokens``; SIGTERM to the API server stops the whole tree
(EngineCore and Worker are its children; ``--shutdown-timeout`` seconds of grace, default 0 = SIGKILL).
moereplay's plugin reaches vLLM through the ``vllm.general_plugins`` entry point, so a process that cannot
``pip install`` moereplay needs a dist-info that declares it on ``PYTHONPATH`` (:func:`make_site`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENTRY_POINTS = "[vllm.general_plugins]\nmoereplay = moereplay.capture.plugin:register\n"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def make_site(directory: Path, vllm_alias_version: str | None = None) -> Path:
    """A ``PYTHONPATH`` directory with a dist-info declaring moereplay's entry point (and, if asked, a
    metadata-only ``vllm`` distribution of that version, for vLLM builds installed under another name)."""
    site = directory / "site"
    probe = site / "moereplay_serve_probe-0.0.dist-info"
    probe.mkdir(parents=True, exist_ok=True)
    (probe / "METADATA").write_text("Metadata-Version: 2.1\nName: moereplay-serve-probe\nVersion: 0.0\n")
    (probe / "entry_points.txt").write_text(ENTRY_POINTS)
    if vllm_alias_version is not None:
        alias = site / f"vllm-{vllm_alias_version}.dist-info"
        alias.mkdir(exist_ok=True)
        (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {vllm_alias_version}\n")
    return site


def process_titles(root: int) -> dict[int, str]:
    """pid → command line (vLLM's process titles) of ``root`` and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    titles: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
        titles[int(entry.name)] = title
    found: dict[int, str] = {}
    stack = [root]
    while stack:
        pid = stack.pop()
        found[pid] = titles.get(pid, "")
        stack.extend(children.get(pid, []))
    return found


@dataclass
class Server:
    """One running ``vllm serve`` process tree, started in its own session (so its group can be killed)."""

    process: subprocess.Popen[bytes]
    port: int
    model: str
    log: Path
    started: float = field(default_factory=time.monotonic)
    ready_s: float | None = None
    titles: dict[int, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> float:
        """Seconds from start until ``/health`` answered 200; raises RuntimeError on exit or timeout."""
        while time.monotonic() - self.started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with status {self.process.returncode} before it was ready "
                    f"(log: {self.log})"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        self.ready_s = time.monotonic() - self.started
                        self.titles = process_titles(self.process.pid)
                        return self.ready_s
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vllm serve was not ready after {timeout:.0f} s (log: {self.log})")

    def complete(
        self,
        prompt: str,
        max_tokens: int,
        *,
        ignore_eos: bool = True,
        timeout: float = 300.0,
        extra: dict[str, object] | None = None,
        stream: bool = False,
    ) -> Completion:
        """One ``/v1/completions`` request, greedy; its text, token counts and wall seconds.

        ``extra``: more fields of the request body (``logit_bias``, …). ``stream``: the answer as server-sent
        events, and when each event with a choice arrived (:attr:`Completion.times`: one per engine step that
        made a token, so the gaps between them are the steps' times as the client saw them)."""
        body: dict[str, object] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": ignore_eos,
            **(extra or {}),
        }
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        request = urllib.request.Request(
            f"{self.url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        started = time.monotonic()
        times: list[float] = []
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = read_events(response, started, times) if stream else json.loads(response.read())
        usage = answer.get("usage") or {}
        return Completion(
            text=str(answer["choices"][0]["text"]),
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", 0)),
            seconds=time.monotonic() - started,
            times=tuple(times),
        )

    def complete_many(self, prompts: Sequence[str], max_tokens: int, **options: object) -> Batch:
        """All prompts at once, one thread each (so vLLM batches them); results in prompt order."""
        results: list[Completion | BaseException | None] = [None] * len(prompts)

        def one(index: int, prompt: str) -> None:
            try:
                results[index] = self.complete(prompt, max_tokens, **options)  # type: ignore[arg-type]
            except BaseException as error:  # reported below, with the others
                results[index] = error

        threads = [threading.Thread(target=one, args=item) for item in enumerate(prompts)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.monotonic() - started
        errors = [result for result in results if isinstance(result, BaseException)]
        if errors:
            raise RuntimeError(f"{len(errors)} of {len(prompts)} requests failed; first: {errors[0]!r}")
        return Batch(completions=[r for r in results if isinstance(r, Completion)], seconds=seconds)

    def stop(self, grace: float = 90.0) -> float:
        """SIGTERM to the API server, then SIGKILL to the group after ``grace`` seconds; seconds taken."""
        started = time.monotonic()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        # children that outlived the API server (they should not) get the group's SIGKILL too
        try:
            os.killpg(self.process.pid, 0)
            time.sleep(2.0)
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return time.monotonic() - started


@dataclass(frozen=True)
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    times: tuple[float, ...] = ()  # a streamed answer's: seconds from the request to each event with a choice


def read_events(lines: Iterable[bytes], started: float, times: list[float]) -> dict[str, Any]:
    """A streamed ``/v1/completions`` answer (``data: {json}`` lines, ``data: [DONE]`` last) as one answer: the
    text joined, the usage of the last event that has one; appends to ``times`` when each event with a choice came
    (seconds after ``started``, ``time.monotonic()``): one per engine step that made tokens, its text empty where a
    token ends inside a character (the usage-only event has no choice). An error event, or a stream that ends
    without ``[DONE]``, raises RuntimeError."""
    text: list[str] = []
    usage: dict[str, Any] = {}
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return {"choices": [{"text": "".join(text)}], "usage": usage}
        event = json.loads(data)
        if not isinstance(event, dict):
            raise RuntimeError(f"the streamed answer holds a non-object event: {data[:200]!r}")
        if "error" in event:
            raise RuntimeError(f"the streamed answer reports an error: {str(event['error'])[:300]}")
        choices = event.get("choices") or ()
        for choice in choices:
            text.append(str(choice.get("text") or ""))
        if choices:
            times.append(time.monotonic() - started)
        if event.get("usage"):
            usage = event["usage"]
    raise RuntimeError("the streamed answer ended without data: [DONE]")


@dataclass(frozen=True)
class Batch:
    completions: list[Completion]
    seconds: float

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.completions)

    @property
    def prompt_tokens(self) -> int:
        return sum(c.prompt_tokens for c in self.completions)


def start(command: Sequence[str], model: str, port: int, env: dict[str, str], log: Path) -> Server:
    """Start ``command`` (a ``vllm serve`` command line listening on ``port``) with ``env``; output to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as stream:
        process = subprocess.Popen(
            list(command), env=env, stdout=stream, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Server(process=process, port=port, model=model, log=log)


def base_environment(site: Path, extra_paths: Sequence[str] = ()) -> dict[str, str]:
    """This process's environment without moereplay/vLLM settings, the site first on ``PYTHONPATH``, and
    vLLM's telemetry and hub look-ups off (the GPU machine reaches no network)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("MOEREPLAY_", "VLLM_"))}
    paths = [str(site), *extra_paths]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(paths),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    return env
