"""Synthesize captures without a model: presets for the MoE kernel calls vLLM makes, with seeded inputs built the
way vLLM's preparation code builds them, outputs from a real kernel (a replay backend) or the fp32 reference, and
big tensors stored as generator recipes that expand bit-identically on any machine.

Public API::

    from moereplay.synth import all_presets, synthesize
    result = synthesize("marlin-nvfp4-report", "report.moe.zst", overrides=["tokens=8"], store="recipe",
                        backend="pack:/opt/kernelpack")

Modules: ``recipe`` (the recipe codec, expansion, digest check), ``generators`` (the built-in seeded generators),
``routing`` (softmax top-k and each kernel family's routing arrays), ``presets`` (settings and the registry),
``marlin_presets`` / ``ogs_presets`` (the presets), ``runners`` (kernel or reference), ``drawing`` (recipe-tracked
tensors and call records), ``build`` (``synthesize``).

Importing this package registers the recipe codec with the format's registry, so captures holding recipes load as
ordinary tensors in this process; everything else is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from moereplay.synth.recipe import TensorRecipe, expand  # noqa: F401 - re-exported
from moereplay.synth.recipe import register as _register_recipe_codec

_register_recipe_codec()

_EXPORTS = {
    "STORE_MODES": ".build",
    "SynthResult": ".build",
    "synthesize": ".build",
    "Preset": ".presets",
    "Setting": ".presets",
    "get_preset": ".presets",
    "all_presets": ".presets",
}

__all__ = sorted([*_EXPORTS, "TensorRecipe", "expand"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'moereplay.synth' has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
