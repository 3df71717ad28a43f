#!/bin/bash
# One device call of the gemm session 4 (helper gemm3): tests, then the GEMM benchmark rows. Run from the worktree
# copy on the device machine: bash scripts/run_gemm_session4.sh STAGE...   (logs under $OUT)
#   main-tests: the cuda tests of test_gemm_tc.py / test_gemm_decode.py from the checkout root (main's code)
#   tests: test_gemm_tc_large.py (all) and the cuda tests of test_gemm_tc.py / test_gemm_decode.py (this branch)
#   lin1: linears M=1/32/64 (tc, tcl, default rules, cuBLAS) + tcl variants at M=64 ($LIN_VARIANTS)
#   grp1: grouped T=512 x 6 (tiled, tcl, default rules, _grouped_mm) + tcl variants ($GRP_VARIANTS)
#   final: the default rules against the old paths on every linear / grouped row of the table
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
B="python3 scripts/bench_kernels.py --no-reference"
for stage in "$@"; do
  case $stage in
    main-tests) (cd .. && PYTHONPATH=$PWD:/tmp/site timeout ${T_MAIN:-90} python3 -m pytest -q -p no:cacheprovider -m cuda \
                   tests/ops/test_gemm_tc.py tests/ops/test_gemm_decode.py 2>&1 | tail -15) | tee $OUT/main_tests.txt ;;
    tests) timeout ${T_TESTS:-120} python3 -m pytest -q -p no:cacheprovider tests/ops/test_gemm_tc_large.py -k "${TESTS_K:-not nothing}" \
             2>&1 | tail -25 | tee $OUT/tests.txt ;;
    lin1) timeout ${T_LIN:-100} $B --gemm-paths tc,tcl,auto --only '^linear (fp8_block|fp4 |bf16)[^M]*M=(1|32) ' \
            2>&1 | tee $OUT/lin1.txt
          timeout ${T_LIN:-100} $B --gemm-paths tc,tcl --tcl-variants "$LIN_VARIANTS" \
            --only '^linear (fp8_block|fp4 |bf16)[^M]*M=64 ' 2>&1 | tee -a $OUT/lin1.txt ;;
    grp1) timeout ${T_GRP:-150} $B --gemm-paths tiled,tcl,auto --tcl-variants "$GRP_VARIANTS" \
            --only 'grouped_matmul (fp8_block|fp4 |bf16 peer)[^T]*T=512x6' 2>&1 | tee $OUT/grp1.txt ;;
    final) timeout ${T_FINAL:-200} $B --gemm-paths ${FINAL_PATHS:-tiled,decode,tc,tcl,auto} \
             --only "${FINAL_ONLY:-^(linear (fp8_block|fp4 |bf16)[^M]*M=(1|32|64) |grouped_matmul (fp8_block|fp4 |bf16 peer)[^T]*T=(1|8|64|512)x6)}" \
             2>&1 | tee $OUT/final.txt ;;
  esac
done
