// The one switch between the NPU build and the host emulation (atb_ops/ascendc/emu).
//   ASCENDC_EMU defined   -> our own headers that emulate the AscendC API subset these kernels use (g++ on the host)
//   ASCENDC_EMU undefined -> CANN's kernel_operator.h (+ lib/matmul_intf.h for the cube kernel), built by
//                            ascendc_library on a machine with CANN
#pragma once

#ifdef ASCENDC_EMU
#include "../emu/kernel_operator_emu.h"
#include "../emu/matmul_emu.h"
#else
#include "kernel_operator.h"
#ifdef DSV4_NEEDS_MATMUL  // the cube kernel (mla_decode_cube.cpp) defines it before including this header
#include "lib/matmul_intf.h"
#endif
#endif

#include <type_traits>

#include "tiling_data.h"

namespace dsv4 {

__aicore__ inline uint32_t CeilDiv(uint32_t a, uint32_t b) { return (a + b - 1) / b; }
__aicore__ inline uint32_t AlignUp(uint32_t a, uint32_t b) { return CeilDiv(a, b) * b; }

// Elements of T per 32-byte UB block.
template <typename T>
__aicore__ inline uint32_t BlockElems() { return 32 / sizeof(T); }

// Read a tiling struct from GM word by word (the <<<>>> launch passes it as a GM buffer).
template <typename S>
__aicore__ inline void LoadTiling(S& dst, GM_ADDR src) {
    __gm__ uint32_t* words = reinterpret_cast<__gm__ uint32_t*>(src);
    uint32_t* out = reinterpret_cast<uint32_t*>(&dst);
    for (uint32_t i = 0; i < sizeof(S) / sizeof(uint32_t); ++i) out[i] = words[i];
}

// Whether a GM<->UB move of n elements at `src` may use DataCopy: whole 32-byte blocks from a 32-byte aligned GM
// address (DataCopyPad has neither constraint).
template <typename T>
__aicore__ inline bool WholeBlocks(const AscendC::GlobalTensor<T>& g, uint32_t n) {
    return (n * sizeof(T)) % 32 == 0 && (reinterpret_cast<uint64_t>(g.GetPhyAddr()) % 32) == 0;
}

// GM -> UB copy of n elements: DataCopy when WholeBlocks, else DataCopyPad (the tail of the last UB block is
// padded with `padValue`).
template <typename T>
__aicore__ inline void CopyInRow(const AscendC::LocalTensor<T>& dst, const AscendC::GlobalTensor<T>& src, uint32_t n,
                                 T padValue) {
    if (WholeBlocks(src, n)) {
        AscendC::DataCopy(dst, src, n);
    } else {
        AscendC::DataCopyExtParams p{1, static_cast<uint32_t>(n * sizeof(T)), 0, 0, 0};
        AscendC::DataCopyPadExtParams<T> pad{true, 0, static_cast<uint8_t>(AlignUp(n, BlockElems<T>()) - n), padValue};
        AscendC::DataCopyPad(dst, src, p, pad);
    }
}

// UB -> GM copy of n elements (DataCopy when WholeBlocks, else DataCopyPad).
template <typename T>
__aicore__ inline void CopyOutRow(const AscendC::GlobalTensor<T>& dst, const AscendC::LocalTensor<T>& src, uint32_t n) {
    if (WholeBlocks(dst, n)) {
        AscendC::DataCopy(dst, src, n);
    } else {
        AscendC::DataCopyExtParams p{1, static_cast<uint32_t>(n * sizeof(T)), 0, 0, 0};
        AscendC::DataCopyPad(dst, src, p);
    }
}

}  // namespace dsv4
