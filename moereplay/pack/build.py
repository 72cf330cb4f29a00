"""Building a pack from an official vLLM wheel, for one profile (:mod:`moereplay.pack.profiles`).

A ``kernels`` pack takes from the wheel every ``vllm/**/*.py`` (the vendored ``vllm/third_party/triton_kernels``
included), vLLM's JSON kernel configs and ``py.typed``, the ``vllm-X.dist-info/`` directory (vLLM's Triton check
reads ``importlib.metadata.version("vllm")``; without it Triton is disabled) and the two CUDA libraries, optionally
slimmed to one GPU architecture. A ``serve`` pack takes only the FlashAttention-3 library. Either unpacks its
profile's extra wheels (DWARF sections of their ELF libraries blanked, see :func:`elf.blank_debug_sections`) and
writes ``tree.tar.xz``, ``deps.tar.xz`` and ``manifest.json``. For vLLM 0.25.1 and sm_90: kernels ≈ 39 MB,
serve ≈ 12.5 MB. Cost: 1–3 minutes on one core, dominated by xz.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from moereplay import __version__
from moereplay.errors import PackError
from moereplay.pack.archive import XZ_PRESET, ArchiveMember, write_tar_xz
from moereplay.pack.download import DROPPED_FILES, SERVE_TARGET, Target, pip_download
from moereplay.pack.elf import ELF_MAGIC, blank_debug_sections
from moereplay.pack.fatbin import parse_arch
from moereplay.pack.libraries import slim_library
from moereplay.pack.manifest import (
    DEPS_ARCHIVE,
    MANIFEST_NAME,
    TREE_ARCHIVE,
    ExtraWheel,
    FileDigest,
    LibraryRecord,
    PackManifest,
    ProfileName,
    WheelPurpose,
    read_manifest,
    write_manifest,
)
from moereplay.pack.profiles import PackProfile, pack_profile
from moereplay.pack.wheels import (
    dist_info_dir,
    open_wheel,
    parse_wheel_name,
    read_metadata,
    torch_pin,
    wheel_members,
)

#: Besides ``*.py``, files under ``vllm/`` a pack keeps: kernel tuning configs read at run time, and typing marks.
TREE_SUFFIXES: tuple[str, ...] = (".py", ".json", "py.typed")

Progress = Callable[[str], None]


@dataclass(frozen=True)
class BuildOptions:
    """What to build. ``arch=None`` keeps the libraries whole (≈ 100 MB more for a kernels pack).

    ``extra_wheels``: a directory of wheels to unpack (missing required ones are downloaded into it); keep one per
    profile, since every wheel in it is taken.
    """

    vllm_version: str
    output: Path
    wheel: Path | None = None
    arch: str | None = "sm_90"
    extra_wheels: Path | None = None
    download_dir: Path | None = None
    xz_preset: int = XZ_PRESET
    profile: ProfileName = "kernels"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _digest(path: Path) -> FileDigest:
    return FileDigest(name=path.name, size=path.stat().st_size, sha256=sha256_file(path))


def default_download_dir() -> Path:
    """``$XDG_CACHE_HOME/moereplay/wheels`` (``~/.cache/…`` by default): downloaded wheels are reused."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moereplay" / "wheels"


def find_vllm_wheel(options: BuildOptions, progress: Progress) -> Path:
    """The vLLM wheel to read: ``options.wheel``, or one downloaded with pip (kept in the download dir)."""
    if options.wheel is not None:
        if not options.wheel.is_file():
            raise PackError(f"vLLM wheel {options.wheel} does not exist")
        name = parse_wheel_name(options.wheel.name)
        if name.normalized != "vllm" or name.version != options.vllm_version:
            raise PackError(
                f"wheel {options.wheel.name} is not vllm {options.vllm_version} "
                f"(it is {name.normalized} {name.version})"
            )
        return options.wheel
    directory = options.download_dir or default_download_dir()
    existing = sorted(directory.glob(f"vllm-{options.vllm_version}-*.whl"))
    if existing:
        progress(f"using {existing[0]}")
        return existing[0]
    progress(f"downloading vllm=={options.vllm_version} (≈ 250 MB) into {directory}")
    pip_download((f"vllm=={options.vllm_version}",), directory)
    found = sorted(directory.glob(f"vllm-{options.vllm_version}-*.whl"))
    if not found:
        raise PackError(f"pip downloaded no vllm {options.vllm_version} wheel into {directory}")
    return found[0]


def _tree_member(name: str) -> bool:
    return name.startswith("vllm/") and name.endswith(TREE_SUFFIXES)


@dataclass(frozen=True)
class _Tree:
    members: tuple[ArchiveMember, ...]
    libraries: tuple[LibraryRecord, ...]
    torch_pin: str
    python_files: int


def _read_tree(
    wheel_path: Path, version: str, keep_arch: int | None, profile: PackProfile, progress: Progress
) -> _Tree:
    with open_wheel(wheel_path) as wheel:
        dist_info = dist_info_dir(wheel)
        if dist_info != f"vllm-{version}.dist-info":
            raise PackError(f"{wheel_path.name} holds {dist_info}, expected vllm-{version}.dist-info")
        pin = torch_pin(read_metadata(wheel))
        names = set(wheel.namelist())
        missing = [member for member in profile.libraries if member not in names]
        if missing:
            raise PackError(f"{wheel_path.name} lacks {', '.join(missing)}")
        members: list[ArchiveMember] = []
        python_files = 0
        for info in wheel.infolist():
            if info.is_dir() or not profile.python_tree:
                continue
            if _tree_member(info.filename) or info.filename.startswith(f"{dist_info}/"):
                members.append(ArchiveMember(path=info.filename, data=wheel.read(info)))
                python_files += info.filename.endswith(".py")
        libraries: list[LibraryRecord] = []
        for member in profile.libraries:
            progress(f"slimming {member}" if keep_arch else f"taking {member} whole")
            data, report = slim_library(member, wheel.read(member), keep_arch)
            members.append(ArchiveMember(path=member, data=data, executable=True))
            slim = report.slim
            libraries.append(
                LibraryRecord(
                    member=member,
                    size=report.size,
                    sha256=hashlib.sha256(data).hexdigest(),
                    cuda_major=report.cuda_major,
                    slimmed=slim is not None,
                    containers=slim.containers if slim else 0,
                    containers_without_code=slim.containers_without_code if slim else 0,
                    entries=slim.tallies if slim else (),
                    containers_ptx_only=slim.containers_ptx_only if slim else 0,
                )
            )
    return _Tree(members=tuple(members), libraries=tuple(libraries), torch_pin=pin, python_files=python_files)


def _requirement_name(requirement: str) -> str:
    return requirement.split("==", 1)[0].replace("_", "-").replace(".", "-").lower()


def collect_extra_wheels(
    target: Path, progress: Progress, profile: PackProfile | None = None
) -> list[tuple[Path, WheelPurpose]]:
    """The extra wheels of a pack: those in ``target`` plus any the profile requires that it lacks, downloaded
    into it (default profile: kernels).

    Every wheel in ``target`` is taken (one may add wheels beyond the required ones). Two versions of one
    project are refused: both would be unpacked over each other.
    """
    profile = profile or pack_profile("kernels")
    target.mkdir(parents=True, exist_ok=True)
    purposes = {_requirement_name(requirement): purpose for requirement, purpose in profile.requirements}
    present = {parse_wheel_name(path.name).normalized for path in target.glob("*.whl")}
    wanted = tuple(
        requirement
        for requirement, _ in profile.requirements
        if _requirement_name(requirement) not in present
    )
    if wanted:
        progress(f"downloading {len(wanted)} extra wheels into {target}")
        pip_download(wanted, target, SERVE_TARGET if profile.name == "serve" else Target())
    chosen: dict[str, Path] = {}
    for path in sorted(target.glob("*.whl")):
        project = parse_wheel_name(path.name).normalized
        if project in chosen:
            raise PackError(f"two wheels of {project} in {target}: {chosen[project].name} and {path.name}")
        chosen[project] = path
    lacking = sorted(set(purposes) - set(chosen))
    if lacking:
        raise PackError(f"no wheel found for {', '.join(lacking)} in {target}")
    return [(path, purposes.get(project, "extra")) for project, path in sorted(chosen.items())]


def _without_debug_info(member: ArchiveMember) -> tuple[ArchiveMember, int]:
    """The member with the DWARF sections of an ELF shared library blanked, and the bytes blanked."""
    if ".so" not in PurePosixPath(member.path).suffixes or not member.data.startswith(ELF_MAGIC):
        return member, 0
    data = bytearray(member.data)
    blanked = blank_debug_sections(data)
    if not blanked:
        return member, 0
    return ArchiveMember(path=member.path, data=bytes(data), executable=member.executable), blanked


def _read_deps(wheels: list[tuple[Path, WheelPurpose]]) -> tuple[list[ArchiveMember], list[ExtraWheel]]:
    members: dict[str, ArchiveMember] = {}
    records: list[ExtraWheel] = []
    for path, purpose in wheels:
        name = parse_wheel_name(path.name)
        dropped = DROPPED_FILES.get(name.normalized, ())
        debug_blanked = 0
        with open_wheel(path) as wheel:
            for raw in wheel_members(wheel, drop=dropped):
                member, blanked = _without_debug_info(raw)
                debug_blanked += blanked
                if member.path in members:
                    raise PackError(f"extra wheels {path.name} and another both hold {member.path}")
                members[member.path] = member
        records.append(
            ExtraWheel(
                file=path.name,
                name=name.normalized,
                version=name.version,
                python=name.python,
                abi=name.abi,
                platform=name.platform,
                sha256=sha256_file(path),
                purpose=purpose,
                dropped=dropped,
                debug_bytes_blanked=debug_blanked,
            )
        )
    return list(members.values()), records


def _prepare_output(output: Path, profile: ProfileName) -> None:
    if output.exists():
        if not output.is_dir():
            raise PackError(f"output {output} exists and is not a directory")
        contents = {path.name for path in output.iterdir()}
        if contents and MANIFEST_NAME not in contents:
            raise PackError(
                f"output directory {output} is not empty and holds no pack: refusing to overwrite it"
            )
        if contents:
            existing = read_manifest(output).profile
            if existing != profile:
                raise PackError(
                    f"output directory {output} holds a {existing} pack: refusing to replace it with a "
                    f"{profile} pack (choose another directory)"
                )
        for name in (MANIFEST_NAME, TREE_ARCHIVE, DEPS_ARCHIVE):
            (output / name).unlink(missing_ok=True)
    output.mkdir(parents=True, exist_ok=True)


def build_pack(options: BuildOptions, progress: Progress = lambda message: None) -> PackManifest:
    """Build a pack of ``options.profile`` into ``options.output`` and return its manifest (also written as
    ``manifest.json``)."""
    profile = pack_profile(options.profile)
    keep_arch = parse_arch(options.arch) if options.arch else None
    arch_name = f"sm_{keep_arch}" if keep_arch else None
    wheel_path = find_vllm_wheel(options, progress)
    _prepare_output(options.output, profile.name)
    tree = _read_tree(wheel_path, options.vllm_version, keep_arch, profile, progress)
    progress(f"compressing {len(tree.members)} files into {TREE_ARCHIVE} (xz -{options.xz_preset})")
    tree_files = write_tar_xz(options.output / TREE_ARCHIVE, tree.members, preset=options.xz_preset)
    with tempfile.TemporaryDirectory(prefix="moereplay-wheels-") as scratch:
        wheels = collect_extra_wheels(options.extra_wheels or Path(scratch), progress, profile)
        deps, records = _read_deps(wheels)
    progress(f"compressing {len(deps)} files of {len(records)} wheels into {DEPS_ARCHIVE}")
    write_tar_xz(options.output / DEPS_ARCHIVE, deps, preset=options.xz_preset)
    majors = {library.cuda_major for library in tree.libraries if library.cuda_major is not None}
    if len(majors) > 1:
        raise PackError(f"vLLM's libraries link different CUDA runtimes: {sorted(majors)}")
    manifest = PackManifest(
        vllm_version=options.vllm_version,
        vllm_wheel=_digest(wheel_path),
        torch_pin=tree.torch_pin,
        cuda_major=majors.pop() if majors else None,
        arch=arch_name,
        libraries=tree.libraries,
        python_files=tree.python_files,
        tree_files=tree_files,
        extra_wheels=tuple(records),
        files=tuple(_digest(options.output / name) for name in (TREE_ARCHIVE, DEPS_ARCHIVE)),
        created_by=f"moereplay {__version__}",
        profile=profile.name,
    )
    write_manifest(options.output, manifest)
    return manifest
