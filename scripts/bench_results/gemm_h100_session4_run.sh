#!/bin/bash
# One device call of the gemm session 4 (helper gemm3): tests, then the GEMM benchmark rows. Run from the worktree
# copy on the device machine: bash scripts/bench_results/gemm_h100_session4_run.sh STAGE...   (logs under $OUT)
#   main-tests: the cuda tests of test_gemm_tc.py / test_gemm_decode.py from the checkout root (main's code)
#   tests: test_gemm_tc_large.py (all) and the cuda tests of test_gemm_tc.py / test_gemm_decode.py (this branch)
#   lin1: linears M=1/32/64 (tc, tcl, default rules, cuBLAS) + tcl variants at M=64 ($LIN_VARIANTS)
#   grp1: grouped T=512 x 6 (tiled, tcl, default rules, _grouped_mm) + tcl variants ($GRP_VARIANTS)
#   final: linears M=1/32/64 and grouped T=512 x 6: tiled, tc, tcl, the default rules, cuBLAS / _grouped_mm
#   small: the default rules at T=1/8/64 x 6 (regression check) with _grouped_mm
#   variants: tcl variants ($TCL_VARIANTS) and tc variants ($TC_VARIANTS) at M=64 and T=512 x 6
#   tests2: test_gemm_tc_large.py, and the cuda / gemm tests of test_gemm_tc, test_gemm_decode, test_triton_kernels
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
    final) timeout ${T_FINAL:-80} $B --gemm-paths tiled,tc,tcl,auto \
             --only '^(linear (fp8_block|fp4 |bf16)[^M]*M=(1|32|64) |grouped_matmul (fp8_block|fp4 |bf16 peer)[^T]*T=512x6)' \
             2>&1 | tee $OUT/final.txt ;;
    small) timeout ${T_SMALL:-40} $B --gemm-paths auto --only 'grouped_matmul (fp8_block|fp4 |bf16 peer)[^T]*T=(1|8|64)x6' \
             2>&1 | tee $OUT/small.txt ;;
    variants) timeout ${T_VAR:-90} $B --gemm-paths tcl --tcl-variants "$TCL_VARIANTS" --tc-variants "$TC_VARIANTS" \
             --only '^(linear (fp8_block|fp4 )[^M]*M=64 |grouped_matmul (fp8_block|fp4 )[^T]*T=512x6)' \
             2>&1 | tee $OUT/variants.txt ;;
    tests2) timeout ${T_TESTS:-80} python3 -m pytest -q -p no:cacheprovider tests/ops/test_gemm_tc_large.py \
             tests/ops/test_gemm_tc.py tests/ops/test_gemm_decode.py tests/ops/test_triton_kernels.py \
             -k "${TESTS_K:-test_gemm_tc_large or cuda or real or linear or grouped or gemm}" 2>&1 | tail -25 | tee $OUT/tests2.txt ;;
  esac
done
