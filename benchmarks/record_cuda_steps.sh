#!/usr/bin/env bash
# The GPU recordings in one call (for a lent GPU machine): the device, then
# record_cuda_steps.py for each configuration, into $OUT (else results/recordings).
#
# That machine has no package index: fetch pyzmq and msgspec wheels for its Python
# into .whl/ beforehand, and carry that folder:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl pyzmq msgspec
#
# CONFIGS (default "eight_b wide"), PHASE_S (default 10), GRAPHS (default 1: replay
# decode-only passes from CUDA graphs, as vLLM does; 0: eager), LIMIT_S (default 400).
set -euo pipefail
out=${OUT:-results/recordings}
mkdir -p "$out"
if ! python3 -c "import zmq, msgspec" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
fi
read -r -a configs <<<"${CONFIGS:-eight_b wide}"
graphs=()
[ "${GRAPHS:-1}" = 1 ] && graphs=(--cuda-graphs)
timeout "${LIMIT_S:-400}" python3 benchmarks/record_cuda_steps.py --configs "${configs[@]}" \
  --phase-s "${PHASE_S:-10}" "${graphs[@]}" --out "$out" 2>&1 | tee "$out/log.txt"
