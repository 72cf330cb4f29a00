"""Where a replay's kernel comes from: the installed vLLM, a kernel pack, or no kernel at all (the reference).

A backend is named by a short spec — ``reference``, ``vllm``, ``pack:DIR``, ``python:MODULE_OR_FILE[#NAME]`` or
``auto`` (``$MOEREPLAY_PACK``, else the installed vLLM, else the reference; the reference without CUDA) — because
specs travel to worker processes as text (``auto`` is resolved before they travel). ``python:`` loads a module (or a ``.py`` file) whose
``backend(device, name)`` returns a KernelBackend: kernels outside vLLM, and test kernels; importing it may register
ops. :func:`load_backend` turns a kernel spec into a :class:`~moereplay.ops.base.KernelBackend`
in the process that will run kernels (loading a pack changes ``sys.path`` and loads CUDA libraries there).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from moereplay.errors import SettingsError
from moereplay.ops.base import KernelBackend

BackendKind = Literal["reference", "vllm", "pack", "python"]


@dataclass(frozen=True)
class BackendSpec:
    """A parsed ``--backend`` value."""

    kind: BackendKind
    location: str | None = None  # the pack directory, or the python module / file

    def __post_init__(self) -> None:
        if (self.kind in ("pack", "python")) != (self.location is not None):
            raise SettingsError(f"backend {self.kind} and its location do not fit together")

    @property
    def text(self) -> str:
        return f"{self.kind}:{self.location}" if self.location is not None else self.kind

    @property
    def needs_cuda(self) -> bool:
        return self.kind in ("vllm", "pack")

    @property
    def runs_kernels(self) -> bool:
        return self.kind != "reference"


PACK_VARIABLE = "MOEREPLAY_PACK"
"""The environment variable naming the kernel pack ``--backend auto`` uses first."""


def auto_backend(
    environ: Mapping[str, str] | None = None, *, cuda: bool | None = None, vllm: bool | None = None
) -> BackendSpec:
    """What ``--backend auto`` means here and now: without CUDA the reference (the offline verdict); with CUDA the
    kernel pack ``$MOEREPLAY_PACK`` when set, else the installed vLLM when importable, else the reference.

    ``environ`` defaults to ``os.environ``, read at call time; ``cuda`` / ``vllm`` override the probes (tests).
    """
    environment = os.environ if environ is None else environ
    has_cuda = torch.cuda.is_available() if cuda is None else cuda
    if not has_cuda:
        return BackendSpec("reference")
    pack = environment.get(PACK_VARIABLE, "").strip()
    if pack:
        return BackendSpec("pack", pack)
    has_vllm = importlib.util.find_spec("vllm") is not None if vllm is None else vllm
    return BackendSpec("vllm") if has_vllm else BackendSpec("reference")


def parse_backend(text: str, environ: Mapping[str, str] | None = None) -> BackendSpec:
    """``reference`` | ``vllm`` | ``pack:DIR`` | ``python:MODULE_OR_FILE[#NAME]`` | ``auto`` (see
    :func:`auto_backend`). Raises :class:`SettingsError` with one line otherwise."""
    value = text.strip()
    if value == "auto":
        return auto_backend(environ)
    if value in ("reference", "vllm"):
        return BackendSpec(value)  # type: ignore[arg-type]
    for kind in ("pack", "python"):
        prefix = kind + ":"
        if value.startswith(prefix) and value[len(prefix) :].strip():
            return BackendSpec("pack" if kind == "pack" else "python", value[len(prefix) :].strip())
    raise SettingsError(f"--backend {text!r}: expected reference, vllm, pack:DIR, python:MODULE or auto")


@dataclass(frozen=True)
class ModuleBackend:
    """A :class:`~moereplay.ops.base.KernelBackend` that imports library modules through ``importer``."""

    name: str
    device: torch.device
    importer: Callable[[str], types.ModuleType]

    def module(self, name: str) -> types.ModuleType:
        return self.importer(name)

    @classmethod
    def of_modules(
        cls, name: str, device: torch.device | str, modules: Mapping[str, types.ModuleType]
    ) -> ModuleBackend:
        """A backend serving exactly ``modules`` by name (``python:`` backends of stand-in kernels); any other
        name raises ``ImportError``, as a missing library module would."""
        table = dict(modules)

        def importer(module_name: str) -> types.ModuleType:
            try:
                return table[module_name]
            except KeyError:
                raise ImportError(module_name) from None

        return cls(name, torch.device(device), importer)


def load_backend(spec: BackendSpec, device: torch.device | str) -> KernelBackend:
    """Make ``spec`` usable in this process. The reference spec has no kernel: asking for one is a bug."""
    device = torch.device(device)
    if spec.kind == "vllm":
        return ModuleBackend("vllm", device, importlib.import_module)
    if spec.kind == "pack":
        from moereplay.pack import load_pack

        assert spec.location is not None
        pack = load_pack(spec.location)
        return ModuleBackend(spec.text, device, pack.import_module)
    if spec.kind == "python":
        assert spec.location is not None
        location, _, name = spec.location.partition("#")
        module = _import_location(location)
        factory = getattr(module, "backend", None)
        if not callable(factory):
            raise SettingsError(
                f"--backend python:{location}: the module has no backend(device, name) function "
                "(it returns the kernel backend)"
            )
        try:
            backend: KernelBackend = factory(device, name)
        except Exception as error:  # the user's code: one line naming the file, never a traceback
            raise SettingsError(
                f"--backend python:{location}: backend({str(device)!r}, {name!r}) raised "
                f"{type(error).__name__}: {error}"
            ) from error
        return backend
    raise SettingsError("the reference backend runs no kernel")


def _import_location(location: str) -> types.ModuleType:
    """Import a module by dotted name, or a ``.py`` file by path (registered under a name derived from it).

    Every failure — a missing file, a module that is not there, one that raises while it loads — is one
    :class:`SettingsError` naming the location, never a traceback."""
    if location.endswith(".py"):
        path = Path(location).expanduser().resolve()
        if not path.is_file():
            raise SettingsError(f"--backend python:{location}: no such file")
        name = "moereplay_backend_" + path.stem
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise SettingsError(f"--backend python:{location}: cannot import this file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as error:
            del sys.modules[name]
            raise SettingsError(
                f"--backend python:{location}: the file raised while loading: {type(error).__name__}: {error}"
            ) from error
        return module
    try:
        return importlib.import_module(location)
    except Exception as error:
        raise SettingsError(
            f"--backend python:{location}: cannot import this module: {type(error).__name__}: {error}"
        ) from error
