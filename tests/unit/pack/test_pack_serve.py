"""The serve pack: building it from a fake vLLM wheel and fake serving wheels (no download), attaching it to an
unpacked kernel pack, the companion checks, ``$MOEREPLAY_SERVE_PACK``, the ``vllm`` script and the device prelude."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packfakes import fake_extra_wheels, fake_serve_wheels, fake_vllm_wheel, python_on_path, write_wheel
from typer.testing import CliRunner

from moereplay.cli import app
from moereplay.errors import PackError
from moereplay.pack import BuildOptions, build_pack, load_pack, unpack_pack
from moereplay.pack.archive import read_tar_names
from moereplay.pack.download import VLLM_SERVE_REQUIREMENTS
from moereplay.pack.elf import SHT_NOBITS, parse_elf
from moereplay.pack.load import check_companion, serve_pack_setting
from moereplay.pack.manifest import PackManifest
from moereplay.pack.profiles import PROFILES, pack_profile

REPO = Path(__file__).resolve().parents[3]
FA3 = "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"


def _build(root: Path, profile: str, wheel: Path, name: str | None = None) -> Path:
    extras = (
        fake_serve_wheels(root / "serve-wheels") if profile == "serve" else fake_extra_wheels(root / "extras")
    )
    output = root / (name or profile)
    build_pack(
        BuildOptions(
            vllm_version="0.25.1",
            output=output,
            wheel=wheel,
            extra_wheels=extras,
            xz_preset=0,
            profile=profile,
        )  # type: ignore[arg-type]
    )
    return output


@pytest.fixture(scope="module")
def packs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("serve")
    wheel = fake_vllm_wheel(root)
    return _build(root, "kernels", wheel), _build(root, "serve", wheel)


def _manifest(directory: Path) -> PackManifest:
    return PackManifest.from_json((directory / "manifest.json").read_text())


def test_serve_manifest_names_profile_wheel_and_torch(packs: tuple[Path, Path]) -> None:
    kernels, serve = packs
    manifest = _manifest(serve)
    assert manifest.profile == "serve" and manifest.label == "vLLM 0.25.1 serve pack"
    assert manifest.vllm_wheel == _manifest(kernels).vllm_wheel and manifest.torch_pin == "2.11.0"
    assert manifest.arch == "sm_90" and manifest.python_files == 0 and manifest.tree_files == 1
    [library] = manifest.libraries
    assert library.member == FA3 and library.slimmed and library.entries_zeroed == 0
    assert library.containers == 2 and library.containers_without_code == 0
    assert {wheel.name for wheel in manifest.extra_wheels} == {
        re.sub(r"[-_.]+", "-", pin.split("==")[0]).lower() for pin in VLLM_SERVE_REQUIREMENTS
    }
    assert {wheel.purpose for wheel in manifest.extra_wheels} == {"vllm-serve"}
    xgrammar = next(wheel for wheel in manifest.extra_wheels if wheel.name == "xgrammar")
    assert xgrammar.dropped == ("xgrammar/lib/*.a",) and xgrammar.debug_bytes_blanked == 230
    assert PackManifest.from_json(json.dumps(json.loads(manifest.to_json()))) == manifest


def test_serve_pack_holds_fa3_and_the_serving_wheels_only(packs: tuple[Path, Path]) -> None:
    _, serve = packs
    assert read_tar_names(serve / "tree.tar.xz") == [FA3]
    deps = set(read_tar_names(serve / "deps.tar.xz"))
    assert {"fastapi/__init__.py", "uvicorn/__init__.py", "xgrammar/libxgrammar_bindings.so"} <= deps
    assert "xgrammar/lib/libxgrammar.a" not in deps and "pydantic/__init__.py" not in deps


def test_profiles_are_data() -> None:
    assert pack_profile("serve").libraries == (FA3,) and not pack_profile("serve").python_tree
    assert (
        PROFILES["kernels"].default_output == ".kernelpack"
        and PROFILES["serve"].default_output == ".servepack"
    )
    kernel_wheels = {pin.split("==")[0] for pin, _ in PROFILES["kernels"].requirements}
    assert not kernel_wheels & {pin.split("==")[0] for pin, _ in PROFILES["serve"].requirements}
    with pytest.raises(PackError, match="pack profile 'train' is unknown"):
        pack_profile("train")


def test_attach_links_fa3_into_the_kernel_tree(packs: tuple[Path, Path], tmp_path: Path) -> None:
    kernels, serve = packs
    alone = unpack_pack(kernels, tmp_path / "cache")
    assert alone.serve is None and len(alone.paths) == 2
    unpacked = unpack_pack(kernels, tmp_path / "cache", serve=serve)
    assert unpacked.root == alone.root and unpacked.serve is not None  # the kernel tree is shared
    assert unpacked.paths == (alone.site, alone.aliases, unpacked.serve.site)
    link = unpacked.site / FA3
    assert link.is_symlink() and not Path(os.readlink(link)).is_absolute()
    assert link.resolve() == (unpacked.serve.site / FA3).resolve()
    assert parse_elf(link.read_bytes()).section(".nv_fatbin") is not None
    assert (unpacked.serve.site / "fastapi" / "__init__.py").is_file()
    library = (unpacked.serve.site / "xgrammar" / "libxgrammar_bindings.so").read_bytes()
    debug = parse_elf(library).section(".debug_info")
    assert debug is not None and debug.type == SHT_NOBITS and not any(library[debug.offset : debug.end])
    script = unpacked.serve.bin / "vllm"
    assert script.stat().st_mode & 0o111 and "vllm.entrypoints.cli.main" in script.read_text()
    # attaching again finds everything in place
    assert unpack_pack(kernels, tmp_path / "cache", serve=serve) == unpacked


def test_vllm_script_runs_the_cli_module(packs: tuple[Path, Path], tmp_path: Path) -> None:
    kernels, serve = packs
    unpacked = unpack_pack(kernels, tmp_path / "cache", serve=serve)
    assert unpacked.serve is not None
    bin_dir = tmp_path / "bin"
    python_on_path(bin_dir)
    env = {
        "PATH": f"{unpacked.serve.bin}{os.pathsep}{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(str(path) for path in unpacked.paths),
    }
    finished = subprocess.run(
        ["vllm", "serve", "MODEL"], env=env, capture_output=True, text=True, check=False, timeout=60
    )
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout == "fake vllm cli serve MODEL\n"


def test_a_changed_serve_pack_replaces_the_link(packs: tuple[Path, Path], tmp_path: Path) -> None:
    kernels, serve = packs
    first = unpack_pack(kernels, tmp_path / "cache", serve=serve)
    other = tmp_path / "other"
    shutil.copytree(serve, other)
    manifest = _manifest(other)
    wheels = tmp_path / "more-wheels"
    shutil.copytree(serve.parent / "serve-wheels", wheels)
    write_wheel(wheels / "setproctitle-1.3.7-py3-none-any.whl", {"setproctitle/__init__.py": b""})
    rebuilt = build_pack(
        BuildOptions(
            vllm_version="0.25.1",
            output=tmp_path / "serve2",
            wheel=serve.parent / "vllm-0.25.1-cp38-abi3-manylinux_2_28_x86_64.whl",
            extra_wheels=wheels,
            xz_preset=0,
            profile="serve",
        )
    )
    assert rebuilt.files != manifest.files
    second = unpack_pack(kernels, tmp_path / "cache", serve=tmp_path / "serve2")
    assert second.serve is not None and first.serve is not None and second.serve.root != first.serve.root
    assert (second.site / FA3).resolve() == (second.serve.site / FA3).resolve()


def test_companion_checks(packs: tuple[Path, Path], tmp_path: Path) -> None:
    kernels, serve = packs
    kernel_manifest, serve_manifest = _manifest(kernels), _manifest(serve)
    check_companion(kernel_manifest, serve_manifest)
    with pytest.raises(
        PackError, match=re.escape("vLLM 0.25.1 serve pack given where a kernels pack is expected")
    ):
        check_companion(serve_manifest, serve_manifest)
    with pytest.raises(
        PackError, match=re.escape("vLLM 0.25.1 kernel pack given where a serve pack is expected")
    ):
        check_companion(kernel_manifest, kernel_manifest)
    other_wheel = fake_vllm_wheel(tmp_path, salt=b"# another build\n")
    foreign = _build(tmp_path, "serve", other_wheel, name="foreign")
    with pytest.raises(
        PackError, match=r"serve pack is for vllm-0\.25\.1-.*\.whl \(sha256 [0-9a-f]{12}, torch"
    ):
        unpack_pack(kernels, tmp_path / "cache", serve=foreign)
    with pytest.raises(PackError, match=re.escape("is a vLLM 0.25.1 serve pack: load the kernels pack")):
        unpack_pack(serve, tmp_path / "cache")
    overlapping = dataclasses.replace(serve_manifest, extra_wheels=kernel_manifest.extra_wheels[:1])
    with pytest.raises(PackError, match="both hold annotated-types"):
        check_companion(kernel_manifest, overlapping)
    whole = dataclasses.replace(serve_manifest, arch=None)
    with pytest.raises(PackError, match="serve pack is slimmed for all, the kernel pack for sm_90"):
        check_companion(kernel_manifest, whole)


def test_load_pack_checks_the_serve_pack_before_torch(
    packs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernels, _ = packs
    monkeypatch.setattr(sys, "version_info", (3, 12, 0, "final", 0))
    with pytest.raises(PackError, match="kernel pack given where a serve pack is expected"):
        load_pack(kernels, cache_dir=tmp_path / "cache", serve=kernels)


def test_build_refuses_to_replace_a_pack_of_the_other_profile(
    packs: tuple[Path, Path], tmp_path: Path
) -> None:
    kernels, _ = packs
    copy = tmp_path / "kernels"
    shutil.copytree(kernels, copy)
    with pytest.raises(PackError, match="holds a kernels pack: refusing to replace it with a serve pack"):
        _build(
            tmp_path, "serve", kernels.parent / "vllm-0.25.1-cp38-abi3-manylinux_2_28_x86_64.whl", "kernels"
        )


def test_serve_pack_setting(tmp_path: Path) -> None:
    default = tmp_path / ".servepack"
    assert serve_pack_setting({}, default) is None  # no pack there
    default.mkdir()
    (default / "manifest.json").write_text("{}")
    assert serve_pack_setting({}, default) == default
    assert serve_pack_setting({"MOEREPLAY_SERVE_PACK": ""}, default) is None
    assert serve_pack_setting({"MOEREPLAY_SERVE_PACK": "/elsewhere"}, default) == Path("/elsewhere")


def test_kernels_pack_command_with_serve_profile(tmp_path: Path) -> None:
    wheel = fake_vllm_wheel(tmp_path)
    extras = fake_serve_wheels(tmp_path / "extras")
    arguments = ["kernels", "pack", "--vllm", "0.25.1", "--profile", "serve", "--wheel", str(wheel)]
    arguments += ["--extra-wheels", str(extras), "--xz-preset", "0", "-o", str(tmp_path / "serve")]
    result = CliRunner().invoke(app, arguments)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "vLLM 0.25.1 serve pack: torch==2.11.0, CUDA 13, arch sm_90, 0 Python files (1 in tree)" in text
    assert "xgrammar 0.2.3" in text
    bad = CliRunner().invoke(app, [*arguments[:4], "--profile", "train", *arguments[6:]])
    assert bad.exit_code == 2 and "train" in bad.output


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_device_setup_prelude_with_serve_pack(packs: tuple[Path, Path], tmp_path: Path) -> None:
    kernels, serve = packs
    bin_dir = tmp_path / "bin"
    python_on_path(bin_dir)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "MOEREPLAY_PACK": str(kernels),
        "MOEREPLAY_SERVE_PACK": str(serve),
        "MOEREPLAY_PACK_CACHE": str(tmp_path / "cache"),
    }
    script = (
        "source tools/gpu/device_setup.sh && vllm serve M && "
        "python3 -c 'import fastapi, vllm, os; print(fastapi.NAME, os.environ[\"MOEREPLAY_SERVE_PACK\"])' && "
        "readlink \"$(python3 -c 'import vllm, os; print(os.path.dirname(vllm.__file__))')/vllm_flash_attn/"
        '_vllm_fa3_C.abi3.so"'
    )
    finished = subprocess.run(
        ["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, check=False, timeout=120
    )
    assert finished.returncode == 0, finished.stderr
    lines = finished.stdout.strip().splitlines()
    assert lines[0].endswith(f"serve pack {serve}")
    assert lines[1] == "fake vllm cli serve M"
    assert lines[2] == f"fastapi {serve}"
    assert lines[3].startswith("../../../serve-") and lines[3].endswith(f"/site/{FA3}")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_device_setup_leaves_out_a_default_serve_pack_that_does_not_fit(
    packs: tuple[Path, Path], tmp_path: Path
) -> None:
    kernels, _ = packs
    repo = tmp_path / "repo"
    (repo / "tools" / "gpu").mkdir(parents=True)
    shutil.copy(REPO / "tools" / "gpu" / "device_setup.sh", repo / "tools" / "gpu" / "device_setup.sh")
    (repo / "moereplay").symlink_to(REPO / "moereplay")
    _build(tmp_path, "serve", fake_vllm_wheel(tmp_path, salt=b"# another build\n"), name="repo/.servepack")
    bin_dir = tmp_path / "bin"
    python_on_path(bin_dir)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "MOEREPLAY_PACK": str(kernels),
        "MOEREPLAY_PACK_CACHE": str(tmp_path / "cache"),
    }
    script = 'source tools/gpu/device_setup.sh && echo "[$MOEREPLAY_SERVE_PACK]"'
    finished = subprocess.run(
        ["bash", "-c", script], cwd=repo, env=env, capture_output=True, text=True, check=False, timeout=120
    )
    assert finished.returncode == 0, finished.stderr
    assert f"leaving out the serve pack {repo / '.servepack'}: serve pack is for" in finished.stderr
    assert finished.stdout.strip().splitlines()[-1] == "[]"
    env["MOEREPLAY_SERVE_PACK"] = str(repo / ".servepack")  # named explicitly: a mismatch is an error
    finished = subprocess.run(
        ["bash", "-c", script], cwd=repo, env=env, capture_output=True, text=True, check=False, timeout=120
    )
    assert finished.returncode != 0 and "device_setup: cannot unpack the kernel pack" in finished.stderr
