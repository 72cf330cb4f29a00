"""Archives (deterministic, safe to unpack), wheel reading, and the ``moereplay kernels`` commands."""

from __future__ import annotations

import io
import json
import lzma
import tarfile
import zipfile
from pathlib import Path

import pytest
from packfakes import fake_extra_wheels, fake_vllm_wheel, write_wheel
from typer.testing import CliRunner

from moereplay.cli import app, main
from moereplay.errors import PackError
from moereplay.pack import BuildOptions, build_pack
from moereplay.pack.archive import ArchiveMember, check_member_path, extract_tar_xz, write_tar_xz
from moereplay.pack.wheels import open_wheel, parse_wheel_name, read_metadata, torch_pin, wheel_members


def test_archives_are_deterministic_and_round_trip(tmp_path: Path) -> None:
    members = [ArchiveMember("b/c.py", b"print(1)\n"), ArchiveMember("a.so", b"\x7fELF", executable=True)]
    write_tar_xz(tmp_path / "one.tar.xz", members, preset=1)
    write_tar_xz(tmp_path / "two.tar.xz", list(reversed(members)), preset=1)
    assert (tmp_path / "one.tar.xz").read_bytes() == (tmp_path / "two.tar.xz").read_bytes()
    assert extract_tar_xz(tmp_path / "one.tar.xz", tmp_path / "out") == 2
    assert (tmp_path / "out" / "b" / "c.py").read_bytes() == b"print(1)\n"
    assert (tmp_path / "out" / "a.so").stat().st_mode & 0o111


@pytest.mark.parametrize("path", ["/etc/passwd", "../up.py", "a/../../b", "", ".", "a\\b"])
def test_unsafe_member_paths_are_refused(path: str) -> None:
    with pytest.raises(PackError, match="unsafe path"):
        check_member_path(path)


def _raw_tar_xz(path: Path, build) -> Path:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        build(tar)
    path.write_bytes(lzma.compress(buffer.getvalue()))
    return path


def test_extraction_refuses_links_and_traversal(tmp_path: Path) -> None:
    def with_link(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo("evil")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc"
        tar.addfile(info)

    def with_traversal(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))

    with pytest.raises(PackError, match="non-regular entry 'evil'"):
        extract_tar_xz(_raw_tar_xz(tmp_path / "l.tar.xz", with_link), tmp_path / "o1")
    with pytest.raises(PackError, match="unsafe path"):
        extract_tar_xz(_raw_tar_xz(tmp_path / "t.tar.xz", with_traversal), tmp_path / "o2")
    assert not (tmp_path / "escape.txt").exists()
    (tmp_path / "bad.tar.xz").write_bytes(b"not xz")
    with pytest.raises(PackError, match="cannot unpack"):
        extract_tar_xz(tmp_path / "bad.tar.xz", tmp_path / "o3")


def test_extraction_size_cap(tmp_path: Path) -> None:
    write_tar_xz(tmp_path / "big.tar.xz", [ArchiveMember("a", bytes(1000))], preset=0)
    with pytest.raises(PackError, match="more than 100 bytes"):
        extract_tar_xz(tmp_path / "big.tar.xz", tmp_path / "out", max_bytes=100)


def test_wheel_names() -> None:
    name = parse_wheel_name("pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl")
    assert (name.normalized, name.version, name.python, name.abi) == (
        "pydantic-core",
        "2.50.5",
        "cp312",
        "cp312",
    )
    assert name.platform == "manylinux2014_x86_64.manylinux_2_17_x86_64" and not name.is_pure
    assert parse_wheel_name("sniffio-1.3.1-py3-none-any.whl").is_pure
    assert parse_wheel_name("pkg-1.0-1build-py3-none-any.whl").version == "1.0"
    with pytest.raises(PackError, match="not a wheel file name"):
        parse_wheel_name("vllm.tar.gz")


def test_torch_pin_from_metadata(tmp_path: Path) -> None:
    with open_wheel(fake_vllm_wheel(tmp_path, torch="2.11.0")) as wheel:
        assert torch_pin(read_metadata(wheel)) == "2.11.0"
    assert torch_pin({"Requires-Dist": ["numpy", "torch == 2.9.1 ; platform_system == 'Linux'"]}) == "2.9.1"
    with pytest.raises(PackError, match="pins no torch version"):
        torch_pin({"Requires-Dist": ["torch>=2.4", "torchvision==0.26.0"]})
    (tmp_path / "broken.whl").write_bytes(b"PK nothing")
    with pytest.raises(PackError, match="cannot open wheel"):
        open_wheel(tmp_path / "broken.whl")


def test_wheel_members_like_pip_target(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": b"",
        "pkg/_cffi.cpython-312-x86_64-linux-gnu.so": b"x",
        "pkg-1.0.data/platlib/pkg/_ext.so": b"so",
        "pkg-1.0.data/headers/pkg.h": b"h",
    }
    with zipfile.ZipFile(write_wheel(tmp_path / "pkg-1.0-cp312-cp312-linux_x86_64.whl", files)) as wheel:
        paths = sorted(member.path for member in wheel_members(wheel, drop=("pkg/_cffi.*.so",)))
    assert paths == [
        "pkg-1.0.dist-info/METADATA", "pkg-1.0.dist-info/RECORD", "pkg-1.0.dist-info/WHEEL",
        "pkg/__init__.py", "pkg/_ext.so",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    build_pack(
        BuildOptions(
            vllm_version="0.25.1",
            output=root / "pack",
            wheel=fake_vllm_wheel(root),
            extra_wheels=fake_extra_wheels(root / "extras"),
            xz_preset=0,
        )
    )
    return root / "pack"


def test_kernels_info(pack_dir: Path) -> None:
    result = CliRunner().invoke(app, ["kernels", "info", str(pack_dir)])
    assert result.exit_code == 0, result.output
    assert "vLLM 0.25.1 kernel pack: torch==2.11.0, CUDA 13, arch sm_90" in result.output
    assert "18 fatbin entries zeroed" in result.output
    assert "sm_120" in result.output and "pydantic-core 2.50.5" in result.output
    text = " ".join(result.output.split())  # rich wraps at the terminal width
    assert "1 with no code for sm_90, 1 reaching it only through PTX JIT" in text
    assert "not for sm_90" in text and "sm_90 cubin beside" in text


def test_kernels_info_json(pack_dir: Path) -> None:
    result = CliRunner().invoke(app, ["kernels", "info", "--json", str(pack_dir)])
    assert result.exit_code == 0
    assert json.loads(result.output)["torch_pin"] == "2.11.0"


def test_kernels_pack_command(tmp_path: Path) -> None:
    wheel = fake_vllm_wheel(tmp_path)
    extras = fake_extra_wheels(tmp_path / "extras")
    arguments = ["kernels", "pack", "--vllm", "0.25.1", "--wheel", str(wheel), "--arch", "all"]
    arguments += ["--extra-wheels", str(extras), "--xz-preset", "0", "-o", str(tmp_path / "pack")]
    result = CliRunner().invoke(app, arguments)
    assert result.exit_code == 0, result.output
    assert "arch all" in result.output and "0 fatbin entries zeroed" in result.output
    assert f"wrote {tmp_path / 'pack'}" in result.output


def test_kernels_errors_are_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["kernels", "info", str(tmp_path)])
    assert caught.value.code == 2
    error = capsys.readouterr().err
    assert error == f"moereplay: {tmp_path} is not a kernel pack (no manifest.json)\n"
