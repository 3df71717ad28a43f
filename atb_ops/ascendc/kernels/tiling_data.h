// Tiling structs shared by the host tiling (tiling.h) and the kernels. Plain 32-bit fields only, so that the kernel
// can read them from GM word by word (dsv4::LoadTiling) and Python can mirror them with ctypes.
#pragma once

#include <cstdint>

namespace dsv4 {

enum DType : uint32_t { DT_FLOAT32 = 0, DT_BFLOAT16 = 1 };

// compressor_pool: entry m pools the K candidate rows cand[m, :] per channel.
struct CompressorTiling {
    uint32_t numEntries;  // M
    uint32_t numCand;     // K (= r without overlap, 2r with overlap)
    uint32_t numRows;     // S: rows of kv_state / score_state (bounds of the GM tensors)
    uint32_t width;       // W: row width (c, or 2c with overlap)
    uint32_t c;           // output channels
    uint32_t half;        // r: candidates k >= half read the B half (overlap only)
    uint32_t overlap;     // 0 / 1
    uint32_t cTile;       // channels per work item
    uint32_t nCTiles;     // ceil(c / cTile)
    uint32_t numItems;    // M * nCTiles work items, spread over the cores
    uint32_t blockDim;    // cores launched
    uint32_t dtype;       // DType of kv_state / score_state (output is float32)
    uint32_t ubBytes;     // UB bytes the kernel's InitBuffer calls reserve (computed by the tiling)
    uint32_t socUb;       // UB capacity of the target SoC
    uint32_t epilogue;    // 1: fused RMSNorm (weight, eps) + interleaved RoPE on the last ropeDim channels
    uint32_t ropeDim;     // R of the epilogue's RoPE
    float eps;            // RMSNorm epsilon of the epilogue
};

// mla_decode / sparse_attention: token t attends, with one softmax (plus an optional per-head sink), to the rows
// idx0[t, :] of pool0 and idx1[t, :] of pool1; score = scale * (q[t,h] . row[:C] + qpe[t,h] . row[C:C+R]);
// out[t, h] = sum_j p_j row_j[:C].
struct MlaTiling {
    uint32_t numTokens;   // T
    uint32_t numHeads;    // H
    uint32_t dimC;        // C: score-and-value channels (kv_lora_rank for V3, head_dim for V4)
    uint32_t dimR;        // R: score-only channels (qk_rope_head_dim for V3, 0 for V4)
    uint32_t numIdx0;     // L0: width of idx0
    uint32_t numIdx1;     // L1: width of idx1 (0: no second set)
    uint32_t rows0;       // P0: rows of pool0
    uint32_t rows1;       // P1: rows of pool1
    uint32_t hasSink;     // 0 / 1
    uint32_t headGroup;   // hg: heads per work item
    uint32_t numGroups;   // ceil(H / hg)
    uint32_t blockRows;   // nb: key rows gathered per block (double-buffered)
    uint32_t idxChunk;    // indices loaded per index copy
    uint32_t numItems;    // T * numGroups
    uint32_t blockDim;    // cores launched
    uint32_t qDtype;      // DType of q / qpe / out
    uint32_t kvDtype;     // DType of the pools
    uint32_t ubBytes;     // UB bytes reserved by the kernel (computed by the tiling)
    uint32_t socUb;       // UB capacity of the target SoC
    float scale;          // softmax scale
};

}  // namespace dsv4
