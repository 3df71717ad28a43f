#!/usr/bin/env bash
# Build our AscendC kernels (atb_ops/ascendc) and their torch binding with CANN:
#   libascend_dsv4_ascendc_ops.so -> atb_ops/ascendc/build/install/lib/ (found there by atb_ops.ascendc.loader)
#
# Needs: the CANN toolkit (source <toolkit>/set_env.sh so that ASCEND_HOME_PATH is set), cmake >= 3.16, a host C++
# compiler, and python with torch + torch_npu. Options (environment):
#   SOC_VERSION   target SoC for the kernel compiler (default Ascend910B2; e.g. Ascend910B4, Ascend910_9391 for A3)
#   PYTHON        python to take torch / torch_npu from (default python3)
#   BUILD_TYPE    Release (default) | Debug
# Without CANN it lists everything that is missing and exits with status 2; nothing is built.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$ROOT/atb_ops/ascendc"
BUILD="$SRC/build"
PYTHON="${PYTHON:-python3}"
SOC_VERSION="${SOC_VERSION:-Ascend910B2}"
BUILD_TYPE="${BUILD_TYPE:-Release}"

missing=()
if [[ -z "${ASCEND_HOME_PATH:-}" ]]; then
    missing+=("CANN toolkit: ASCEND_HOME_PATH is not set (install CANN, then 'source <Ascend>/ascend-toolkit/set_env.sh')")
elif [[ ! -d "$ASCEND_HOME_PATH" ]]; then
    missing+=("CANN toolkit: ASCEND_HOME_PATH=$ASCEND_HOME_PATH is not a directory")
elif [[ ! -d "$ASCEND_HOME_PATH/compiler/tikcpp/ascendc_kernel_cmake" && ! -d "$ASCEND_HOME_PATH/tools/tikcpp/ascendc_kernel_cmake" ]]; then
    missing+=("CANN toolkit: no tikcpp/ascendc_kernel_cmake (ascendc_library) under ASCEND_HOME_PATH=$ASCEND_HOME_PATH")
fi
command -v cmake >/dev/null 2>&1 || missing+=("cmake >= 3.16 on PATH")
command -v "${CXX:-c++}" >/dev/null 2>&1 || missing+=("a host C++17 compiler (\$CXX or c++)")
TORCH_PATH="$("$PYTHON" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null)" \
    || missing+=("torch importable by $PYTHON")
TORCH_NPU_PATH="$("$PYTHON" -c 'import os, torch_npu; print(os.path.dirname(torch_npu.__file__))' 2>/dev/null)" \
    || missing+=("torch_npu importable by $PYTHON (it also needs CANN's runtime libraries)")

if (( ${#missing[@]} )); then
    echo "build_ascendc.sh: cannot build the AscendC kernels on this machine; missing:" >&2
    for m in "${missing[@]}"; do echo "  - $m" >&2; done
    echo "The same kernel sources run on the host without CANN through the emulation: LLM(..., backend=\"ascendc_emu\")." >&2
    exit 2
fi

set -e
echo "build_ascendc.sh: CANN at $ASCEND_HOME_PATH, SoC $SOC_VERSION, torch at $TORCH_PATH, torch_npu at $TORCH_NPU_PATH"
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE="$BUILD_TYPE" -DSOC_VERSION="$SOC_VERSION" \
    -DASCEND_CANN_PACKAGE_PATH="$ASCEND_HOME_PATH" -DTORCH_PATH="$TORCH_PATH" -DTORCH_NPU_PATH="$TORCH_NPU_PATH" \
    -DCMAKE_INSTALL_PREFIX="$BUILD/install"
cmake --build "$BUILD" -j "$(nproc 2>/dev/null || echo 4)"
cmake --install "$BUILD"
echo "build_ascendc.sh: built $BUILD/install/lib/libascend_dsv4_ascendc_ops.so"
echo "  check: $PYTHON -c 'from atb_ops.ascendc.loader import load_ascendc_ops; print(load_ascendc_ops())'"
