"""Kernel packs: vLLM's compiled MoE kernels, taken from an official wheel, runnable without installing vLLM.

Build one with :func:`build_pack` (CLI: ``moereplay kernels pack``), load one with :func:`load_pack`::

    pack = load_pack(".kernelpack")          # checks the torch pin, unpacks once, prepends to sys.path
    ops = pack.custom_ops                     # vllm._custom_ops from the pack (torch.ops._C / _moe_C registered)
    mod = pack.import_module("vllm.model_executor.layers.fused_moe.experts.marlin_moe")
    tk = pack.import_module("triton_kernels") # a vendored library, by its top-level name

A second, separate pack of profile ``serve`` (``moereplay kernels pack --profile serve -o .servepack``) holds what
``vllm serve`` needs beyond a kernel pack — FlashAttention 3 and the serving wheels — and is attached to the
kernel pack built from the same wheel: ``unpack_pack(".kernelpack", serve=Path(".servepack"))``.

Modules: ``elf`` and ``fatbin`` read the CUDA libraries, ``libraries`` slims them to one GPU architecture,
``wheels`` and ``download`` handle wheels, ``archive`` writes and unpacks the tar.xz files, ``profiles`` says what
each kind of pack holds, ``manifest`` describes a pack, ``build`` makes one, ``load`` loads one (and attaches a
serve pack), ``smoke`` proves a loaded pack computes correctly on a GPU.
"""

from __future__ import annotations

from moereplay.pack.build import BuildOptions, build_pack
from moereplay.pack.load import (
    LoadedPack,
    UnpackedPack,
    UnpackedServe,
    check_torch,
    default_cache_dir,
    load_pack,
    serve_pack_setting,
    unpack_pack,
)
from moereplay.pack.manifest import PackManifest, read_manifest
from moereplay.pack.profiles import PROFILES, PackProfile

__all__ = [
    "PROFILES",
    "BuildOptions",
    "LoadedPack",
    "PackManifest",
    "PackProfile",
    "UnpackedPack",
    "UnpackedServe",
    "build_pack",
    "check_torch",
    "default_cache_dir",
    "load_pack",
    "read_manifest",
    "serve_pack_setting",
    "unpack_pack",
]
