"""The graph gate keeps the writer thread's CUDA work out of CUDA graph captures (CPU: threads and a stand-in
graph class; the real torch.cuda.CUDAGraph is exercised on the GPU by test_graph_gate_gpu.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from moereplay.capture import session as session_module
from moereplay.capture.graph_gate import GraphGate, install

HANG_GUARD_S = 10.0  # liveness only: every wait below ends as soon as the other thread moves


class FakeGraph:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def capture_begin(self, *args: object, **kwargs: object) -> None:
        self.calls.append("begin")

    def capture_end(self) -> None:
        self.calls.append("end")


def test_a_capture_waits_for_the_writers_current_device_work() -> None:
    gate = GraphGate()
    inside, release, captured = threading.Event(), threading.Event(), threading.Event()
    order: list[str] = []

    def writer() -> None:
        with gate.device_work():
            inside.set()
            release.wait(HANG_GUARD_S)
            order.append("writer done")

    def capture() -> None:
        gate.begin_capture()
        order.append("capture began")
        captured.set()

    worker = threading.Thread(target=writer)
    worker.start()
    assert inside.wait(HANG_GUARD_S)
    capturer = threading.Thread(target=capture)
    capturer.start()
    assert not captured.wait(0.2)  # still blocked behind the writer
    deadline = time.monotonic() + HANG_GUARD_S
    while gate.waits < 1 and time.monotonic() < deadline:  # (a loaded machine may start the capturer late)
        time.sleep(0.005)
    release.set()
    worker.join(HANG_GUARD_S)
    capturer.join(HANG_GUARD_S)
    assert order == ["writer done", "capture began"] and gate.waits == 1 and gate.captures == 1
    gate.end_capture()
    assert gate.captures == 0


def test_device_work_waits_while_any_graph_is_captured() -> None:
    gate = GraphGate()
    gate.begin_capture()
    gate.begin_capture()  # two graphs at once (other threads or streams)
    entered = threading.Event()

    def writer() -> None:
        with gate.device_work():
            entered.set()

    worker = threading.Thread(target=writer)
    worker.start()
    gate.end_capture()
    assert not entered.wait(0.2)  # one capture still open
    gate.end_capture()
    assert entered.wait(HANG_GUARD_S)
    worker.join(HANG_GUARD_S)


def test_a_stuck_writer_delays_a_capture_only_up_to_the_limit(caplog: pytest.LogCaptureFixture) -> None:
    gate = GraphGate(wait_s=0.05)
    inside, release = threading.Event(), threading.Event()

    def writer() -> None:
        with gate.device_work():
            inside.set()
            release.wait(HANG_GUARD_S)

    worker = threading.Thread(target=writer)
    worker.start()
    assert inside.wait(HANG_GUARD_S)
    gate.begin_capture()  # returns after wait_s even though the writer has not finished
    assert gate.timeouts == 1 and gate.captures == 1
    assert "still busy" in caplog.text
    release.set()
    worker.join(HANG_GUARD_S)
    gate.end_capture()


def test_install_wraps_capture_begin_and_end_and_undo_restores_them() -> None:
    gate = GraphGate()
    begin, end = FakeGraph.capture_begin, FakeGraph.capture_end
    undo = install(gate, FakeGraph)
    graph = FakeGraph()
    graph.capture_begin(pool=None, capture_error_mode="global")
    assert gate.captures == 1 and graph.calls == ["begin"]
    graph.capture_end()
    assert gate.captures == 0 and graph.calls == ["begin", "end"]
    undo()
    assert FakeGraph.capture_begin is begin and FakeGraph.capture_end is end


def test_begun_and_ending_hooks_bracket_each_capture_with_its_own_token(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # the flight recorder opens a graph for staged ring nodes once its capture has begun, and joins their side
    # stream right before that capture ends — two graphs captured at once each get back their own token
    gate = GraphGate()
    undo = install(gate, FakeGraph)
    order: list[str] = []
    tokens = iter(["first", "second"])
    gate.begun = lambda: order.append("begun") or next(tokens)
    gate.ending = lambda token: order.append(f"ending {token}")
    gate.ended = lambda token: order.append(f"ended {token} after {graph_calls()}")
    one, two = FakeGraph(), FakeGraph()

    def graph_calls() -> str:
        return f"{one.calls[-1]}/{two.calls[-1] if two.calls else '-'}"

    try:
        one.capture_begin()
        two.capture_begin()
        one.capture_end()
        two.capture_end()
        assert order == [
            "begun",
            "begun",
            "ending first",
            "ended first after end/begin",  # after the real capture_end: the side stream is free only then
            "ending second",
            "ended second after end/end",
        ]
        assert one.calls == ["begin", "end"] and gate.captures == 0
        gate.begun = lambda: (_ for _ in ()).throw(RuntimeError("no side stream"))  # logged, never raised
        one.capture_begin()
        one.capture_end()  # no token: ``ending`` and ``ended`` are not called
        assert order[-1] == "ended second after end/end" and "begin hook failed: RuntimeError" in caplog.text
    finally:
        undo()


def test_a_failing_capture_begin_releases_the_gate() -> None:
    class Refusing(FakeGraph):
        def capture_begin(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("capture refused")

    gate = GraphGate()
    undo = install(gate, Refusing)
    with pytest.raises(RuntimeError, match="capture refused"):
        Refusing().capture_begin()
    assert gate.captures == 0
    undo()
    assert (
        "capture_begin" in Refusing.__dict__
        and Refusing.__dict__["capture_begin"].__name__ == "capture_begin"
    )


def test_arming_gates_torch_cuda_graphs_and_disarming_restores_them(tmp_path: Path) -> None:
    begin = torch.cuda.CUDAGraph.__dict__["capture_begin"]
    env = {"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_DIR": str(tmp_path / "captures")}
    session = session_module.arm(env, targets=())
    assert session is not None
    try:
        wrapped = torch.cuda.CUDAGraph.__dict__["capture_begin"]
        assert wrapped is not begin and wrapped.__wrapped__ is begin
        assert session.writer._gate is session.gate
        gate = session.gate
        assert (gate.prepare, gate.begun, gate.ending, gate.ended) == (
            session.recorder.prepare_graph_capture,
            session.recorder.graph_capture_begun,
            session.recorder.graph_capture_ending,
            session.recorder.graph_capture_ended,
        )
        assert gate.begun() is None  # no flight recorder armed: nothing to stage, nothing to close
    finally:
        session_module.disarm()
    assert torch.cuda.CUDAGraph.__dict__["capture_begin"] is begin
