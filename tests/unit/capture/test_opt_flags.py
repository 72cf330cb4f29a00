"""triton_kernels process state: a recorded matmul_ogs call carries the opt_flags constraints in force (as the
op's pseudo-arguments), a manual override (in its context) and the flags the library chose (its ``opt_flags``
output). triton_kernels needs triton, so a small package with the same layout stands in: ``matmul_ogs`` (a real
CPU matmul) looks ``make_opt_flags`` up in its globals, imported from ``matmul_ogs_details.opt_flags``, which
honours the module's ``_opt_flags_constraints`` and ``_opt_flags`` as triton_kernels does."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from moereplay.capture import session as session_module
from moereplay.capture.patch_points import CaptureTarget
from moereplay.capture.patching import ORIGINAL
from moereplay.format import CaptureReader
from moereplay.ops.matmul_ogs_surface import OGS_CODECS, PROCESS_STATE

PACKAGE = "moereplay_test_tk"
CALLER = "moereplay_test_gpt_oss"

OPT_FLAGS_SOURCE = """
from dataclasses import dataclass

@dataclass
class OptFlags:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    split_k: int
    is_persistent: bool
    epilogue_subtile: int | None
    target_kernel_kwargs: dict

_opt_flags_constraints: dict = dict()
_opt_flags = None

def update_opt_flags_constraints(constraints):
    _opt_flags_constraints.update(constraints)

def make_opt_flags(m, n, k):
    if _opt_flags is not None:
        return _opt_flags
    block_m = _opt_flags_constraints.get("block_m") or max(16, min(128, 1 << (m - 1).bit_length()))
    split_k = _opt_flags_constraints.get("split_k") or (2 if k >= 64 else 1)
    return OptFlags(block_m, 64, 32, 4, split_k, False, None, {"maxnreg": 128})
"""

MATMUL_SOURCE = f"""
import torch
from {PACKAGE}.matmul_ogs_details.opt_flags import make_opt_flags

def matmul_ogs(x, w, bias, routing_data=None, gather_indx=None, scatter_indx=None, precision_config=None,
               betas=None, gammas=None, out_alpha=None, y=None, fused_activation=None, epilogue=None):
    flags = make_opt_flags(x.shape[0], w.shape[-1], x.shape[-1])
    out = x @ w if bias is None else x @ w + bias
    if y is None:
        return out
    y.copy_(out)
    return y
"""

CALLER_SOURCE = f"""
from {PACKAGE}.matmul_ogs import matmul_ogs

def experts(x, w1, w2, y):
    hidden = matmul_ogs(x, w1, None)
    return matmul_ogs(hidden, w2, None, y=y)
"""


def _module(name: str, source: str, *, package: bool = False) -> types.ModuleType:
    module = types.ModuleType(name)
    if package:
        module.__path__ = []  # type: ignore[attr-defined]
    sys.modules[name] = module
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


@pytest.fixture
def tk() -> Iterator[types.SimpleNamespace]:
    names = [PACKAGE, f"{PACKAGE}.matmul_ogs_details", f"{PACKAGE}.matmul_ogs_details.opt_flags",
             f"{PACKAGE}.matmul_ogs", CALLER]  # fmt: skip
    _module(PACKAGE, "", package=True)
    _module(f"{PACKAGE}.matmul_ogs_details", "", package=True)
    opt_flags = _module(f"{PACKAGE}.matmul_ogs_details.opt_flags", OPT_FLAGS_SOURCE)
    matmul = _module(f"{PACKAGE}.matmul_ogs", MATMUL_SOURCE)
    caller = _module(CALLER, CALLER_SOURCE)
    try:
        yield types.SimpleNamespace(opt_flags=opt_flags, matmul=matmul, caller=caller)
    finally:
        session_module.disarm()
        for name in names:
            sys.modules.pop(name, None)


TARGETS = (
    CaptureTarget(
        "matmul_ogs", "kernel", CALLER, "matmul_ogs", static=("w",), outputs=("y",), codec_modules=OGS_CODECS,
        process_state=PROCESS_STATE,
    ),
)  # fmt: skip


def _arm(tmp_path: Path, **settings: str) -> session_module.Session:
    env = {"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_DIR": str(tmp_path / "captures")}
    env.update({f"MOEREPLAY_{key.upper()}": value for key, value in settings.items()})
    session = session_module.arm(env, targets=TARGETS)
    assert session is not None
    return session


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g)
    return x, torch.randn(64, 96, generator=g), torch.randn(96, 64, generator=g), torch.zeros(5, 64)


@pytest.mark.parametrize("trigger", ["always", "flight"])
def test_constraints_and_chosen_flags_are_recorded(tk, tmp_path: Path, trigger: str) -> None:
    # imported here, not at the top: the subprocess test imports this file and must start without the op
    from moereplay.ops.matmul_ogs import PROCESS_ARGS

    tk.opt_flags.update_opt_flags_constraints({"split_k": 1, "block_m": 32})
    session = _arm(tmp_path, trigger=trigger, absmax="1e-9")  # flight: every output "exceeds" → written
    x, w1, w2, y = _inputs()
    result = tk.caller.experts(x, w1, w2, y)
    assert torch.equal(result, (x @ w1) @ w2)
    tk.opt_flags._opt_flags_constraints.clear()  # a later change does not leak into what was recorded
    assert session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        records = list(reader.calls())
        assert [r.op for r in records] == ["matmul_ogs", "matmul_ogs"]
        for record in records:
            assert set(PROCESS_ARGS) <= set(record.args)
            assert record.args["split_k"] == 1 and record.args["block_m"] == 32
            assert record.args["block_k"] is None and record.args["num_warps"] is None
            assert "opt_flags_override" not in record.context
            chosen = record.outputs["opt_flags"]
            assert chosen["block_m"] == 32 and chosen["split_k"] == 1 and chosen["block_n"] == 64
            assert chosen["target_kernel_kwargs"] == {"maxnreg": 128}
            assert chosen["epilogue_subtile"] is None and chosen["is_persistent"] is False


def test_unconstrained_call_records_the_heuristic_choice_and_a_manual_override(tk, tmp_path: Path) -> None:
    session = _arm(tmp_path)
    x, w1, w2, y = _inputs()
    tk.caller.experts(x, w1, w2, y)
    tk.opt_flags._opt_flags = tk.opt_flags.OptFlags(128, 128, 128, 8, 1, True, 2, {})
    tk.caller.experts(x, w1, w2, y)
    session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        first, second, third, fourth = reader.calls()
        assert first.args["split_k"] is None and first.outputs["opt_flags"]["split_k"] == 2
        assert first.outputs["opt_flags"]["block_m"] == 16
        assert "opt_flags_override" not in second.context
        for record in (third, fourth):
            assert record.context["opt_flags_override"]["block_m"] == 128
            assert record.outputs["opt_flags"]["is_persistent"] is True


def test_make_opt_flags_hook_is_undone_at_disarm_and_idle_when_not_recording(tk, tmp_path: Path) -> None:
    original = tk.matmul.make_opt_flags
    session = _arm(tmp_path, ops="nothing")  # armed, wrapped, records nothing
    hooked = tk.matmul.make_opt_flags
    assert hooked is not original and hooked.__wrapped__ is original
    x, w1, w2, y = _inputs()
    assert torch.equal(tk.caller.experts(x, w1, w2, y), (x @ w1) @ w2)
    assert session.recorder.counters.selected == 0
    session_module.disarm()
    assert tk.matmul.make_opt_flags is original


def test_arming_the_matmul_ogs_patch_point_registers_the_ogs_codecs(tmp_path: Path) -> None:
    """In a fresh interpreter: before arming no triton_kernels codec is registered, after wrapping there is."""
    script = textwrap.dedent(
        f"""
        import sys, types
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from moereplay.format.codecs import codec_for
        from moereplay.capture import session
        import test_opt_flags as t
        name = "triton_kernels.matmul_ogs.PrecisionConfig"
        assert codec_for(name) is None and "moereplay.ops.matmul_ogs" not in sys.modules
        t._module(t.PACKAGE, "", package=True)
        t._module(t.PACKAGE + ".matmul_ogs_details", "", package=True)
        t._module(t.PACKAGE + ".matmul_ogs_details.opt_flags", t.OPT_FLAGS_SOURCE)
        t._module(t.PACKAGE + ".matmul_ogs", t.MATMUL_SOURCE)
        env = {{"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_DIR": {str(tmp_path)!r}}}
        session.arm(env, targets=t.TARGETS)
        assert codec_for(name) is None  # the caller module is not imported yet: nothing wrapped
        t._module(t.CALLER, t.CALLER_SOURCE)  # not through the import system: patch it as a late import would
        session.current().patcher.patch_module(sys.modules[t.CALLER])
        assert codec_for(name) is not None and codec_for("vllm.scalar_type.ScalarType") is not None
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


LAYER_TARGETS = (
    CaptureTarget("experts", "parent", CALLER, "experts", static=("w1", "w2"), outputs=("y",),
                  inputs_intact=True, process_state=PROCESS_STATE, process_state_via="matmul_ogs"),
    TARGETS[0],
)  # fmt: skip


@pytest.mark.parametrize("trigger", ["always", "flight"])
def test_a_layer_call_records_the_constraints_its_gemms_ran_under(tk, tmp_path: Path, trigger: str) -> None:
    # the layer's own arguments stay the function's (no pseudo-arguments: expand passes them back as keywords);
    # the constraints go into its context, read when the call is recorded (flight: when the trigger describes it)
    tk.opt_flags.update_opt_flags_constraints({"split_k": 1, "block_m": 32})
    env = {"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_DIR": str(tmp_path / "captures"), "MOEREPLAY_TRIGGER": trigger,
           "MOEREPLAY_ABSMAX": "1e-9"}  # fmt: skip
    session = session_module.arm(env, targets=LAYER_TARGETS)
    assert session is not None
    x, w1, w2, y = _inputs()
    tk.caller.experts(x, w1, w2, y)
    assert session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        parents = [r for r in reader.calls() if r.op == "experts"]
        assert len(parents) == 1
        (parent,) = parents
        assert parent.context["opt_flags_constraints"] == {"split_k": 1, "block_m": 32}
        assert "opt_flags_override" not in parent.context
        assert set(parent.args) == {"x", "w1", "w2", "y"}


def test_no_constraints_is_recorded_as_none_and_an_override_beside_them(tk, tmp_path: Path) -> None:
    tk.opt_flags._opt_flags = tk.opt_flags.OptFlags(64, 64, 64, 4, 1, False, None, {})
    env = {"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_DIR": str(tmp_path / "captures"), "MOEREPLAY_OPS": "experts"}
    session = session_module.arm(env, targets=LAYER_TARGETS)
    assert session is not None
    x, w1, w2, y = _inputs()
    tk.caller.experts(x, w1, w2, y)
    assert session.flush()
    session.close()
    with CaptureReader(session.path) as reader:
        (parent,) = reader.calls()
        assert parent.context["opt_flags_constraints"] == {}
        assert parent.context["opt_flags_override"]["block_m"] == 64


def test_a_rerun_applies_the_recorded_constraints_and_restores_the_process_state(tk) -> None:
    from moereplay.ops.ogs_process_state import ConstraintsApplied, gemm_of, opt_flags_module
    from moereplay.replay.expand import _gemm_state

    target = LAYER_TARGETS[0]
    gemm = gemm_of(tk.caller.experts, "matmul_ogs")
    assert gemm is tk.matmul.matmul_ogs and opt_flags_module(gemm) is tk.opt_flags
    x = torch.zeros(4, 128)
    assert tk.matmul.make_opt_flags(4, 8, 128).split_k == 2  # this process's heuristic, unconstrained
    before = tk.opt_flags._opt_flags_constraints
    record = types.SimpleNamespace(context={"opt_flags_constraints": {"split_k": 1}})
    state, note = _gemm_state(record, tk.caller.experts, target)
    assert isinstance(state, ConstraintsApplied) and "split_k=1" in (note or "")
    with state:
        assert tk.matmul.make_opt_flags(x.shape[0], 8, x.shape[1]).split_k == 1
    assert tk.opt_flags._opt_flags_constraints is before and before == {}
    assert tk.matmul.make_opt_flags(4, 8, 128).split_k == 2
    # a record from before the constraints were kept: re-run as this process is, and say so
    state, note = _gemm_state(types.SimpleNamespace(context={}), tk.caller.experts, target)
    assert state is None and note is not None and "does not say" in note
    # a layer call whose GEMMs are not triton_kernels': nothing to apply, nothing to say
    plain = CaptureTarget("experts", "parent", CALLER, "experts")
    assert _gemm_state(record, tk.caller.experts, plain) == (None, None)


def test_a_rerun_through_the_capture_wrapper_finds_the_layer_modules_constraints(tk, tmp_path: Path) -> None:
    # expand re-runs a layer call through the session's wrapper (to record its kernel calls): the GEMM and its
    # opt_flags module are found through the function vLLM defined, not the wrapper's globals (on the H200 the
    # wrapper was passed, every gpt-oss layer call re-ran under the default split_k and ~39% of elements differed)
    from moereplay.ops.ogs_process_state import ConstraintsApplied
    from moereplay.replay.expand import _gemm_state

    env = {"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_DIR": str(tmp_path / "captures")}
    session = session_module.arm(env, targets=LAYER_TARGETS)
    assert session is not None
    try:
        wrapped = tk.caller.experts
        assert getattr(wrapped, ORIGINAL, None) is not None
        record = types.SimpleNamespace(context={"opt_flags_constraints": {"split_k": 1}})
        state, note = _gemm_state(record, wrapped, LAYER_TARGETS[0])
        assert isinstance(state, ConstraintsApplied) and state.module is tk.opt_flags, note
        assert note is not None and "re-run under the recorded" in note and "split_k=1" in note
    finally:
        session_module.disarm()
