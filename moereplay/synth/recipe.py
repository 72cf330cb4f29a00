"""Seeded generator recipes: a tensor recorded as the few numbers that regenerate it, bit for bit, on any machine.

A gpt-oss NVFP4 ``w2`` is 135 MB of random bytes; as a recipe it is a value tree of a few hundred bytes — the
generator's name, its parameters (shapes, format, seed) and which of its outputs this tensor is — plus the sha256
of the bytes it expands to. The capture stores the recipe through the format's codec registry (type name
:data:`RECIPE_TYPE`), so a reader that knows the codec hands back an ordinary tensor: ``CaptureReader.load_args``
materialises the tensors inside a codec value first (the recipe holds one: a zero-element *anchor* tensor recorded
on the original device, which comes back on the device the reader was asked for) and then calls the codec's
``decode``, which expands the recipe on the CPU with a seeded ``torch.Generator`` (the CPU generator's streams are
what make the expansion machine-independent), checks the digest, and moves the result to the anchor's device.

Recorded tree (msgpack-native values only, plus the anchor)::

    {"v": 1, "generator": "marlin_experts", "params": {...}, "part": "b_qweight",
     "dtype": "int32", "shape": [E, K/16, N*2], "stride": [...], "sha256": "…", "anchor": <empty tensor>}

Expansion cost is the generator's (drawing and packing a full gpt-oss weight set takes seconds on a few cores); the
expanded outputs of one generator call are kept in a small in-process cache (:data:`CACHE_BYTES`), so the parts of one
weight set — and repeated loads of one call — expand once; each verified expansion is also kept on disk
(:mod:`moereplay.synth.expansion_store`), so the next process reads it back instead of drawing it again. A digest mismatch (another torch whose CPU generator
draws differently) raises :class:`~moereplay.errors.CaptureFileError` naming the recipe: silently different inputs
would make every later verdict meaningless.

Registering: :func:`register` installs the codec in the format registry (idempotent). Importing
:mod:`moereplay.synth` does it; a process that reads recipe captures must import it (or have the format's registry
import it on demand) before loading arguments.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from moereplay.errors import CaptureFileError, UnsupportedValueError
from moereplay.format.dtypes import ITEMSIZES, LOADABLE
from moereplay.format.tensors import torch_dtype

RECIPE_TYPE = "moereplay.synth.recipe.TensorRecipe"
"""Qualified type name the recipe codec is registered under (the class below)."""
RECIPE_VERSION = 1
CACHE_BYTES = 1 << 30
"""Bytes of expanded generator outputs kept per process (least recently used out first)."""

GeneratorFunction = Callable[[Mapping[str, Any]], dict[str, torch.Tensor]]
"""A generator: parameters (including ``seed``) → its named CPU tensors, deterministically."""

SizeFunction = Callable[[Mapping[str, Any]], int]
"""Parameters → about how many bytes the generator allocates while drawing (checked before it runs)."""

_GENERATORS: dict[str, GeneratorFunction] = {}
_SIZES: dict[str, SizeFunction] = {}
_lock = threading.Lock()
_cache: OrderedDict[str, Drawn] = OrderedDict()
_partial: set[str] = set()  # cached entries some parts were taken out of (see _take)
_cache_bytes = 0


def register_generator(name: str, size: SizeFunction) -> Callable[[GeneratorFunction], GeneratorFunction]:
    """Decorator: make a generator function expandable by name (the name is recorded in captures: never rename).

    ``size``: the bytes it will allocate for given parameters, computed without drawing, so a reader holds a
    recipe to its memory budget before expanding it (a file can ask for any parameters)."""

    def install(function: GeneratorFunction) -> GeneratorFunction:
        _GENERATORS[name] = function
        _SIZES[name] = size
        return function

    return install


def generator_names() -> tuple[str, ...]:
    _ensure_builtin_generators()
    return tuple(sorted(_GENERATORS))


def _ensure_builtin_generators() -> None:
    from moereplay.synth import generators  # noqa: F401 - registers the built-in generators


def _canonical(params: Mapping[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, separators=(",", ":"), allow_nan=False)


_DIGEST_PIECE = 1 << 26
"""Bytes of a non-contiguous tensor made contiguous at a time while hashing it (64 MB, not a copy of the whole)."""


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 (hex) of a tensor's elements in row-major order (strides do not matter), computed on the host.

    A contiguous CPU tensor is hashed where it lies; any other is copied (to the host, contiguous) a piece of whole
    leading-dimension slices at a time, fed to one hash in order: the same digest as one copy of the whole."""
    hasher = hashlib.sha256()
    for piece in _row_major_pieces(tensor.detach()):
        flat = piece.contiguous().cpu().reshape(-1)
        if flat.numel():
            hasher.update(flat.view(torch.uint8).numpy().data)
    return hasher.hexdigest()


def _row_major_pieces(tensor: torch.Tensor) -> list[torch.Tensor]:
    """``tensor`` as consecutive pieces in row-major order, each of at most :data:`_DIGEST_PIECE` bytes or one
    slice along the first dimension that does not split further (contiguous CPU tensors: one piece)."""
    size = tensor.numel() * tensor.element_size()
    if size <= _DIGEST_PIECE or tensor.dim() == 0 or (tensor.is_contiguous() and tensor.device.type == "cpu"):
        return [tensor]
    if tensor.shape[0] == 1:
        return _row_major_pieces(tensor[0])
    rows = max(1, tensor.shape[0] * _DIGEST_PIECE // size)
    pieces: list[torch.Tensor] = []
    for start in range(0, tensor.shape[0], rows):
        piece = tensor[start : start + rows]
        pieces.extend(_row_major_pieces(piece) if piece.shape[0] == 1 else [piece])
    return pieces


@dataclass(frozen=True)
class TensorRecipe:
    """How to regenerate one tensor: ``generator(params)[part]``, expected to have this dtype, shape, stride and
    digest. ``device``: where the tensor lived when recorded (the anchor's device at write time)."""

    generator: str
    params: Mapping[str, Any]
    part: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    sha256: str
    device: str = "cpu"
    _key: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_key", f"{self.generator}:{_canonical(self.params)}")

    @property
    def cache_key(self) -> str:
        """Identifies the generator call (shared by every part of one weight set)."""
        return self._key

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * ITEMSIZES[self.dtype]

    def describe(self) -> str:
        seed = self.params.get("seed")
        part = f"[{self.part}]" if self.part else ""
        return f"{self.generator}{part}(seed={seed}) → {self.dtype}{list(self.shape)}"


def recipe_for(
    tensor: torch.Tensor, generator: str, params: Mapping[str, Any], part: str = ""
) -> TensorRecipe:
    """The recipe of a tensor a generator produced (its digest computed now; raises if params are not plain)."""
    _canonical(params)  # fails early on values a capture cannot hold portably
    return TensorRecipe(
        generator,
        dict(params),
        part,
        str(tensor.dtype).removeprefix("torch."),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor_digest(tensor),
        str(tensor.device),
    )


class Drawn(dict[str, torch.Tensor]):
    """A generator's outputs, with the digests of those it hashed while writing them: part → (sha256 of its elements
    in row-major order, sha256 of its storage bytes). A generator that finishes its experts on a worker thread hashes
    each expert's bytes there, once they are final, while the next expert is drawn; the first expansion of such a
    part checks that digest instead of reading the whole tensor again (parts without one are hashed as usual)."""

    def __init__(
        self, outputs: Mapping[str, torch.Tensor], digests: Mapping[str, tuple[str, str]] | None = None
    ) -> None:
        super().__init__(outputs)
        self.digests: dict[str, tuple[str, str]] = dict(digests or {})


def generate(generator: str, params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Every output of one generator call, on the CPU (cached; callers must not modify the tensors)."""
    key = f"{generator}:{_canonical(params)}"
    with _lock:
        cached = _cache.get(key)
        if cached is not None and key not in _partial:
            _cache.move_to_end(key)
            return cached
    outputs = _draw(generator, params)
    with _lock:
        _keep(key, outputs)
    return outputs


def _draw(generator: str, params: Mapping[str, Any]) -> Drawn:
    _ensure_builtin_generators()
    function = _GENERATORS.get(generator)
    if function is None:
        raise CaptureFileError(
            f"recipe generator {generator!r} is unknown to this moereplay (known: {', '.join(generator_names())})"
        )
    outputs = function(params)
    return outputs if isinstance(outputs, Drawn) else Drawn(outputs)


def _fetch(recipe: TensorRecipe, take: bool) -> tuple[Drawn, bool]:
    """The outputs of the recipe's generator call (from the cache when an entry there still holds the recipe's
    part), and whether the part was taken out of the cache for the caller to own (``take``: wanted, and only a part
    that spans a storage of its own is ever taken). An entry some parts were taken out of serves the others;
    :func:`generate`, which wants them all, draws afresh."""
    key = recipe.cache_key
    with _lock:
        cached = _cache.get(key)
        if cached is not None and recipe.part in cached:
            _cache.move_to_end(key)
            return cached, take and _take(key, cached, recipe.part)
    outputs = _draw(recipe.generator, recipe.params)
    with _lock:
        _keep(key, outputs)
        return outputs, take and recipe.part in outputs and _take(key, outputs, recipe.part)


def _keep(key: str, outputs: Drawn) -> None:
    """Cache a generator call's outputs, least recently used out first (the caller holds the lock)."""
    global _cache_bytes
    _drop(key)
    size = sum(t.untyped_storage().nbytes() for t in outputs.values())
    if size <= CACHE_BYTES:
        _cache[key] = outputs
        _cache_bytes += size
        while _cache_bytes > CACHE_BYTES and len(_cache) > 1:
            _drop(next(iter(_cache)))


def _drop(key: str) -> None:
    """Forget one cached entry (the caller holds the lock)."""
    global _cache_bytes
    evicted = _cache.pop(key, None)
    _partial.discard(key)
    if evicted is not None:
        _cache_bytes -= sum(t.untyped_storage().nbytes() for t in evicted.values())


def _take(key: str, outputs: Drawn, part: str) -> bool:
    """Take ``part`` out of the cached entry ``outputs`` (the caller holds the lock): True when the tensor spans a
    storage of its own, which no other part shares — the caller then owns it and nothing else will hand it out."""
    global _cache_bytes
    from moereplay.synth.expansion_store import spans_its_storage

    tensor = outputs[part]
    storage = tensor.untyped_storage().data_ptr()
    others = {name: value for name, value in outputs.items() if name != part}
    if not spans_its_storage(tensor) or any(
        v.untyped_storage().data_ptr() == storage for v in others.values()
    ):
        return False
    if _cache.get(key) is outputs:
        _cache_bytes -= tensor.untyped_storage().nbytes()
        if others:
            _cache[key] = Drawn(others, outputs.digests)
            _partial.add(key)
        else:
            _cache.pop(key)
            _partial.discard(key)
    return True


def clear_cache() -> None:
    """Forget every cached expansion (tests; freeing memory)."""
    global _cache_bytes
    with _lock:
        _cache.clear()
        _partial.clear()
        _cache_bytes = 0


def expand(recipe: TensorRecipe, device: torch.device | str = "cpu", *, verify: bool = True) -> torch.Tensor:
    """The tensor a recipe stands for, on ``device``: a fresh tensor with the recorded shape and strides.

    Raises :class:`CaptureFileError` when the generator is unknown, its output does not have the recorded dtype,
    shape or stride, or (``verify``) its bytes do not hash to the recorded digest.

    Read back from the expansion store when it holds the recipe. Otherwise drawn (or found in the in-process cache),
    checked and kept in the store; with the store on, a CPU expansion is taken out of the in-process cache and
    handed over as it is (the next expansion of the recipe reads the store) instead of being copied.
    """
    from moereplay.synth import expansion_store

    target = torch.device(device)
    dtype_object = getattr(torch, recipe.dtype, None)
    if verify and isinstance(dtype_object, torch.dtype):
        stored = expansion_store.load(recipe.sha256, dtype_object, recipe.shape, recipe.stride)
        if stored is not None:
            return stored if target.type == "cpu" else stored.to(target)
    take = verify and target.type == "cpu" and expansion_store.store_directory() is not None
    outputs, owned = _fetch(recipe, take)
    tensor = outputs.get(recipe.part)
    what = recipe.describe()
    if tensor is None:
        raise CaptureFileError(
            f"recipe {what}: the generator has no output {recipe.part!r} (outputs: {', '.join(sorted(outputs))})"
        )
    dtype = str(tensor.dtype).removeprefix("torch.")
    if (
        dtype != recipe.dtype
        or tuple(tensor.shape) != recipe.shape
        or tuple(tensor.stride()) != recipe.stride
    ):
        raise CaptureFileError(
            f"recipe {what}: expanded to {dtype}{list(tensor.shape)} stride {list(tensor.stride())}, the capture "
            f"recorded {recipe.dtype}{list(recipe.shape)} stride {list(recipe.stride)}"
        )
    if not verify:
        return _copy(tensor, target)
    known = outputs.digests.pop(recipe.part, None)  # hashed by the generator as it wrote it: used once
    digest = known[0] if known is not None else tensor_digest(tensor)
    if digest != recipe.sha256:
        raise CaptureFileError(
            f"recipe {what}: this machine expands it to different bytes than the machine that recorded it "
            f"(torch {torch.__version__}); the recorded digest is {recipe.sha256[:16]}…"
        )
    # a contiguous tensor's storage bytes are its elements: the store need not hash them again; the file is written
    # while the caller goes on (a change the caller makes first fails the next load's check, never passes it)
    checksum = known[1] if known is not None else digest if tensor.is_contiguous() else None
    expansion_store.save(recipe.sha256, tensor, checksum=checksum, background=True)
    return tensor if owned else _copy(tensor, target)


def _copy(tensor: torch.Tensor, target: torch.device) -> torch.Tensor:
    out = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device=target)
    out.copy_(tensor)
    return out


# ---------------------------------------------------------------------------------------------------------------
# the codec
# ---------------------------------------------------------------------------------------------------------------


def encode_recipe(recipe: TensorRecipe) -> dict[str, Any]:
    """The recorded tree (see the module docstring); the anchor is an empty tensor on the original device."""
    return {
        "v": RECIPE_VERSION,
        "generator": recipe.generator,
        "params": dict(recipe.params),
        "part": recipe.part,
        "dtype": recipe.dtype,
        "shape": list(recipe.shape),
        "stride": list(recipe.stride),
        "sha256": recipe.sha256,
        "anchor": torch.empty(0, dtype=torch.uint8, device=recipe.device),
    }


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or len(value) > 16:
        raise UnsupportedValueError(f"recipe {what} is not a short list of ints")
    if not all(type(item) is int and item >= 0 for item in value):
        raise UnsupportedValueError(f"recipe {what} holds something other than non-negative ints")
    return tuple(value)


def recipe_from_tree(tree: Any) -> TensorRecipe:
    """Check a recorded recipe tree and build the :class:`TensorRecipe` (no expansion)."""
    if not isinstance(tree, Mapping):
        raise UnsupportedValueError("a recorded recipe is not a map")
    version = tree.get("v")
    if version != RECIPE_VERSION:
        raise UnsupportedValueError(f"recipe format version {version!r} is not {RECIPE_VERSION}")
    generator, part, dtype, digest = (tree.get(key) for key in ("generator", "part", "dtype", "sha256"))
    params = tree.get("params")
    if not (isinstance(generator, str) and isinstance(part, str) and isinstance(dtype, str)):
        raise UnsupportedValueError("recipe generator, part or dtype is not text")
    if torch_dtype(dtype) is None or dtype not in LOADABLE:  # a fixed table: no getattr(torch, <file text>)
        raise UnsupportedValueError(f"recipe dtype {dtype[:64]!r} is not a torch dtype moereplay loads")
    if not (isinstance(digest, str) and len(digest) == 64):
        raise UnsupportedValueError("recipe digest is not a sha256 hex string")
    if not isinstance(params, Mapping):
        raise UnsupportedValueError("recipe params are not a map")
    anchor = tree.get("anchor")
    device = str(anchor.device) if isinstance(anchor, torch.Tensor) else "cpu"
    shape, stride = _ints(tree.get("shape"), "shape"), _ints(tree.get("stride"), "stride")
    if len(shape) != len(stride):
        raise UnsupportedValueError("recipe shape and stride differ in length")
    return TensorRecipe(generator, dict(params), part, dtype, shape, stride, digest, device)


def recipe_bytes(tree: Any) -> int:
    """The codec's ``nbytes``: what expanding a recorded recipe keeps — the tensor it stands for (what its
    generator draws on the way is :func:`recipe_scratch`, counted once per generator call)."""
    return recipe_from_tree(tree).nbytes


def recipe_scratch(tree: Any) -> tuple[str, int]:
    """The codec's ``scratch``: ``(the generator call, the bytes it allocates while drawing)``, computed without
    drawing anything — shared by every part of one weight set (one draw yields them all), and nothing when this
    part's expansion is already kept on disk (reading it back draws nothing)."""
    from moereplay.synth import expansion_store

    recipe = recipe_from_tree(tree)
    _ensure_builtin_generators()
    size = _SIZES.get(recipe.generator)
    try:
        key = f"{recipe.generator}:{_canonical(recipe.params)}"
        if size is None:
            return key, 0  # unknown generator: expanding raises before drawing
        if expansion_store.has(recipe.sha256, recipe.dtype, recipe.shape, recipe.stride):
            return key, 0
        drawn = int(size(recipe.params))
    except (KeyError, TypeError, ValueError, OverflowError) as error:
        raise UnsupportedValueError(
            f"recipe {recipe.describe()}: malformed parameters ({type(error).__name__}: {str(error)[:100]})"
        ) from error
    return key, max(drawn, 0)


def decode_recipe(tree: Any) -> torch.Tensor:
    """The codec's ``decode``: expand on the anchor's device (the device the reader was asked for)."""
    recipe = recipe_from_tree(tree)
    return expand(recipe, recipe.device)


def register() -> None:
    """Install the recipe codec in the format's registry (idempotent)."""
    from moereplay.format.codecs import register_codec

    register_codec(RECIPE_TYPE, encode_recipe, decode_recipe, recipe_bytes, recipe_scratch)


register()  # importing this module (by name, e.g. from a codec-provider table) makes recipe captures loadable
