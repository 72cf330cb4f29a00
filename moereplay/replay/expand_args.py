"""The arguments of a recorded layer call as the live vLLM function takes them (:mod:`moereplay.replay.expand`).

:func:`plan_arguments` checks a record against the function's signature before anything is loaded: scratch
buffers not kept (passed as ``None``), unsupported values the function has a default for (left out, with a note),
and the rest refused on one line. :class:`Rebuilder` turns loaded values the function cannot take into the
library's objects: enum members (``EnumValue``) and dataclasses recorded field by field (``CodecValue``) from
classes of allowed packages only, a family's plain values through its ``value_modules`` and the backend.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from moereplay.capture.flight_layer import is_scratch_marker
from moereplay.capture.patch_points import CaptureTarget
from moereplay.errors import PackError, ReplayError
from moereplay.format.schema import CodecValue, EnumValue, Unsupported
from moereplay.ops.base import KernelBackend
from moereplay.ops.surface import LibraryValueError, library_packages, value_modules

LIBRARY_PACKAGES = ("vllm", *library_packages())
"""Top-level packages whose classes (enums, dataclasses) may be imported to rebuild a recorded argument, besides
the parent function's own package: vLLM's and the families' libraries."""


def unsupported_text(value: Unsupported) -> str:
    """Why a value was not recorded (the recorder's text)."""
    return value.repr_excerpt


def resolve_function(backend: KernelBackend, site: str) -> tuple[types.ModuleType, str]:
    module_name, _, attribute = site.partition(":")
    try:
        module = backend.module(module_name)
    except (ImportError, PackError) as error:
        raise ReplayError(f"backend {backend.name} cannot import {module_name}: {error}") from error
    owner: Any = module
    for name in attribute.split("."):
        owner = getattr(owner, name, None)
        if owner is None:
            raise ReplayError(f"backend {backend.name}: {module_name} has no {attribute}")
    if not callable(owner):
        raise ReplayError(f"backend {backend.name}: {site} is not callable")
    return module, attribute


def attribute_of(module: types.ModuleType, attribute: str) -> Any:
    owner: Any = module
    for name in attribute.split("."):
        owner = getattr(owner, name)
    return owner


class Rebuilder:
    """Turns loaded argument values the live function cannot take (EnumValue, CodecValue of a dataclass,
    a family's plain values) into the library's objects; imports classes only from allowed packages."""

    def __init__(self, backend: KernelBackend, packages: frozenset[str], where: str) -> None:
        self.backend = backend
        self.packages = packages
        self.where = where
        self._library: dict[str, Any] = {}
        self._value_modules = value_modules()

    def resolve_class(self, type_name: str, path: str) -> Any:
        parts = type_name.split(".")
        if parts[0] not in self.packages:
            raise ReplayError(
                f"{self.where}: argument {path} is a {type_name}, outside {', '.join(sorted(self.packages))}; "
                "expand does not import it"
            )
        for split in range(len(parts) - 1, 0, -1):
            module_name = ".".join(parts[:split])
            module = sys.modules.get(module_name)
            if module is None:
                try:
                    module = self.backend.module(module_name)
                except (ImportError, PackError):
                    continue
            try:
                return attribute_of(module, ".".join(parts[split:]))
            except AttributeError:
                continue
        raise ReplayError(
            f"{self.where}: argument {path}: cannot find {type_name} in backend {self.backend.name}"
        )

    def rebuild(self, value: Any, path: str) -> Any:
        if (
            isinstance(value, torch.Tensor)
            or value is None
            or isinstance(value, (bool, int, float, str, bytes))
        ):
            return value
        if isinstance(value, Unsupported):
            raise ReplayError(
                f"{self.where}: argument {path} was not recorded ({value.type_name}: {unsupported_text(value)})"
            )
        if isinstance(value, EnumValue):
            return self._enum(value, path)
        if isinstance(value, CodecValue):
            return self._dataclass(value, path)
        if isinstance(value, dict):
            return {key: self.rebuild(item, f"{path}.{key}") for key, item in value.items()}
        if isinstance(value, list):
            return [self.rebuild(item, f"{path}[{i}]") for i, item in enumerate(value)]
        if type(value) is tuple:
            return tuple(self.rebuild(item, f"{path}[{i}]") for i, item in enumerate(value))
        if type(value).__module__ in self._value_modules:
            return self._library_value(value, path)
        return value

    def _enum(self, value: EnumValue, path: str) -> Any:
        kind = self.resolve_class(value.type_name, path)
        if not (isinstance(kind, type) and issubclass(kind, enum.Enum)):
            raise ReplayError(f"{self.where}: argument {path}: {value.type_name} is not an enum here")
        member = kind.__members__.get(value.name)
        if member is None:
            try:
                member = kind(value.value)
            except ValueError as error:
                raise ReplayError(
                    f"{self.where}: argument {path}: {value.type_name} has no member {value.name} here"
                ) from error
        return member

    def _dataclass(self, value: CodecValue, path: str) -> Any:
        kind = self.resolve_class(value.type_name, path)
        if not (isinstance(kind, type) and dataclasses.is_dataclass(kind)) or not isinstance(
            value.value, dict
        ):
            raise ReplayError(
                f"{self.where}: argument {path} was recorded through a codec for {value.type_name}, which this "
                "process has not registered"
            )
        names = {field.name for field in dataclasses.fields(kind)}
        extra = sorted(set(map(str, value.value)) - names)
        if extra:
            raise ReplayError(
                f"{self.where}: argument {path}: {value.type_name} here has no field {extra[0]} (another version?)"
            )
        instance = kind.__new__(kind)
        for name, item in value.value.items():
            object.__setattr__(instance, name, self.rebuild(item, f"{path}.{name}"))
        return instance

    def _library_value(self, value: Any, path: str) -> Any:
        module: Any = importlib.import_module(type(value).__module__)
        try:
            return module.to_library(value, self.backend, self._library)
        except LibraryValueError as error:
            raise ReplayError(f"{self.where}: argument {path}: {error}") from error.error


def plan_arguments(
    record: Any, function: Callable[..., Any], target: CaptureTarget, where: str
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """Check a record's arguments against the live function's signature (no tensor is loaded).

    Returns ``(scratch, omitted, notes)``: arguments passed as ``None``, arguments left to the function's default
    (recorded unsupported), and one note per omitted one. Raises :class:`ReplayError` naming the first argument
    that cannot be passed.
    """
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError) as error:
        raise ReplayError(f"{where}: cannot read the signature of {record.site}: {error}") from error
    parameters = signature.parameters
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    declared_scratch = set(getattr(target, "scratch", ()))
    scratch: list[str] = []
    omitted: list[str] = []
    notes: list[str] = []
    for name, value in record.args.items():
        parameter = parameters.get(name)
        if name.startswith("self."):
            raise ReplayError(
                f"{where}: argument {name} is an attribute of self; expand calls functions only"
            )
        if parameter is None and not accepts_any:
            raise ReplayError(
                f"{where}: argument {name} was recorded, but {record.site} here has no such parameter "
                "(another vLLM version?)"
            )
        if parameter is not None and parameter.kind is parameter.POSITIONAL_ONLY:
            raise ReplayError(f"{where}: parameter {name} of {record.site} is positional-only")
        if not isinstance(value, Unsupported):
            continue
        if is_scratch_marker(value) or (name in declared_scratch and value.type_name == "torch.Tensor"):
            scratch.append(name)
        elif parameter is not None and parameter.default is not parameter.empty:
            omitted.append(name)
            default = parameter.default
            shown = getattr(default, "__qualname__", None) or repr(default)
            notes.append(
                f"{where}: {name} was recorded by name only ({unsupported_text(value)}); the re-run uses "
                f"{record.site}'s default ({shown})"
            )
        else:
            raise ReplayError(
                f"{where}: argument {name} was not recorded ({value.type_name}: {unsupported_text(value)}) and "
                f"{record.site} has no default for it"
            )
    for name, parameter in parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.default is parameter.empty and name not in record.args:
            raise ReplayError(
                f"{where}: {record.site} needs argument {name}, which the capture did not record"
            )
    return tuple(scratch), tuple(omitted), tuple(notes)
