"""Registers the Triton fused MoE family's codec (a ``triton.language`` dtype, ``compute_type``) on import.

Capture imports this module when it arms the family's targets (``codec_modules``); the op module imports it so
replay decodes the dtype too. Kept apart from the torch-free surface, which the kernel-pack loader imports before
the format package's dependencies exist.
"""

from __future__ import annotations

from moereplay.ops.fused_moe_triton_surface import register_codecs

register_codecs()
