#!/usr/bin/env bash
# GPU checks, one prepared script for a lent CUDA GPU, <= ~8 minutes by default:
#   1. the CUDA tests: tests/kv/test_cuda.py (codecs, coded kernels, attention on codes and generate on
#      the GPU against the CPU), tests/kv/attention/test_coded_triton.py (the Triton kernels compiled for the GPU
#      against the torch reference, plus the 8k-context peak-memory check), tests/kv/attention/test_coded_kernels.py;
#   2. per-layer decode attention at 8k, 32k and 128k tokens, batch 1 and 16, Llama-8B-shaped (head_dim 128,
#      8 KV heads, 32 query heads, random data): FibQuant 4-bit and 2-bit through the fused Triton kernel vs
#      bf16 SDPA, with peak-memory deltas, and the same codes in vLLM-style token-major pages read
#      through scrambled block tables by the paged kernel (benchmarks/gpu_decode_attention.py -> JSON);
#   3. end-to-end generate of a Llama-3.2-1B-shaped model (random bf16 weights) at 8k tokens: decode tokens/s,
#      TTFT and peak memory, CompressedCache vs DynamicCache (benchmarks/gpu_generate.py -> JSON);
#   4. a one-screen summary with the targets (benchmarks/gpu_summary.py -> gpu_summary.json);
#   5. only with FIBQUANT_GPU_FULL=1 (longer): the whole test suite on CUDA.
# Needs torch with CUDA and triton (pip install 'fibquant[gpu]') in $PYTHON; without triton the
# Triton tests skip and step 2 stops with a message. Works with the package's floors (checked: torch 2.11,
# triton 3.6, transformers 5.17 of a device image, nothing installed).
# Usage: benchmarks/gpu_check.sh [OUT_DIR]   (default $OUT when set, else results/; PYTHON=python3 by default;
#        run from the repo root). `benchmarks/gpu_check.sh --smoke` runs steps 2-4 on the CPU at tiny sizes
#        (Triton's interpreter): a check of the script itself, not of a GPU.
# The model file cannot always travel to a GPU machine: the tests deselect `-m model`.
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
OUT_DIR=${1:-${OUT:-results}}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FIBQUANT_RESULTS_DIR="$OUT_DIR"
status=0

if [ "$SMOKE" = 1 ]; then
    $PY benchmarks/gpu_decode_attention.py --device cpu --contexts 256 --batches 1 2 --q-heads 4 --kv-heads 2 \
        --dim 64 --repeats 1 --warmup 0 --out "$OUT_DIR" > "$OUT_DIR/gpu_decode_attention.log" 2>&1 || status=1
    $PY benchmarks/gpu_generate.py --device cpu --layers 2 --hidden 256 --q-heads 4 --kv-heads 2 --vocab 1000 \
        --context 256 --decode-tokens 4 --repeats 1 --out "$OUT_DIR" > "$OUT_DIR/gpu_generate.log" 2>&1 || status=1
    $PY benchmarks/gpu_summary.py "$OUT_DIR" || status=1
    exit $status
fi
unset TRITON_INTERPRET  # compiled kernels here, never the interpreter

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT_DIR/gpu_info.txt"
$PY -c "import torch, transformers, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'numpy', numpy.__version__, torch.cuda.get_device_name())" \
    | tee -a "$OUT_DIR/gpu_info.txt"
$PY -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1 | tee -a "$OUT_DIR/gpu_info.txt"

timeout "${GPU_TEST_TIMEOUT:-150}" $PY -m pytest -q -p no:cacheprovider -m "not model" \
    tests/kv/test_cuda.py tests/kv/attention/test_coded_triton.py tests/kv/attention/test_coded_kernels.py 2>&1 \
    | tee "$OUT_DIR/gpu_tests.log" | tail -15
[ "${PIPESTATUS[0]}" = 0 ] || status=1

timeout "${GPU_BENCH_TIMEOUT:-200}" $PY benchmarks/gpu_decode_attention.py --device cuda \
    --contexts ${GPU_ATTN_CONTEXTS:-8192 32768 131072} --batches ${GPU_ATTN_BATCHES:-1 16} \
    --codecs fibquant:b=4 fibquant:b=2 --repeats ${GPU_ATTN_REPEATS:-20} --warmup 3 --out "$OUT_DIR" \
    > "$OUT_DIR/gpu_decode_attention.log" 2>&1
[ "$?" = 0 ] || { status=1; tail -20 "$OUT_DIR/gpu_decode_attention.log"; }

timeout "${GPU_GENERATE_TIMEOUT:-120}" $PY benchmarks/gpu_generate.py --device cuda --context ${GPU_CONTEXT:-8192} \
    --decode-tokens 32 --repeats 3 --caches fp fibquant:b=4 fibquant:b=2 --out "$OUT_DIR" \
    > "$OUT_DIR/gpu_generate.log" 2>&1
[ "$?" = 0 ] || { status=1; tail -20 "$OUT_DIR/gpu_generate.log"; }

if [ "${FIBQUANT_GPU_FULL:-0}" = 1 ]; then
    $PY -m pytest -q -p no:cacheprovider -m "not model" tests 2>&1 | tee "$OUT_DIR/gpu_tests_full.log" | tail -25
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
$PY benchmarks/gpu_summary.py "$OUT_DIR"
exit $status
