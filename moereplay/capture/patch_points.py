"""Where vLLM calls the MoE kernels: the names the capture plugin wraps, as the kernel families declare them.

Each target names a module attribute *where it is looked up at call time* — wrapping the defining function
elsewhere would miss call sites that bound it by ``from x import f``. The facts, per vLLM release, live with each
family's declaration in ``moereplay/ops/<family>_surface.py`` (:mod:`moereplay.ops.surface`); this module only
collects them for the plugin.
"""

from __future__ import annotations

from moereplay.ops.surface import CaptureTarget, Role, family_targets, vllm_series

__all__ = ["TARGETS", "CaptureTarget", "Role", "vllm_series_known"]

VLLM_CODECS = ("moereplay.ops.vllm_codecs",)
"""vLLM's own value types (``ScalarType``)."""

TARGETS: tuple[CaptureTarget, ...] = family_targets()
"""Every patch point the plugin knows; a module that does not exist in the running vLLM is simply absent."""

KNOWN_VLLM_SERIES: tuple[tuple[int, int], ...] = tuple(sorted(vllm_series()))
"""vLLM release series whose patch points were read from the sources; others get one warning naming the
patch points that matched."""


def vllm_series_known(version: str) -> bool:
    parts = version.split("+", 1)[0].split(".")
    try:
        series = (int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or "-1"))
    except (IndexError, ValueError):
        return False
    return series in KNOWN_VLLM_SERIES
