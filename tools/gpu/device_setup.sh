# Prelude for every command on the GPU machine (nvidia-h200: Python 3.12, torch 2.11.0+cu130, no vLLM).
#
#   source tools/gpu/device_setup.sh && python3 -m pytest -m gpu tests/gpu -q
#
# Run from the repository root with the kernel pack carried (run tool: carry [".kernelpack"]). It unpacks the
# pack once into $MOEREPLAY_PACK_CACHE (vLLM's tree, its dist-info, the slimmed _C/_moe_C libraries and the
# extra wheels' files: pydantic, pyzmq, openai, zstandard, ...; no pip, no index needed), puts the unpacked
# site, the triton_kernels alias and the repository on PYTHONPATH (so `import vllm`, `import triton_kernels`
# and `python3 -m moereplay` work), exports MOEREPLAY_PACK for tests, and prints one line of versions.
# Variables: MOEREPLAY_PACK (default: REPO/.kernelpack), MOEREPLAY_PACK_CACHE (default: /tmp/moereplay-packs).
_moereplay_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export MOEREPLAY_PACK="${MOEREPLAY_PACK:-$_moereplay_repo/.kernelpack}"
export MOEREPLAY_PACK_CACHE="${MOEREPLAY_PACK_CACHE:-/tmp/moereplay-packs}"
export PYTHONUNBUFFERED=1
# The Marlin MoE kernels reach Hopper only as sm_80 PTX: the driver JIT-compiles a library's module on its first
# launch in a process (measured on the H200: ~66 s for the int4 module, ~23 s more for NVFP4) and keeps the result
# in ~/.nv/ComputeCache (34 MB after both), so later processes on the same machine start in seconds. Keep room.
export CUDA_CACHE_MAXSIZE="${CUDA_CACHE_MAXSIZE:-4294967296}"
_moereplay_paths="$(PYTHONPATH="$_moereplay_repo" python3 -c '
import sys
from pathlib import Path
from moereplay.pack.load import unpack_pack
print(":".join(str(path) for path in unpack_pack(Path(sys.argv[1])).paths))
' "$MOEREPLAY_PACK")" || { echo "device_setup: cannot unpack the kernel pack $MOEREPLAY_PACK" >&2; return 1 2>/dev/null || exit 1; }
export PYTHONPATH="$_moereplay_paths:$_moereplay_repo${PYTHONPATH:+:$PYTHONPATH}"
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
      f"{manifest.arch} torch=={manifest.torch_pin} {fit}")
PY
unset _moereplay_paths _moereplay_driver
