"""Bind a wrapped call's ``(*args, **kwargs)`` to the running function's own parameter names, cheaply.

``inspect.Signature.bind`` costs ~10 µs for a 29-argument kernel wrapper; this precomputes the names and
defaults once so a bind is a ``zip`` and a ``dict.update`` (~1-2 µs). The names recorded are those of the
function actually running, so captures from vLLM releases whose signatures differ say so themselves.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ArgumentBinder:
    """Parameter layout of one function.

    ``positional``: names that can be passed by position, in order. ``defaults``: name → default for every
    parameter that has one. ``var_positional`` / ``var_keyword``: the ``*args`` / ``**kwargs`` names, if any.
    ``exact``: ``False`` when the signature could not be read (then positional arguments are ``arg0``, ``arg1`` …).
    """

    positional: tuple[str, ...]
    defaults: tuple[tuple[str, Any], ...]
    var_positional: str | None = None
    var_keyword: str | None = None
    exact: bool = True

    @classmethod
    def of(cls, function: Callable[..., Any]) -> ArgumentBinder:
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):
            return cls((), (), var_positional=None, var_keyword=None, exact=False)
        positional: list[str] = []
        defaults: list[tuple[str, Any]] = []
        var_positional = var_keyword = None
        for parameter in signature.parameters.values():
            if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
                positional.append(parameter.name)
            elif parameter.kind is parameter.VAR_POSITIONAL:
                var_positional = parameter.name
            elif parameter.kind is parameter.VAR_KEYWORD:
                var_keyword = parameter.name
            if parameter.default is not parameter.empty:
                defaults.append((parameter.name, parameter.default))
        return cls(tuple(positional), tuple(defaults), var_positional, var_keyword)

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Name → value for this call, defaults filled in. Extra positionals go under the ``*args`` name (or
        ``arg{i}``); unknown keywords are kept under their own names (the call will fail in the callee anyway)."""
        names = self.positional
        if not self.exact:
            bound = {f"arg{i}": value for i, value in enumerate(args)}
            bound.update(kwargs)
            return bound
        bound = dict(zip(names, args, strict=False))
        if len(args) > len(names):
            extra = args[len(names) :]
            if self.var_positional is not None:
                bound[self.var_positional] = extra
            else:
                for i, value in enumerate(extra, start=len(names)):
                    bound[f"arg{i}"] = value
        if kwargs:
            bound.update(kwargs)
        for name, default in self.defaults:
            if name not in bound:
                bound[name] = default
        return bound

    @property
    def names(self) -> tuple[str, ...]:
        """Every named parameter, positional first (what a capture of this function records)."""
        extra = tuple(name for name, _ in self.defaults if name not in self.positional)
        return self.positional + extra
