#!/bin/bash
# GPU tuning session for gemm_tc (one `run` call): tests, then the linear and grouped rows with the variants given.
OUT=${1:-/tmp/out}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee $OUT/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/gpu.txt
timeout ${TT:-80} python3 -m pytest -q -p no:cacheprovider tests/ops/test_gemm_tc.py 2>&1 | tail -15 | tee $OUT/tests.txt
python3 scripts/bench_kernels.py --no-reference --gemm-paths tc --tc-variants "$LIN_VAR" \
  --only '^linear (fp8_block|fp4 |bf16)[^M]*M=(1|32|64) ' 2>&1 | tee $OUT/bench_linear.txt
python3 scripts/bench_kernels.py --no-reference --gemm-paths tc --tc-variants "$GRP_VAR" \
  --only "${GRP_ONLY:-grouped_matmul (fp8_block|fp4) T=(1|8|32|64)x6}" 2>&1 | tee $OUT/bench_grouped.txt
