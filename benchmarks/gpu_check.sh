#!/usr/bin/env bash
# GPU checks, run once where a CUDA GPU is available:
#   1. the test suite with CUDA present (tests/test_cuda.py compares codecs, coded kernels,
#      attention on codes and generate on the GPU against the CPU; the rest runs as on CPU);
#   2. the decode-speed benchmark on CUDA at 1k-8k tokens.
# Usage: benchmarks/gpu_check.sh [OUT_DIR]   (PYTHON=python3 by default; run from the repo root)
# The model file cannot always travel to a GPU machine: set FIBQUANT_GPU_REAL_MODEL=1 to use the
# real SmolLM2 weights, otherwise the benchmark uses its architecture with random weights
# (speed and memory do not depend on the weights) and the tests deselect `-m model`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-results}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FIBQUANT_RESULTS_DIR="$OUT_DIR"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT_DIR/gpu_info.txt"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee -a "$OUT_DIR/gpu_info.txt"

MARK=(-m "not model")
WEIGHTS=(--random-weights)
if [ "${FIBQUANT_GPU_REAL_MODEL:-0}" = 1 ]; then MARK=(); WEIGHTS=(); fi

status=0
$PY -m pytest -q -p no:cacheprovider "${MARK[@]}" tests 2>&1 | tee "$OUT_DIR/gpu_tests.log" | tail -25
[ "${PIPESTATUS[0]}" = 0 ] || status=1

$PY benchmarks/decode_speed.py --device cuda "${WEIGHTS[@]}" --contexts ${GPU_CONTEXTS:-1024 2048 4096 8192} \
    --decode-tokens 32 --no-progress --out "$OUT_DIR" \
    --caches ${GPU_CACHES:-dynamic fibquant4 fibquant3 fibquant2 turboquant4 turboquant2 fibquant4-old turboquant4-old quanto4 quanto2 hqq4 hqq2} \
    2>&1 | tee "$OUT_DIR/gpu_decode_speed.log" | grep -v Warning
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit $status
