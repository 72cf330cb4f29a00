"""Shared pytest configuration: GPU tests skip cleanly where CUDA is absent; stand-in kernel modules."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import settings

# no per-example deadline: an example that takes 1 ms fails Hypothesis' 200 ms default only when the machine stalls
# the test (a garbage collection, a loaded CI host) — a flake, not a finding
settings.register_profile("moereplay", deadline=None)
settings.load_profile("moereplay")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.fixture(autouse=True, scope="session")
def recipe_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Expanded recipes go to a directory of this test session, never the user's ~/.cache (subprocesses inherit it)."""
    import os

    previous = os.environ.get("MOEREPLAY_CACHE_DIR")
    os.environ["MOEREPLAY_CACHE_DIR"] = str(tmp_path_factory.mktemp("recipe-store"))
    yield
    if previous is None:
        os.environ.pop("MOEREPLAY_CACHE_DIR", None)
    else:
        os.environ["MOEREPLAY_CACHE_DIR"] = previous


@pytest.fixture(autouse=True, scope="session")
def state_directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Bisect logs and other state go to a directory of this test session, never ./moereplay-captures."""
    import os

    previous = os.environ.get("MOEREPLAY_STATE_DIR")
    os.environ["MOEREPLAY_STATE_DIR"] = str(tmp_path_factory.mktemp("state"))
    yield
    if previous is None:
        os.environ.pop("MOEREPLAY_STATE_DIR", None)
    else:
        os.environ["MOEREPLAY_STATE_DIR"] = previous


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def stand_in_module() -> Iterator[Callable[..., types.ModuleType]]:
    """``stand_in_module(name, **functions)``: a module of stand-in functions registered in ``sys.modules`` (patch
    points look their targets up there by module name), removed at teardown — after the fixtures that asked for
    it have finished theirs, and after any capture still armed is disarmed (it wraps these modules' functions)."""
    names: list[str] = []

    def install(name: str, **functions: Any) -> types.ModuleType:
        module = types.ModuleType(name)
        for attribute, function in functions.items():
            setattr(module, attribute, function)
        sys.modules[name] = module
        names.append(name)
        return module

    yield install
    if names:
        from moereplay.capture import session

        session.disarm()
    for name in names:
        sys.modules.pop(name, None)
