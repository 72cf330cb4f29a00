"""Synthesize captures without a model: presets for the MoE kernel calls vLLM makes, with seeded inputs built the
way vLLM's preparation code builds them, outputs from a real kernel (a replay backend) or the fp32 reference, and
big tensors stored as generator recipes that expand bit-identically on any machine.

Public API::

    from moereplay.synth import synthesize, presets
    result = synthesize("marlin-nvfp4-report", "report.moe.zst", overrides=["tokens=8"], store="recipe",
                        backend="pack:/opt/kernelpack")

Modules: ``recipe`` (the recipe codec, expansion, digest check), ``generators`` (the built-in seeded generators),
``routing`` (softmax top-k and each kernel family's routing arrays), ``presets`` (settings and the registry),
``marlin_presets`` / ``ogs_presets`` (the presets), ``runners`` (kernel or reference), ``drawing`` (recipe-tracked
tensors and call records), ``build`` (``synthesize``).

Importing this package registers the recipe codec with the format's registry, so captures holding recipes load as
ordinary tensors in this process.
"""

from __future__ import annotations

from moereplay.synth.recipe import register as _register_recipe_codec

_register_recipe_codec()

from moereplay.synth.build import STORE_MODES, SynthResult, synthesize  # noqa: E402
from moereplay.synth.presets import Preset, Setting, get_preset, presets  # noqa: E402
from moereplay.synth.recipe import TensorRecipe, expand  # noqa: E402

__all__ = [
    "STORE_MODES",
    "Preset",
    "Setting",
    "SynthResult",
    "TensorRecipe",
    "expand",
    "get_preset",
    "presets",
    "synthesize",
]
