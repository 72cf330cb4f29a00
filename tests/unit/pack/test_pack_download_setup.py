"""pip download invocation (pip replaced by a recording stand-in: no network), reuse of a downloaded vLLM wheel,
and the GPU-machine prelude ``tools/gpu/device_setup.sh`` run for real on a fake pack."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packfakes import fake_extra_wheels, fake_vllm_wheel, python_on_path

from moereplay.errors import PackError
from moereplay.pack import BuildOptions, build_pack
from moereplay.pack.build import find_vllm_wheel
from moereplay.pack.download import pip_download

REPO = Path(__file__).resolve().parents[3]


def test_pip_download_command_and_failure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[list[str]] = []

    def fake_run(command: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        seen.append(command)
        return subprocess.CompletedProcess(
            command, 1, "", "Collecting x\nERROR: No matching distribution found\n"
        )

    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(
        PackError, match=re.escape("pip download vllm==9.9 failed: ERROR: No matching distribution found")
    ):
        pip_download(("vllm==9.9",), tmp_path)
    command = seen[0]
    assert command[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in command and "--only-binary=:all:" in command
    assert command[command.index("--python-version") + 1] == "3.12"
    assert "manylinux_2_28_x86_64" in command and "manylinux2014_x86_64" in command
    assert command[-1] == "vllm==9.9" and command[command.index("-d") + 1] == str(tmp_path)


def test_a_downloaded_wheel_is_reused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("must not run pip"))
    wheel = fake_vllm_wheel(tmp_path)
    options = BuildOptions(vllm_version="0.25.1", output=tmp_path / "o", download_dir=tmp_path)
    assert find_vllm_wheel(options, lambda message: None) == wheel


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_device_setup_prelude_unpacks_and_exports(tmp_path: Path) -> None:
    root = tmp_path / "build"
    root.mkdir()
    build_pack(
        BuildOptions(
            vllm_version="0.25.1",
            output=tmp_path / "pack",
            wheel=fake_vllm_wheel(root),
            extra_wheels=fake_extra_wheels(root / "extras"),
            xz_preset=0,
        )
    )
    bin_dir = tmp_path / "bin"
    python_on_path(bin_dir)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "MOEREPLAY_PACK": str(tmp_path / "pack"),
        "MOEREPLAY_PACK_CACHE": str(tmp_path / "cache"),
        "MOEREPLAY_SERVE_PACK": "",  # none, even if the checkout holds a .servepack
    }
    script = (
        "source tools/gpu/device_setup.sh && "
        "python3 -c 'import vllm, triton_kernels.matmul_ogs as m, moereplay; print(vllm.__file__, m.VALUE)'"
    )
    finished = subprocess.run(
        ["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, check=False, timeout=120
    )
    assert finished.returncode == 0, finished.stderr
    lines = finished.stdout.strip().splitlines()
    assert lines[0].startswith("device_setup: python ") and "pack vLLM 0.25.1 sm_90 torch==2.11.0" in lines[0]
    assert lines[0].endswith("serve pack none")
    assert str(tmp_path / "cache") in lines[1] and lines[1].endswith(" 7")
