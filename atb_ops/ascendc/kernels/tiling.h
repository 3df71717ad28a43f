// Host-side tiling for the kernels: sizes the unified-buffer tiles for the target SoC and splits the work over its
// vector cores. Pure C++ (no AscendC), used by the emulation launcher and by the CANN torch binding.
//
// Core counts and UB size are public third-party figures (no vendor datasheet is public): Atlas A2 910B2 and A3 910C
// (per die) 24 AI cores = 24 cube + 48 vector cores; 910B3/910B4 20 + 40; 192 KiB of UB per vector core (the
// triton-ascend programming guide's figure for A2/A3). The binding may pass the live core count instead.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "tiling_data.h"

namespace dsv4 {

struct SocInfo {
    const char* name;
    uint32_t vectorCores;
    uint32_t ubBytes;
};

// index = the soc id passed from Python (atb_ops.ascendc.emu.SOCS mirrors this table)
inline const SocInfo& Soc(uint32_t id) {
    static const SocInfo table[] = {
        {"ascend910b2", 48, 192 * 1024},
        {"ascend910b4", 40, 192 * 1024},
        {"ascend910c", 48, 192 * 1024},  // one die; a 910C package is two such devices
    };
    if (id >= sizeof(table) / sizeof(table[0])) throw std::invalid_argument("unknown SoC id " + std::to_string(id));
    return table[id];
}

inline uint32_t HostAlignUp(uint32_t a, uint32_t b) { return (a + b - 1) / b * b; }
inline uint32_t HostCeilDiv(uint32_t a, uint32_t b) { return (a + b - 1) / b; }
inline uint32_t DTypeSize(uint32_t dt) { return dt == DT_BFLOAT16 ? 2 : 4; }
// elements of a dtype padded to whole 32-byte blocks
inline uint32_t PadElems(uint32_t n, uint32_t dt) { return HostAlignUp(n, 32 / DTypeSize(dt)); }
inline uint32_t ReduceWork(uint32_t count) { return HostAlignUp(HostCeilDiv(count, 64), 8); }  // float elements

// ---- compressor ------------------------------------------------------------------------------------------------
// UB bytes of the compressor kernel for a channel tile (must match its InitBuffer calls exactly).
inline uint32_t CompressorUbBytes(uint32_t cTile, uint32_t numCand, uint32_t dt, uint32_t epilogue = 0, uint32_t ropeDim = 0) {
    const uint32_t inBytes = PadElems(cTile, dt) * DTypeSize(dt);
    const uint32_t f32 = PadElems(cTile, DT_FLOAT32) * 4;
    uint32_t total = 2 * 2 * inBytes;            // z and a input queues, double-buffered
    total += HostAlignUp(numCand * 8, 32);       // candidate row indices (int64)
    total += 4 * f32;                            // running max, new max, sum, accumulator
    if (dt != DT_FLOAT32) total += 2 * f32;      // float copies of z and a
    total += 2 * f32;                            // output queue, double-buffered
    if (epilogue) {
        const uint32_t r = PadElems(ropeDim, DT_FLOAT32) * 4, h = PadElems(ropeDim / 2, DT_FLOAT32) * 4;
        total += 2 * f32;                        // norm weight, squares
        total += 8 * 4 + ReduceWork(cTile) * 4;  // sum-of-squares slot + reduction work
        total += 2 * h;                          // cos, sin of the entry ([R/2] each)
        total += 5 * r;                          // interleaved cos, signed sin, swapped x, product, sign
        total += 2 * r;                          // gather byte offsets (duplicate, swap), uint32
    }
    return total;
}

// forceCTile > 0 pins the channel tile (tests use it to reach every branch). With the epilogue the whole entry is
// one tile (the RMSNorm needs every channel) and the RoPE slice must start on a 32-byte boundary.
inline CompressorTiling CompressorTilingFor(uint32_t M, uint32_t K, uint32_t S, uint32_t W, uint32_t overlap, uint32_t dt,
                                            uint32_t socId, uint32_t forceCTile, uint32_t forceUb, uint32_t epilogue = 0,
                                            uint32_t ropeDim = 0, float eps = 0.0f) {
    const SocInfo& soc = Soc(socId);
    CompressorTiling t{};
    t.numEntries = M;
    t.numCand = K;
    t.numRows = S;
    t.width = W;
    t.overlap = overlap;
    t.c = overlap ? W / 2 : W;
    t.half = overlap ? K / 2 : K;
    t.dtype = dt;
    t.socUb = forceUb ? forceUb : soc.ubBytes;
    t.epilogue = epilogue;
    t.ropeDim = ropeDim;
    t.eps = eps;
    uint32_t cTile;
    if (epilogue) {
        if (ropeDim % 2 || ropeDim > t.c || (t.c - ropeDim) % 8)
            throw std::invalid_argument("compressor epilogue: rope dim " + std::to_string(ropeDim) + " must be even, <= c = " +
                                        std::to_string(t.c) + ", and c - rope dim a multiple of 8");
        cTile = t.c;
    } else if (forceCTile) {
        cTile = std::min(forceCTile, t.c);
    } else {
        // enough channel tiles to give every core work when there are few entries (decode), but no tile under 64
        // channels (256-byte bursts); as large as the UB allows otherwise
        const uint32_t wantTiles = std::max<uint32_t>(1, HostCeilDiv(soc.vectorCores, std::max<uint32_t>(M, 1)));
        cTile = std::max<uint32_t>(std::min<uint32_t>(64, t.c), HostAlignUp(HostCeilDiv(t.c, wantTiles), 8));
        cTile = std::min(cTile, t.c);
        while (cTile > 8 && CompressorUbBytes(cTile, K, dt) > t.socUb) cTile = HostAlignUp(cTile / 2, 8);
    }
    t.cTile = std::max<uint32_t>(cTile, 1);
    t.nCTiles = HostCeilDiv(t.c, t.cTile);
    t.numItems = M * t.nCTiles;
    t.blockDim = std::max<uint32_t>(1, std::min(soc.vectorCores, t.numItems));
    t.ubBytes = CompressorUbBytes(t.cTile, K, dt, epilogue, ropeDim);
    return t;
}

// ---- mla decode ------------------------------------------------------------------------------------------------
inline uint32_t MlaUbBytes(uint32_t hg, uint32_t nb, uint32_t C, uint32_t R, uint32_t idxChunk, uint32_t qdt, uint32_t kvdt) {
    const uint32_t cf = PadElems(C, DT_FLOAT32), rf = PadElems(R, DT_FLOAT32);
    const uint32_t hgp = HostAlignUp(hg, 8), nbp = HostAlignUp(nb, 8);
    uint32_t total = hg * (cf + rf) * 4;                                      // q (float)
    if (qdt != DT_FLOAT32) total += hg * (PadElems(C, qdt) + PadElems(R, qdt)) * DTypeSize(qdt);  // q/out staging
    total += hg * cf * 4;                                                     // accumulators
    total += 2 * nb * (PadElems(C, kvdt) + PadElems(R, kvdt)) * DTypeSize(kvdt);  // gathered rows, double-buffered
    if (kvdt != DT_FLOAT32) total += nb * (cf + rf) * 4;                      // rows as float
    total += hg * nbp * 4;                                                    // scores / probabilities
    total += 5 * hgp * 4;                                                     // max, new max, rescale, block max, sum
    total += HostAlignUp(idxChunk * 8, 32);                                   // index chunk (int64)
    total += std::max<uint32_t>(std::max(cf, rf), 8) * 4;                     // products
    total += (hg * nb * (R ? 2 : 1) + 2 * hg) * 8 * 4;                        // reduction slots (32 B each)
    total += ReduceWork(std::max(std::max(C, R), nb)) * 4;                    // reduction work area
    return total;
}

// forceHg / forceNb > 0 pin the head group / rows per block (tests reach every branch with them).
inline MlaTiling MlaTilingFor(uint32_t T, uint32_t H, uint32_t C, uint32_t R, uint32_t L0, uint32_t L1, uint32_t P0, uint32_t P1,
                              uint32_t hasSink, float scale, uint32_t qdt, uint32_t kvdt, uint32_t socId, uint32_t forceHg,
                              uint32_t forceNb, uint32_t forceUb) {
    const SocInfo& soc = Soc(socId);
    MlaTiling t{};
    t.numTokens = T;
    t.numHeads = H;
    t.dimC = C;
    t.dimR = R;
    t.numIdx0 = L0;
    t.numIdx1 = L1;
    t.rows0 = P0;
    t.rows1 = P1;
    t.hasSink = hasSink;
    t.scale = scale;
    t.qDtype = qdt;
    t.kvDtype = kvdt;
    t.socUb = forceUb ? forceUb : soc.ubBytes;
    t.idxChunk = 64;
    uint32_t hg, nb;
    if (forceHg || forceNb) {
        hg = forceHg ? std::min(forceHg, H) : std::min<uint32_t>(H, 16);
        nb = forceNb ? forceNb : 16;
    } else {
        // head group: the largest of 16, 8, 4, 2, 1 heads that still gives every core a work item (a larger group
        // reads each gathered row once for more heads); then the most rows per block (64 .. 8) that fit the UB.
        static const uint32_t groups[] = {16, 8, 4, 2, 1};
        static const uint32_t blocks[] = {64, 32, 16, 8};
        hg = 1;
        for (uint32_t g : groups) {
            if (g <= H && static_cast<uint64_t>(T) * HostCeilDiv(H, g) >= soc.vectorCores) {
                hg = g;
                break;
            }
        }
        nb = 0;
        for (;;) {
            for (uint32_t b : blocks) {
                if (MlaUbBytes(hg, b, C, R, t.idxChunk, qdt, kvdt) <= t.socUb) {
                    nb = b;
                    break;
                }
            }
            if (nb || hg == 1) break;
            hg /= 2;
        }
        if (!nb) nb = 8;  // does not fit even so: the kernel's InitBuffer reports the overflow
    }
    t.headGroup = hg;
    t.blockRows = nb;
    t.numGroups = HostCeilDiv(H, hg);
    t.numItems = T * t.numGroups;
    t.blockDim = std::max<uint32_t>(1, std::min(soc.vectorCores, t.numItems));
    t.ubBytes = MlaUbBytes(hg, nb, C, R, t.idxChunk, qdt, kvdt);
    return t;
}

// ---- mla decode, cube variant (mla_decode_cube.cpp) --------------------------------------------------------------
// Cube input dtype: the shared dtype of q and the pools, float32 when they differ.
inline uint32_t CubeDType(uint32_t qdt, uint32_t kvdt) { return qdt == kvdt ? qdt : DT_FLOAT32; }

inline uint32_t MlaCubeUbBytes(uint32_t hg, uint32_t nb, uint32_t C, uint32_t R, uint32_t idxChunk, uint32_t qdt, uint32_t kvdt) {
    const uint32_t ct = CubeDType(qdt, kvdt), szc = DTypeSize(ct), hgp = HostAlignUp(hg, 16), hg8 = HostAlignUp(hg, 8);
    uint32_t total = hgp * (C + R) * szc;                                      // q as the cube's A (nope | rope)
    if (qdt != ct || qdt != DT_FLOAT32) total += hg * (C + R) * DTypeSize(qdt);  // q load / output staging
    total += 2 * nb * (C + R) * DTypeSize(kvdt);                               // gathered rows, double-buffered
    if (kvdt != ct) total += nb * (C + R) * szc;                               // rows in the cube dtype
    total += 2 * hgp * nb * 4;                                                 // scores (nope, rope)
    if (ct != DT_FLOAT32) total += hgp * nb * szc;                             // probabilities in the cube dtype
    total += hgp * C * 4;                                                      // P . V of the block
    total += hg * C * 4;                                                       // accumulators
    total += 5 * hg8 * 4;                                                      // max, new max, rescale, block max, sum
    total += 2 * hg * 8 * 4 + ReduceWork(nb) * 4;                              // reduction slots + work
    total += HostAlignUp(idxChunk * 8, 32);                                    // index chunk
    return total;
}

// Whether the cube variant can run these shapes (whole 16-element fractals for the channel dims).
inline bool MlaCubeSupported(uint32_t C, uint32_t R) { return C % 16 == 0 && R % 16 == 0 && C > 0; }

// Same fields as MlaTilingFor; head groups of 64 / 32 / 16 heads (the cube's M is padded to 16), rows per block
// 128 .. 16 (the cube's N of QK^T and K of PV).
inline MlaTiling MlaCubeTilingFor(uint32_t T, uint32_t H, uint32_t C, uint32_t R, uint32_t L0, uint32_t L1, uint32_t P0,
                                  uint32_t P1, uint32_t hasSink, float scale, uint32_t qdt, uint32_t kvdt, uint32_t socId,
                                  uint32_t forceHg, uint32_t forceNb, uint32_t forceUb) {
    if (!MlaCubeSupported(C, R))
        throw std::invalid_argument("mla cube kernel: C and R must be multiples of 16, got " + std::to_string(C) + ", " +
                                    std::to_string(R));
    MlaTiling t = MlaTilingFor(T, H, C, R, L0, L1, P0, P1, hasSink, scale, qdt, kvdt, socId, 1, 16, forceUb);
    const SocInfo& soc = Soc(socId);
    uint32_t hg = std::min<uint32_t>(H, 16), nb = 0;
    if (forceHg || forceNb) {
        hg = forceHg ? std::min(forceHg, H) : hg;
        nb = forceNb ? HostAlignUp(forceNb, 16) : 16;
    } else {
        static const uint32_t groups[] = {64, 32, 16};
        static const uint32_t blocks[] = {128, 64, 32, 16};
        for (uint32_t g : groups) {
            if (g <= H && static_cast<uint64_t>(T) * HostCeilDiv(H, g) >= soc.vectorCores) {
                hg = g;
                break;
            }
        }
        for (;;) {
            for (uint32_t b : blocks) {
                if (MlaCubeUbBytes(hg, b, C, R, t.idxChunk, qdt, kvdt) <= t.socUb) {
                    nb = b;
                    break;
                }
            }
            if (nb || hg <= 8) break;
            hg /= 2;
        }
        if (!nb) nb = 16;
    }
    t.headGroup = hg;
    t.blockRows = nb;
    t.numGroups = HostCeilDiv(H, hg);
    t.numItems = T * t.numGroups;
    t.blockDim = std::max<uint32_t>(1, std::min(soc.vectorCores, t.numItems));
    t.ubBytes = MlaCubeUbBytes(hg, nb, C, R, t.idxChunk, qdt, kvdt);
    return t;
}

// The three cube GEMMs of a block (emulation host: shapes only; the CANN binding fills CANN's TCubeTiling with
// matmul_tiling::MatmulApiTiling instead): QK^T nope [hgp, nb, C], QK^T rope [hgp, nb, R], PV [hgp, C, nb].
struct CubeShapes {
    uint32_t m, n, k;
};
inline void MlaCubeGemms(const MlaTiling& t, CubeShapes out[3]) {
    const uint32_t hgp = HostAlignUp(t.headGroup, 16);
    out[0] = {hgp, t.blockRows, t.dimC};
    out[1] = {hgp, t.blockRows, t.dimR ? t.dimR : 16};
    out[2] = {hgp, t.dimC, t.blockRows};
}

}  // namespace dsv4
