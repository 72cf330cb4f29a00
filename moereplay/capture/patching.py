"""Install the wrappers on the patch points, now or when their module is imported.

A target module already in ``sys.modules`` is patched at once. Otherwise a post-import hook (a meta-path finder
that only wraps the loader of the watched module names) patches it right after its body runs — before any other
module can ``from … import`` the name — so arming early (vLLM loads general plugins before it builds the model)
and arming late both work, and nothing is imported just to be patched.

Every wrapper keeps the original as ``__moereplay_original__`` and :meth:`Patcher.uninstall` restores them.
Right after wrapping a target the patcher calls the handler's :meth:`CallHandler.prepare` once (the recorder
registers the codecs the target's values need and hooks triton_kernels' opt_flags there); what it returns is
undone at uninstall too.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from moereplay.capture.binding import ArgumentBinder
from moereplay.capture.patch_points import CaptureTarget
from moereplay.ops.surface import ORIGINAL

logger = logging.getLogger("moereplay.capture")


Undo = Callable[[], None]


class CallHandler:
    """What a wrapper delegates to (the recorder). ``active`` is read on every call: keep it a plain attribute."""

    active: bool

    def prepare(self, target: CaptureTarget, original: Callable[..., Any]) -> Undo | None:
        """Called once when ``target`` is wrapped (``original``: the function now wrapped); may return an
        action that undoes what it set up. Errors are logged; the wrapper stays."""
        return None

    def call(
        self,
        target: CaptureTarget,
        binder: ArgumentBinder,
        original: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        raise NotImplementedError


def make_wrapper(
    original: Callable[..., Any], target: CaptureTarget, handler: CallHandler
) -> Callable[..., Any]:
    """A function that behaves as ``original`` and, while ``handler.active``, routes through ``handler.call``."""
    binder = ArgumentBinder.of(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not handler.active:
            return original(*args, **kwargs)
        return handler.call(target, binder, original, args, kwargs)

    setattr(wrapper, ORIGINAL, original)
    wrapper.__moereplay_target__ = target  # type: ignore[attr-defined]
    return wrapper


def _resolve_owner(module: types.ModuleType, attribute: str) -> tuple[Any, str] | None:
    """``(object holding the attribute, last name)`` for a possibly dotted attribute, or None if absent."""
    owner: Any = module
    *path, last = attribute.split(".")
    for name in path:
        owner = getattr(owner, name, None)
        if owner is None:
            return None
    if not hasattr(owner, last) and last not in getattr(owner, "__dict__", {}):
        return None
    return owner, last


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for watched names it asks the other finders and wraps the loader they return."""

    def __init__(self, patcher: Patcher) -> None:
        self.patcher = patcher
        self._busy = threading.local()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.patcher.watched or getattr(self._busy, "active", False):
            return None
        self._busy.active = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.active = False
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader, self.patcher)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, patcher: Patcher) -> None:
        self.inner = inner
        self.patcher = patcher

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.inner.exec_module(module)
        self.patcher.patch_module(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename … for tracebacks and inspect
        return getattr(self.inner, name)


class Patcher:
    """Installs wrappers for ``targets`` through ``handler``; records what it patched."""

    def __init__(self, targets: Iterable[CaptureTarget], handler: CallHandler) -> None:
        self.targets = tuple(targets)
        self.handler = handler
        self.patched: list[tuple[CaptureTarget, Any, str, Any]] = []  # target, owner, name, original
        self._undo: list[Undo] = []
        self.watched: set[str] = set()
        self._finder: _PostImportFinder | None = None
        self._lock = threading.RLock()

    def install(self) -> None:
        with self._lock:
            for module_name in sorted({t.module for t in self.targets}):
                module = sys.modules.get(module_name)
                if module is not None:
                    self.patch_module(module)
                else:
                    self.watched.add(module_name)
            if self.watched and self._finder is None:
                self._finder = _PostImportFinder(self)
                sys.meta_path.insert(0, self._finder)

    def patch_module(self, module: types.ModuleType) -> None:
        """Wrap every target attribute of ``module`` (called at install or right after its import)."""
        with self._lock:
            self.watched.discard(module.__name__)
            for target in self.targets:
                if target.module != module.__name__:
                    continue
                resolved = _resolve_owner(module, target.attribute)
                if resolved is None:
                    continue
                owner, name = resolved
                current = getattr(owner, name)
                if getattr(current, ORIGINAL, None) is not None or not callable(current):
                    continue
                setattr(owner, name, make_wrapper(current, target, self.handler))
                self.patched.append((target, owner, name, current))
                logger.debug("moereplay: wrapped %s", target.site)
                self._prepare(target, current)
            if not self.watched and self._finder is not None:
                self._remove_finder()

    def _prepare(self, target: CaptureTarget, original: Callable[..., Any]) -> None:
        try:
            undo = self.handler.prepare(target, original)
        except Exception as error:
            logger.warning(
                "moereplay: preparing %s failed (%s: %s); its calls are recorded without it",
                target.site,
                type(error).__name__,
                error,
            )
            return
        if undo is not None:
            self._undo.append(undo)

    def _remove_finder(self) -> None:
        if self._finder is not None and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        self._finder = None

    def uninstall(self) -> None:
        """Restore every original (tests; a process that disarms)."""
        with self._lock:
            for undo in reversed(self._undo):
                try:
                    undo()
                except Exception:
                    logger.exception("moereplay: undoing a capture hook failed")
            self._undo.clear()
            for _target, owner, name, original in reversed(self.patched):
                setattr(owner, name, original)
            self.patched.clear()
            self.watched.clear()
            self._remove_finder()

    @property
    def sites(self) -> list[str]:
        return [target.site for target, *_ in self.patched]
