"""Every test under tests/gpu is a GPU test.

GPU tests import vLLM (from a kernel pack) and triton_kernels, whose imports emit deprecation warnings from
torch (``torch.jit.script_method``) and friends. The suite runs with warnings as errors; those third-party
deprecations are not ours to fix, so they are ignored here, and only here.
"""

from __future__ import annotations

import pytest

_THIRD_PARTY_DEPRECATIONS = (
    "ignore::DeprecationWarning",
    "ignore::PendingDeprecationWarning",
    "ignore::FutureWarning",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "/tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            for spec in _THIRD_PARTY_DEPRECATIONS:
                item.add_marker(pytest.mark.filterwarnings(spec))
