"""Format codecs for vLLM's own value types that reach the MoE kernels (registered on import; no vLLM import).

``vllm.scalar_type.ScalarType`` (``b_q_type`` of ``moe_wna16_marlin_gemm``): recorded as ``{"id": int, "name":
str}`` — the 64-bit id vLLM itself passes to the compiled op, plus the name for people reading a capture.
Decoded to the integer id: replay hands ids to the kernel (``MarlinMoeOp.run`` turns one into the backend's
``ScalarType.from_id``), and :func:`moereplay.reference.scalar_types.as_scalar_type` reads one for the reference.
"""

from __future__ import annotations

from typing import Any

from moereplay.errors import UnsupportedValueError
from moereplay.format.codecs import register_codec

SCALAR_TYPE = "vllm.scalar_type.ScalarType"
_MAX_ID = 1 << 64


def encode_scalar_type(value: Any) -> dict[str, Any]:
    """``{"id": value.id, "name": str(value)}``; refuses an object without an integer id."""
    type_id = getattr(value, "id", None)
    if not isinstance(type_id, int) or isinstance(type_id, bool) or not 0 <= type_id < _MAX_ID:
        raise UnsupportedValueError(f"a ScalarType without an integer id: {type(value).__name__}")
    return {"id": int(type_id), "name": str(value)}


def decode_scalar_type(tree: Any) -> int:
    """The recorded id (also accepts a bare int, as older captures and hand-written calls hold)."""
    type_id = tree.get("id") if isinstance(tree, dict) else tree
    if not isinstance(type_id, int) or isinstance(type_id, bool) or not 0 <= type_id < _MAX_ID:
        raise UnsupportedValueError(f"recorded ScalarType has no valid id: {tree!r:.80}")
    return type_id


def register() -> None:
    """(Re)register the codecs of this module with the format's registry. Idempotent."""
    register_codec(SCALAR_TYPE, encode_scalar_type, decode_scalar_type)


register()
