#!/usr/bin/env bash
# Check pdctl's seam (pdctl/connector/seam.py) against a vLLM release's Python sources without installing it: a
# CUDA wheel checked on any machine, CPU included. Run before admitting a release in pyproject's [cuda] extra and
# adding it to seam.CHECKED; not in CI, whose runs would each download the wheel (~240 MB).
#
#   make check-vllm VLLM=0.34.0        # or: bash scripts/check_vllm_release.sh 0.34.0
#
# The wheel's sources are kept in ${PDCTL_CACHE:-~/.cache/pdctl}/vllm-VERSION for the next run.
set -euo pipefail
version=${1:?usage: check_vllm_release.sh VLLM_VERSION (e.g. 0.34.0)}
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PY:-$root/.venv/bin/python}
dir=${PDCTL_CACHE:-$HOME/.cache/pdctl}/vllm-$version
if [ ! -f "$dir/src/vllm/__init__.py" ]; then
  mkdir -p "$dir"
  echo "downloading vllm==$version (its wheel, ~240 MB, without dependencies) into $dir" >&2
  "$py" -m pip download "vllm==$version" --no-deps -d "$dir" -q
  unzip -q -o "$dir"/vllm-"$version"-*.whl 'vllm/*' -x 'vllm/*.so' -d "$dir/src"
fi
PYTHONPATH="$dir/src" exec "$py" "$root/scripts/check_vllm_compat.py"
