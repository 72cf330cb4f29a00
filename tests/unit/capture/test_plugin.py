"""register(): nothing at all when off; armed through the real patch table when on."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
import torch

from moereplay.capture import plugin
from moereplay.capture import session as session_module
from moereplay.capture.patching import ORIGINAL

MARLIN_MODULE = "vllm.model_executor.layers.fused_moe.experts.marlin_moe"


def moe_wna16_marlin_gemm(input, output, b_qweight, b_bias, b_scales, a_scales, global_scale, b_qzeros, g_idx, perm,
                          workspace, sorted_token_ids, expert_ids, num_tokens_past_padded, topk_weights,
                          moe_block_size, top_k, mul_topk_weights, b_q_type, size_m, size_n, size_k, is_k_full,
                          use_atomic_add, use_fp32_reduce, is_zp_float, thread_k=-1, thread_n=-1,
                          blocks_per_sm=-1):  # fmt: skip
    """vLLM 0.25.1's wrapper signature over a real CPU computation (a dense matmul stands in for Marlin)."""
    result = input.float() @ b_qweight.float()
    output.copy_(result.to(output.dtype))
    return output


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[types.ModuleType]:
    """``vllm`` and ``vllm._custom_ops`` as module objects, so the real patch table has something to match."""
    vllm = types.ModuleType("vllm")
    vllm.__path__ = []  # type: ignore[attr-defined]
    ops = types.ModuleType("vllm._custom_ops")
    ops.moe_wna16_marlin_gemm = moe_wna16_marlin_gemm  # type: ignore[attr-defined]
    vllm._custom_ops = ops  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm._custom_ops", ops)
    monkeypatch.chdir(tmp_path)
    for key in [k for k in list(__import__("os").environ) if k.startswith("MOEREPLAY_")]:
        monkeypatch.delenv(key)
    yield ops
    session_module.disarm()


def test_entry_point_is_declared() -> None:
    points = [p for p in metadata.entry_points(group="vllm.general_plugins") if p.name == "moereplay"]
    assert [p.value for p in points] == ["moereplay.capture.plugin:register"]
    assert points[0].load() is plugin.register


def test_off_patches_nothing(fake_vllm: types.ModuleType) -> None:
    before = fake_vllm.moe_wna16_marlin_gemm
    finders = list(sys.meta_path)
    plugin.register()
    assert fake_vllm.moe_wna16_marlin_gemm is before
    assert sys.meta_path == finders
    assert session_module.current() is None
    assert not Path("captures").exists()


def test_malformed_setting_logs_one_line_and_patches_nothing(
    fake_vllm: types.ModuleType, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MOEREPLAY_CAPTURE", "1")
    monkeypatch.setenv("MOEREPLAY_MAX_BYTES", "lots")
    before = fake_vllm.moe_wna16_marlin_gemm
    with caplog.at_level(logging.ERROR, logger="moereplay.capture"):
        plugin.register()
    assert fake_vllm.moe_wna16_marlin_gemm is before
    assert any("capture stays off: MOEREPLAY_MAX_BYTES='lots'" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("MOEREPLAY_CAPTURE", "perhaps")
    plugin.register()
    assert fake_vllm.moe_wna16_marlin_gemm is before


def test_on_arms_real_patch_points_and_records(
    fake_vllm: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MOEREPLAY_CAPTURE", "1")
    # register() sets MOEREPLAY_DIR for child processes; setenv+delenv makes monkeypatch restore it afterwards
    monkeypatch.setenv("MOEREPLAY_DIR", "")
    monkeypatch.delenv("MOEREPLAY_DIR")
    original = fake_vllm.moe_wna16_marlin_gemm
    plugin.register()
    plugin.register()  # vLLM may load plugins more than once: idempotent
    session = session_module.current()
    assert session is not None
    wrapped = fake_vllm.moe_wna16_marlin_gemm
    assert wrapped is not original and getattr(wrapped, ORIGINAL) is original
    assert "vllm._custom_ops:moe_wna16_marlin_gemm" in session.patcher.sites
    # the default directory is shared with child processes through the environment
    assert Path(__import__("os").environ["MOEREPLAY_DIR"]) == session.path.parent
    assert session.path.name == f"rank0-pid{__import__('os').getpid()}.zst"

    x = torch.randn(3, 16)
    weight = torch.randn(16, 4)
    out = torch.empty(3, 4)
    none = None
    result = fake_vllm.moe_wna16_marlin_gemm(
        x, out, weight, none, torch.ones(1), none, none, none, none, none, torch.zeros(4, dtype=torch.int32),
        torch.arange(3), torch.zeros(1, dtype=torch.int32), torch.tensor([3]), torch.ones(3, 1), 8, 1, False,
        "scalar-type", 3, 4, 16, True, False, True, False,
    )  # fmt: skip
    assert result is out
    session.flush()
    session_module.disarm()
    assert fake_vllm.moe_wna16_marlin_gemm is original

    from moereplay.format import CaptureReader

    with CaptureReader(session.path) as reader:
        (record,) = list(reader.calls())
        assert record.op == "moe_wna16_marlin_gemm" and record.status == "completed"
        assert record.site == "vllm._custom_ops:moe_wna16_marlin_gemm"
        assert list(record.args)[:3] == ["input", "output", "b_qweight"]
        assert record.args["thread_k"] == -1 and record.args["size_k"] == 16
        assert "b_qweight" in record.static
        loaded = reader.load_args(0)
        assert torch.equal(loaded["b_qweight"], weight) and torch.equal(loaded["input"], x)
        assert torch.equal(reader.load_outputs(0)["output"], x @ weight)


def test_module_imported_after_arming_is_patched(
    fake_vllm: types.ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The post-import hook wraps a patch point whose module is imported after register()."""
    package = tmp_path / "site" / "vllm" / "model_executor" / "layers" / "fused_moe" / "experts"
    package.mkdir(parents=True)
    for level in [package, *package.parents][:5]:
        (level / "__init__.py").write_text("")
    (package / "marlin_moe.py").write_text(
        "def fused_marlin_moe(hidden_states, w1, w2, output=None):\n    return hidden_states @ w1 @ w2\n"
    )
    sys.modules["vllm"].__path__ = [str(tmp_path / "site" / "vllm")]
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in [n for n in sys.modules if n.startswith("vllm.model_executor")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setenv("MOEREPLAY_CAPTURE", "1")
    plugin.register()
    import importlib

    module = importlib.import_module(MARLIN_MODULE)
    try:
        assert getattr(module.fused_marlin_moe, ORIGINAL, None) is not None
        value = module.fused_marlin_moe(torch.ones(2, 3), torch.ones(3, 3), torch.ones(3, 1))
        assert torch.equal(value, torch.full((2, 1), 9.0))
        session = session_module.current()
        assert session is not None and session.flush()
        assert session.recorder.counters.selected == 1
    finally:
        for name in [n for n in sys.modules if n.startswith("vllm.model_executor")]:
            sys.modules.pop(name, None)
