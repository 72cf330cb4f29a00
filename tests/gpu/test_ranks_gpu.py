"""``moereplay ranks check`` with its float64 layer references on the GPU judges as on the CPU (synthetic TP and EP
rank captures of one Marlin layer call, ``moereplay.synth.ranks``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moereplay.replay.ranks import check_ranks
from moereplay.synth.ranks import write_rank_captures

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # pragma: no cover - needs a GPU
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_a_gpu_check_judges_as_the_cpu_one(mode: str, tmp_path: Path) -> None:
    good = write_rank_captures(tmp_path / "good", mode, **({"experts": 5} if mode == "ep" else {}))
    bad = write_rank_captures(tmp_path / "bad", "tp", corrupt=(1, 3))
    for captures in (good, bad):
        [on_cpu] = check_ranks(captures.paths, device="cpu")
        [on_gpu] = check_ranks(captures.paths, device="cuda")
        assert on_gpu.ok == on_cpu.ok
        assert on_gpu.combined.bad_rows == on_cpu.combined.bad_rows
        assert on_gpu.combined.max_rel == pytest.approx(on_cpu.combined.max_rel, rel=1e-6, abs=1e-12)
    assert check_ranks(good.paths, device="cuda")[0].ok and not check_ranks(bad.paths, device="cuda")[0].ok
