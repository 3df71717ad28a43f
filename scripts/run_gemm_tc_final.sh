#!/bin/bash
# Final GPU session for gemm_tc (one `run` call): every test touching the fp8 / fp4 GEMMs (cuda-marked ones
# included), then old (tiled, decode) vs new (tc, the default where TC_* rules pick it) vs cuBLAS bf16 /
# torch._grouped_mm bf16, all in the same run.
OUT=${1:-/tmp/out}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee $OUT/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/gpu.txt
timeout ${TT:-110} python3 -m pytest -q -p no:cacheprovider tests/ops/test_gemm_tc.py tests/ops/test_gemm_decode.py \
  tests/ops/test_triton_kernels.py -k "linear or grouped or expert or fp4 or gemm or tc" 2>&1 | tail -15 | tee $OUT/tests.txt
python3 scripts/bench_kernels.py --no-reference --gemm-paths tiled,decode,tc --tc-variants "$LIN_VAR" \
  --only '^linear (fp8_block|fp4 |bf16)[^M]*M=(1|32|64) ' 2>&1 | tee $OUT/bench_linear.txt
python3 scripts/bench_kernels.py --no-reference --gemm-paths tiled,decode,tc --tc-variants "$GRP_VAR" \
  --only 'grouped_matmul (fp8_block|fp4|bf16 peer)[^T]*T=(1|8|32|64|512)x6' 2>&1 | tee $OUT/bench_grouped.txt
