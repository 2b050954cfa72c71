#!/usr/bin/env bash
# GPU checks, one prepared script for a lent CUDA GPU, <= ~8 minutes by default:
#   1. the CUDA tests: tests/kv/test_cuda.py (codecs, coded kernels, attention on codes and generate on
#      the GPU against the CPU), tests/kv/attention/test_coded_triton.py (the Triton kernels compiled for the GPU
#      against the torch reference, plus the 8k-context peak-memory check), tests/kv/attention/test_coded_kernels.py;
#   2. per-layer decode attention at 8k and 32k tokens, Llama-8B-shaped (head_dim 128, 8 KV heads,
#      32 query heads, random data): FibQuant 4-bit and 2-bit through the fused Triton kernel vs
#      bf16 SDPA, with peak-memory deltas, and the same codes in vLLM-style token-major pages read
#      through scrambled block tables by the paged kernel (benchmarks/gpu_decode_attention.py -> JSON);
#   3. only with FIBQUANT_GPU_FULL=1 (longer): the whole test suite and the end-to-end decode-speed
#      benchmark on CUDA at 1k-8k tokens.
# Needs torch with CUDA and triton (pip install 'fibquant[gpu]') in $PYTHON; without triton the
# Triton tests skip and step 2 stops with a message.
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
unset TRITON_INTERPRET  # compiled kernels here, never the interpreter

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT_DIR/gpu_info.txt"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee -a "$OUT_DIR/gpu_info.txt"
$PY -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1 | tee -a "$OUT_DIR/gpu_info.txt"

MARK=(-m "not model")
WEIGHTS=(--random-weights)
if [ "${FIBQUANT_GPU_REAL_MODEL:-0}" = 1 ]; then MARK=(); WEIGHTS=(); fi

status=0
timeout "${GPU_TEST_TIMEOUT:-300}" $PY -m pytest -q -p no:cacheprovider "${MARK[@]}" \
    tests/kv/test_cuda.py tests/kv/attention/test_coded_triton.py tests/kv/attention/test_coded_kernels.py 2>&1 \
    | tee "$OUT_DIR/gpu_tests.log" | tail -25
[ "${PIPESTATUS[0]}" = 0 ] || status=1

timeout "${GPU_BENCH_TIMEOUT:-200}" $PY benchmarks/gpu_decode_attention.py --device cuda \
    --contexts ${GPU_ATTN_CONTEXTS:-8192 32768} --codecs fibquant:b=4 fibquant:b=2 --reference --out "$OUT_DIR" \
    2>&1 | tee "$OUT_DIR/gpu_decode_attention.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

if [ "${FIBQUANT_GPU_FULL:-0}" = 1 ]; then
    $PY -m pytest -q -p no:cacheprovider "${MARK[@]}" tests 2>&1 | tee "$OUT_DIR/gpu_tests_full.log" | tail -25
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    $PY benchmarks/decode_speed.py --device cuda "${WEIGHTS[@]}" --contexts ${GPU_CONTEXTS:-1024 2048 4096 8192} \
        --decode-tokens 32 --no-progress --out "$OUT_DIR" \
        --caches ${GPU_CACHES:-fp fibquant:b=4 fibquant:b=3 fibquant:b=2 turboquant:b=4 turboquant:b=2 fibquant:b=4@decode turboquant:b=4@decode quanto:b=4 quanto:b=2 hqq:b=4 hqq:b=2} \
        2>&1 | tee "$OUT_DIR/gpu_decode_speed.log" | grep -v Warning
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
exit $status
