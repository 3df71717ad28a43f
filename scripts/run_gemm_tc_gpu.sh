#!/bin/bash
# GPU session for gemm_tc (one `run` call): the kernel's tests, then the GEMM benchmark rows (old decode kernel vs the
# swap-AB tensor-core kernel vs cuBLAS bf16 / torch._grouped_mm bf16), all in one process per step.
# usage: scripts/run_gemm_tc_gpu.sh OUTDIR "TC_VARIANTS" "PATHS" [TEST_TIMEOUT]
OUT=${1:-/tmp/out}; VAR=${2:-}; PATHS=${3:-decode,tc}; TT=${4:-110}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee $OUT/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/gpu.txt
timeout $TT python3 -m pytest -q -p no:cacheprovider tests/ops/test_gemm_tc.py ${TESTS_EXTRA} 2>&1 | tail -25 | tee $OUT/tests.txt
python3 scripts/bench_kernels.py --no-reference --gemm-paths "$PATHS" --tc-variants "$VAR" \
  --only "${ONLY:-^(linear (fp8_block|fp4 |bf16)[^M]*M=(1|32|64) |grouped_matmul (fp8_block|fp4|bf16 peer)[^T]*T=(1|8|32|64)x6)}" \
  --out $OUT/bench.json 2>&1 | tee $OUT/bench.txt
