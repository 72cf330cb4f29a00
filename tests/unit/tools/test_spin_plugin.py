"""``tools/serve/spin_plugin.py``, serve_bench's serving-thread-time diagnostic: the wrapped call spins the time asked
for and returns what the call returns; a GIL-holding thread starts once; nothing is wrapped unless asked; the
servers of its settings get the plugin's entry point and folder, the others do not."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
from model_files import load_tool

from moereplay.capture.patch_points import CaptureTarget
from moereplay.capture.patching import ORIGINAL

SERVE = Path(__file__).resolve().parents[3] / "tools" / "serve"
BENCH = SERVE.parent / "bench"
MODULE = "moereplay_spin_stand_in"


@pytest.fixture(scope="module")
def plugin() -> types.ModuleType:
    return load_tool("spin_plugin", SERVE)


def _target() -> CaptureTarget:
    return CaptureTarget("layer", "parent", MODULE, "layer", inputs_intact=True)


def test_a_wrapped_call_spins_first_and_returns_the_calls_result(plugin, stand_in_module) -> None:
    module = stand_in_module(MODULE, layer=lambda x, *, scale=1: x * scale)
    patcher = plugin.install({"MOEREPLAY_BENCH_SPIN_US": "3000"}, [_target()])
    try:
        assert getattr(module.layer, ORIGINAL, None) is not None
        started = time.perf_counter()
        assert module.layer(4, scale=3) == 12
        assert time.perf_counter() - started >= 0.003
        assert patcher.handler.calls == 1 and patcher.handler.spun == 1
    finally:
        patcher.uninstall()
    assert getattr(module.layer, ORIGINAL, None) is None


def test_no_spin_while_a_graph_is_captured(plugin) -> None:
    handler = plugin.make_handler(50_000, None, lambda: True)
    assert handler.call(_target(), None, lambda x: x + 1, (1,), {}) == 2
    assert handler.spun == 0 and handler.calls == 1


def test_the_poll_thread_starts_once_at_the_first_call_and_holds_the_gil(plugin) -> None:
    poller = plugin.GilPoller(2000, 1)
    handler = plugin.make_handler(0, poller, lambda: False)
    before = [thread for thread in threading.enumerate() if thread.name == "moereplay-bench-poll"]
    try:
        for _ in range(3):
            handler.call(_target(), None, lambda: None, (), {})
        time.sleep(0.1)
        polls = [thread for thread in threading.enumerate() if thread.name == "moereplay-bench-poll"]
        assert len(polls) == len(before) + 1 and poller.holds >= 5
        # while it holds the GIL this thread cannot run: a tight loop here sees gaps of about the hold
        gaps = []
        last = time.perf_counter()
        end = last + 0.1
        while last < end:
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        assert max(gaps) >= 0.0015
    finally:
        poller.stop()
    (poll,) = set(polls) - set(before)
    poll.join(timeout=5)
    assert not poll.is_alive()


def test_nothing_is_wrapped_unless_asked_and_a_negative_value_is_refused(plugin, stand_in_module) -> None:
    module = stand_in_module(MODULE, layer=lambda x: x)
    assert plugin.install({}, [_target()]) is None
    assert plugin.install({"MOEREPLAY_BENCH_POLL_MS": "7"}, [_target()]) is None
    assert getattr(module.layer, ORIGINAL, None) is None
    with pytest.raises(ValueError, match="MOEREPLAY_BENCH_SPIN_US='-5'"):
        plugin.install({"MOEREPLAY_BENCH_SPIN_US": "-5"}, [_target()])
    with pytest.raises(ValueError, match="MOEREPLAY_BENCH_POLL_US='lots': not a whole number"):
        plugin.install({"MOEREPLAY_BENCH_POLL_US": "lots"}, [_target()])


def test_a_malformed_variable_stops_the_process_with_one_line(plugin, monkeypatch) -> None:
    monkeypatch.setattr(plugin, "_INSTALLED", [])
    monkeypatch.setenv("MOEREPLAY_BENCH_SPIN_US", "2.5")
    with pytest.raises(SystemExit) as stopped:
        plugin.register()
    assert str(stopped.value) == "moereplay bench spin: MOEREPLAY_BENCH_SPIN_US='2.5': not a whole number"


def test_its_target_is_the_layer_call_the_flight_recorder_keeps(plugin) -> None:
    (target,) = plugin.gpt_oss_forward_targets()
    assert target.attribute == "triton_kernel_moe_forward"
    assert target.module == "vllm.model_executor.layers.fused_moe.experts.gpt_oss_triton_kernels_moe"
    assert target.layer_flight_only


def test_serve_bench_declares_the_plugin_only_for_its_settings(tmp_path: Path) -> None:
    sys.modules.pop("spin_plugin", None)  # serve_bench imports it from tools/serve itself
    bench = load_tool("serve_bench", BENCH)
    env = bench.server_environment("spin-250-polls", tmp_path / "spin")
    info = tmp_path / "spin" / "site" / "moereplay_bench_spin-0.0.dist-info" / "entry_points.txt"
    assert "[vllm.general_plugins]" in info.read_text() and "spin_plugin:register" in info.read_text()
    assert str(SERVE) in env["PYTHONPATH"].split(":")
    assert env["MOEREPLAY_BENCH_SPIN_US"] == "250" and env["MOEREPLAY_BENCH_POLL_US"] == "57"
    assert "MOEREPLAY_CAPTURE" not in env  # nothing recorded
    env = bench.server_environment("flight", tmp_path / "flight")
    assert not (tmp_path / "flight" / "site" / "moereplay_bench_spin-0.0.dist-info").exists()
    assert env["MOEREPLAY_CAPTURE"] == "1" and "MOEREPLAY_BENCH_SPIN_US" not in env


def test_a_process_loads_it_by_its_entry_point_and_wraps_the_module_when_imported(tmp_path: Path) -> None:
    """As a vLLM process would: the general plugins found by entry point on ``PYTHONPATH`` are called, then the
    layer module is imported (a stand-in under vLLM's module name): its ``triton_kernel_moe_forward`` spins."""
    sys.modules.pop("spin_plugin", None)
    bench = load_tool("serve_bench", BENCH)
    env = bench.server_environment("spin-250", tmp_path / "server")
    env["MOEREPLAY_BENCH_SPIN_US"] = "20000"
    package = tmp_path / "fake" / "vllm" / "model_executor" / "layers" / "fused_moe" / "experts"
    package.mkdir(parents=True)
    for folder in (package, *package.parents[:4]):  # experts up to vllm
        (folder / "__init__.py").write_text("")
    (package / "gpt_oss_triton_kernels_moe.py").write_text(
        "def triton_kernel_moe_forward(hidden_states, w1, w2, gating_output, topk, renormalize):\n"
        "    return hidden_states + topk\n"
    )
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{tmp_path / 'fake'}"
    script = (
        "import time\n"
        "from importlib.metadata import entry_points\n"
        "for ep in entry_points(group='vllm.general_plugins'):\n"
        "    ep.load()()\n"
        "from vllm.model_executor.layers.fused_moe.experts import gpt_oss_triton_kernels_moe as m\n"
        "started = time.perf_counter()\n"
        "result = m.triton_kernel_moe_forward(1, None, None, None, 4, True)\n"
        "print(result, round((time.perf_counter() - started) * 1000))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result, milliseconds = done.stdout.split()
    assert result == "5" and int(milliseconds) >= 20, done.stdout
    # the server's log says the wrapper was in place, and at exit what it did
    assert "moereplay bench spin: wrapped vllm.model_executor.layers.fused_moe.experts." in done.stderr
    assert "moereplay bench spin: 1 calls, 1 spun 20000 µs" in done.stderr, done.stderr[-2000:]
