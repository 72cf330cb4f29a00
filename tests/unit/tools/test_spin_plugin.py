"""``tools/serve/spin_plugin.py``, serve_bench's serving-thread-time diagnostic: the wrapped call spins the time asked
for and returns what the call returns; a GIL-holding thread starts once; nothing is wrapped unless asked; the
servers of its settings get the plugin's entry point and folder, the others do not."""

from __future__ import annotations

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
