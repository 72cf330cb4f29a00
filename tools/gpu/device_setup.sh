# Prelude for every command on the GPU machine (nvidia-h200: Python 3.12, torch 2.11.0+cu130, no vLLM).
#
#   source tools/gpu/device_setup.sh && python3 -m pytest -m gpu tests/gpu -q
#
# Run from the repository root with the kernel pack carried (run tool: carry [".kernelpack"]). It unpacks the
# pack once into $MOEREPLAY_PACK_CACHE (vLLM's tree, its dist-info, the slimmed _C/_moe_C libraries and the
# extra wheels' files: pydantic, pyzmq, openai, zstandard, ...; no pip, no index needed), puts the unpacked
# site, the triton_kernels alias and the repository on PYTHONPATH (so `import vllm`, `import triton_kernels`
# and `python3 -m moereplay` work), exports MOEREPLAY_PACK for tests, and prints one line of versions.
# With the serve pack carried too (carry [".kernelpack", ".servepack"]; build it with `moereplay kernels pack
# --vllm 0.25.1 --profile serve -o .servepack`), it also unpacks that, links FlashAttention 3 into the unpacked
# vLLM tree, adds the serving wheels (fastapi, uvicorn, xgrammar, ...) to PYTHONPATH and puts a `vllm` script on
# PATH, so `vllm serve MODEL ...` (or `python3 -m vllm.entrypoints.cli.main serve MODEL ...`) works; vLLM's
# EngineCore and Worker processes inherit PYTHONPATH.
# Variables: MOEREPLAY_PACK (default: REPO/.kernelpack), MOEREPLAY_SERVE_PACK (default: REPO/.servepack when
# present; set it empty to leave the serve pack out), MOEREPLAY_PACK_CACHE (default: /tmp/moereplay-packs).
_moereplay_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export MOEREPLAY_PACK="${MOEREPLAY_PACK:-$_moereplay_repo/.kernelpack}"
export MOEREPLAY_PACK_CACHE="${MOEREPLAY_PACK_CACHE:-/tmp/moereplay-packs}"
export PYTHONUNBUFFERED=1
# The Marlin MoE kernels reach Hopper only as sm_80 PTX: the driver JIT-compiles a library's module on its first
# launch in a process (measured on the H200: ~66 s for the int4 module, ~23 s more for NVFP4) and keeps the result
# in ~/.nv/ComputeCache (34 MB after both), so later processes on the same machine start in seconds. Keep room.
export CUDA_CACHE_MAXSIZE="${CUDA_CACHE_MAXSIZE:-4294967296}"
# Prints three lines: the PYTHONPATH entries, the serve pack used ("" for none) and its bin directory ("" for none).
# A default REPO/.servepack that does not fit the kernel pack is left out with a warning; an explicit one fails.
_moereplay_unpacked="$(PYTHONPATH="$_moereplay_repo" python3 -c '
import os, sys
from pathlib import Path
from moereplay.errors import PackError
from moereplay.pack.load import SERVE_PACK_VARIABLE, serve_pack_setting, unpack_pack
serve = serve_pack_setting(os.environ, Path(sys.argv[2]))
try:
    unpacked = unpack_pack(Path(sys.argv[1]), serve=serve)
except PackError as error:
    if serve is None or SERVE_PACK_VARIABLE in os.environ:
        raise
    print(f"device_setup: leaving out the serve pack {serve}: {error}", file=sys.stderr)
    serve = None
    unpacked = unpack_pack(Path(sys.argv[1]))
print(":".join(str(path) for path in unpacked.paths))
print(serve or "")
print(unpacked.serve.bin if unpacked.serve else "")
' "$MOEREPLAY_PACK" "$_moereplay_repo/.servepack")" || { echo "device_setup: cannot unpack the kernel pack $MOEREPLAY_PACK (serve pack: ${MOEREPLAY_SERVE_PACK-default})" >&2; return 1 2>/dev/null || exit 1; }
_moereplay_paths="$(sed -n 1p <<<"$_moereplay_unpacked")"
export MOEREPLAY_SERVE_PACK="$(sed -n 2p <<<"$_moereplay_unpacked")"
_moereplay_bin="$(sed -n 3p <<<"$_moereplay_unpacked")"
export PYTHONPATH="$_moereplay_paths:$_moereplay_repo${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "$_moereplay_bin" ]; then export PATH="$_moereplay_bin:$PATH"; fi
_moereplay_driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1)"
python3 - "$_moereplay_driver" <<'PY' || { echo "device_setup: version check failed" >&2; return 1 2>/dev/null || exit 1; }
import os, platform, sys
from pathlib import Path
import torch
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = "absent"
from moereplay.pack.load import check_torch
from moereplay.pack.manifest import read_manifest
manifest = read_manifest(Path(os.environ["MOEREPLAY_PACK"]))
try:
    check_torch(manifest, torch.__version__, torch.version.cuda)
    fit = "ok"
except Exception as error:
    fit = f"MISMATCH ({error})"
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print(f"device_setup: python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"triton {triton_version}, driver {sys.argv[1] or '?'}, {gpu}; pack vLLM {manifest.vllm_version} "
      f"{manifest.arch} torch=={manifest.torch_pin} {fit}; "
      f"serve pack {os.environ.get('MOEREPLAY_SERVE_PACK') or 'none'}")
PY
unset _moereplay_paths _moereplay_driver _moereplay_unpacked _moereplay_bin
