"""Building a pack from a fake vLLM wheel (no download), its manifest, unpacking and the torch pin check."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

import pytest
from packfakes import fake_extra_wheels, fake_vllm_wheel

from moereplay.errors import PackError
from moereplay.pack import BuildOptions, build_pack, check_torch, load_pack, read_manifest, unpack_pack
from moereplay.pack.archive import read_tar_names
from moereplay.pack.elf import parse_elf
from moereplay.pack.fatbin import walk_fatbin
from moereplay.pack.load import LoadedPack, activate, check_python
from moereplay.pack.manifest import PackManifest


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PackManifest]:
    root = tmp_path_factory.mktemp("build")
    wheel = fake_vllm_wheel(root)
    extras = fake_extra_wheels(root / "extras")
    manifest = build_pack(
        BuildOptions(
            vllm_version="0.25.1", output=root / "pack", wheel=wheel, extra_wheels=extras, xz_preset=0
        )
    )
    return root / "pack", manifest


def test_manifest_records_what_was_built(built: tuple[Path, PackManifest]) -> None:
    directory, manifest = built
    assert sorted(path.name for path in directory.iterdir()) == [
        "deps.tar.xz",
        "manifest.json",
        "tree.tar.xz",
    ]
    assert manifest.vllm_version == "0.25.1" and manifest.torch_pin == "2.11.0" and manifest.cuda_major == 13
    assert manifest.profile == "kernels" and manifest.label == "vLLM 0.25.1 kernel pack"
    assert manifest.arch == "sm_90" and manifest.python_files == 6 and manifest.tree_files == 13
    assert manifest.entries_zeroed == 18  # 9 entries in each of the two libraries
    assert [library.member for library in manifest.libraries] == [
        "vllm/_moe_C_stable_libtorch.abi3.so",
        "vllm/_C_stable_libtorch.abi3.so",
    ]
    assert all(
        library.slimmed and library.containers_without_code == 1 and library.containers_ptx_only == 1
        for library in manifest.libraries
    )
    reasons = {(tally.kind, tally.arch): tally.reason for tally in manifest.libraries[0].entries}
    assert reasons["ptx", 90] == "beside-cubin" and reasons["cubin", 75] == "other-arch"
    assert reasons["cubin", 90] is None
    assert {wheel.name for wheel in manifest.extra_wheels} >= {"pydantic-core", "pyzmq", "zstandard"}
    purposes = {wheel.name: wheel.purpose for wheel in manifest.extra_wheels}
    assert purposes["zstandard"] == "moereplay-runtime" and purposes["openai"] == "vllm-import"
    assert [digest.name for digest in manifest.files] == ["tree.tar.xz", "deps.tar.xz"]
    assert read_manifest(directory) == manifest


def test_tree_takes_python_json_dist_info_and_two_libraries(built: tuple[Path, PackManifest]) -> None:
    directory, _ = built
    names = set(read_tar_names(directory / "tree.tar.xz"))
    assert "vllm/third_party/triton_kernels/matmul_ogs.py" in names
    assert "vllm/model_executor/layers/fused_moe/configs/E=8,N=128.json" in names
    assert "vllm-0.25.1.dist-info/METADATA" in names and "vllm/py.typed" in names
    assert "vllm/_C_stable_libtorch.abi3.so" in names and "vllm/_moe_C_stable_libtorch.abi3.so" in names
    assert "vllm/_flashmla_C.abi3.so" not in names and "vllm/entrypoints/templates/chat.jinja" not in names
    assert "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so" not in names  # the serve pack's
    deps = set(read_tar_names(directory / "deps.tar.xz"))
    assert "zmq/extra.py" in deps and "zstandard/__init__.py" in deps
    assert not any("_cffi" in name or "scripts" in name for name in deps)


def test_manifest_round_trip_and_errors(built: tuple[Path, PackManifest]) -> None:
    _, manifest = built
    assert PackManifest.from_json(manifest.to_json()) == manifest
    raw = json.loads(manifest.to_json())
    for key, value, message in [
        ("format_version", 3, "format version 3"),
        ("format", "other", "not a kernel pack manifest"),
        ("torch_pin", 3, r"manifest: manifest\.torch_pin must be a string"),
        ("libraries", {}, r"libraries must be a list"),
        ("profile", "train", "profile 'train' is unknown"),
    ]:
        broken = dict(raw, **{key: value})
        with pytest.raises(PackError, match=message):
            PackManifest.from_json(json.dumps(broken))
    bad_reason = json.loads(manifest.to_json())
    bad_reason["libraries"][0]["entries"][0]["reason"] = "tired"
    with pytest.raises(PackError, match=r"libraries\[0\]\.entries\[0\]\.reason 'tired' is unknown"):
        PackManifest.from_json(json.dumps(bad_reason))
    del raw["extra_wheels"][0]["sha256"]
    with pytest.raises(PackError, match=r"extra_wheels\[0\]\.sha256 is missing"):
        PackManifest.from_json(json.dumps(raw))
    with pytest.raises(PackError, match="not valid JSON"):
        PackManifest.from_json("{")


def test_version_1_manifests_still_read(built: tuple[Path, PackManifest]) -> None:
    _, manifest = built
    raw = json.loads(manifest.to_json())
    raw["format_version"] = 1
    del raw["profile"]
    for library in raw["libraries"]:
        del library["containers_ptx_only"]
        for tally in library["entries"]:
            del tally["reason"]
    for wheel in raw["extra_wheels"]:
        del wheel["debug_bytes_blanked"]
    old = PackManifest.from_json(json.dumps(raw))
    assert old.profile == "kernels" and old.format_version == 1
    assert all(
        tally.reason == ("other-arch" if tally.zeroed else None)  # all version 1 ever zeroed
        for library in old.libraries
        for tally in library.entries
    )
    with pytest.raises(PackError, match="format version 3 is not supported"):
        PackManifest.from_json(json.dumps(dict(raw, format_version=3)))


def test_unpack_lays_out_site_and_triton_kernels_alias(
    built: tuple[Path, PackManifest], tmp_path: Path
) -> None:
    directory, manifest = built
    unpacked = unpack_pack(directory, tmp_path / "cache")
    assert unpacked.root.parent == tmp_path / "cache" and unpacked.manifest == manifest
    site = unpacked.site
    assert (site / "vllm" / "__init__.py").is_file() and (site / "pydantic" / "__init__.py").is_file()
    alias = unpacked.aliases / "triton_kernels"
    assert alias.is_symlink() and (alias / "matmul_ogs.py").read_text() == "VALUE = 7\n"
    library = (site / "vllm" / "_moe_C_stable_libtorch.abi3.so").read_bytes()
    section = parse_elf(library).section(".nv_fatbin")
    assert section is not None
    entries = walk_fatbin(library, section.offset, section.end)
    zeroed = [entry for entry in entries if not any(library[entry.payload_offset : entry.payload_offset + 8])]
    assert {(entry.kind_name, entry.arch) for entry in zeroed} == {
        ("cubin", 75), ("cubin", 80), ("cubin", 100), ("cubin", 86), ("cubin", 120), ("ptx", 100),
        ("ptx", 80), ("ptx", 90),
    }  # fmt: skip
    kept_ptx = [entry for entry in entries if entry.kind_name == "ptx" and entry not in zeroed]
    assert [
        (entry.arch, library[entry.payload_offset : entry.payload_offset + 10]) for entry in kept_ptx
    ] == [(80, b"marlin ptx")]
    # a second call finds the finished unpack and does nothing
    (site / "marker").write_text("kept")
    assert unpack_pack(directory, tmp_path / "cache").root == unpacked.root
    assert (site / "marker").read_text() == "kept"


def test_damaged_archive_is_refused(built: tuple[Path, PackManifest], tmp_path: Path) -> None:
    directory, _ = built
    copy = tmp_path / "pack"
    copy.mkdir()
    for path in directory.iterdir():
        copy.joinpath(path.name).write_bytes(path.read_bytes())
    data = bytearray((copy / "deps.tar.xz").read_bytes())
    data[100] ^= 0xFF
    (copy / "deps.tar.xz").write_bytes(bytes(data))
    with pytest.raises(PackError, match=r"deps\.tar\.xz does not match its sha256"):
        unpack_pack(copy, tmp_path / "cache")
    (copy / "deps.tar.xz").unlink()
    with pytest.raises(PackError, match=r"lacks deps\.tar\.xz"):
        unpack_pack(copy, tmp_path / "cache")


def test_torch_pin_mismatch_is_one_clear_line(built: tuple[Path, PackManifest]) -> None:
    _, manifest = built
    check_torch(manifest, "2.11.0+cu130", "13.0")
    with pytest.raises(PackError) as caught:
        check_torch(manifest, "2.13.0+cu130", "13.0")
    message = str(caught.value)
    assert "\n" not in message
    assert message == "kernel pack for vLLM 0.25.1 needs torch 2.11.0, but torch 2.13.0+cu130 is running"
    with pytest.raises(
        PackError, match=re.escape("needs CUDA 13, but torch 2.11.0+cu128 is built for CUDA 12.8")
    ):
        check_torch(manifest, "2.11.0+cu128", "12.8")
    with pytest.raises(
        PackError, match=re.escape("needs a CUDA 13 build of torch, but torch 2.11.0+cpu has no CUDA")
    ):
        check_torch(manifest, "2.11.0+cpu", None)


def test_load_pack_refuses_the_running_torch_before_unpacking(
    built: tuple[Path, PackManifest], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    directory, manifest = built
    monkeypatch.setattr(sys, "version_info", (3, 12, 0, "final", 0))
    assert torch.__version__.split("+")[0] != manifest.torch_pin  # this machine runs another torch
    with pytest.raises(
        PackError, match=re.escape(f"needs torch 2.11.0, but torch {torch.__version__} is running")
    ):
        load_pack(directory, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_python_check_follows_wheel_tags(built: tuple[Path, PackManifest]) -> None:
    _, manifest = built
    check_python(manifest, (3, 12))
    with pytest.raises(PackError, match=re.escape("built for CPython 3.12, but Python 3.11 is running")):
        check_python(manifest, (3, 11))
    abi3_only = dataclasses.replace(
        manifest,
        extra_wheels=tuple(wheel for wheel in manifest.extra_wheels if wheel.abi in ("none", "abi3")),
    )
    check_python(abi3_only, (3, 13))


def test_activate_puts_the_pack_first_and_imports_from_it(
    built: tuple[Path, PackManifest], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, _ = built
    unpacked = unpack_pack(directory, tmp_path / "cache")
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in [name for name in sys.modules if name.split(".")[0] in ("triton_kernels", "vllm")]:
        monkeypatch.delitem(sys.modules, name)
    activate(unpacked)
    assert sys.path[:2] == [str(unpacked.site), str(unpacked.aliases)]
    pack = LoadedPack(directory=directory, unpacked=unpacked)
    try:
        assert pack.import_module("triton_kernels").__name__ == "triton_kernels"
        assert pack.import_module("triton_kernels.matmul_ogs").VALUE == 7
        assert pack.import_module("vllm").__version__ == "0.25.1"
        with pytest.raises(PackError, match=re.escape("cannot import vllm.nothing_here")):
            pack.import_module("vllm.nothing_here")
    finally:
        for name in [name for name in sys.modules if name.split(".")[0] in ("triton_kernels", "vllm")]:
            del sys.modules[name]


def test_build_refuses_wrong_wheel_and_foreign_output(tmp_path: Path) -> None:
    wheel = fake_vllm_wheel(tmp_path)
    with pytest.raises(PackError, match=re.escape("is not vllm 0.26.0")):
        build_pack(BuildOptions(vllm_version="0.26.0", output=tmp_path / "out", wheel=wheel))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(PackError, match="not empty and holds no pack"):
        build_pack(BuildOptions(vllm_version="0.25.1", output=foreign, wheel=wheel))


def test_build_refuses_two_versions_of_one_extra_wheel(tmp_path: Path) -> None:
    from packfakes import write_wheel

    wheel = fake_vllm_wheel(tmp_path)
    extras = fake_extra_wheels(tmp_path / "extras")
    write_wheel(extras / "pydantic-2.13.0-py3-none-any.whl", {"pydantic/__init__.py": b""})
    with pytest.raises(PackError, match="two wheels of pydantic"):
        build_pack(
            BuildOptions(
                vllm_version="0.25.1", output=tmp_path / "o", wheel=wheel, extra_wheels=extras, xz_preset=0
            )
        )


def test_default_cache_dir_reads_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from moereplay.pack import default_cache_dir

    monkeypatch.setenv("MOEREPLAY_PACK_CACHE", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x"
    monkeypatch.delenv("MOEREPLAY_PACK_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "moereplay" / "packs"
    assert os.environ["XDG_CACHE_HOME"] == str(tmp_path)
