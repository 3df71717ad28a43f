// Host launcher of the AscendC kernels compiled against the emulation (ASCENDC_EMU): runs every block index of a
// launch one after another, as the NPU's vector cores would run them side by side, and turns an emulation check
// failure into an error code plus a message for Python (ctypes).
#define ASCENDC_EMU 1

#include <cstring>
#include <string>

#include "../kernels/compressor.cpp"
#include "../kernels/mla_decode.cpp"
#include "../kernels/mla_decode_cube.cpp"
#include "../kernels/tiling.h"
#include "selftest_emu.cpp"

namespace {
thread_local std::string g_error;
thread_local uint32_t g_ubPeak = 0;

template <typename F>
int RunBlocks(uint32_t blockDim, uint32_t ub, F&& body) {
    g_error.clear();
    AscendC::Core().ubCapacity = ub;
    AscendC::Core().ubPeak = 0;
    AscendC::Core().blockNum = blockDim;
    try {
        for (uint32_t b = 0; b < blockDim; ++b) {
            AscendC::Core().blockIdx = b;
            body();
        }
    } catch (const std::exception& e) {
        g_error = e.what();
        return 1;
    }
    g_ubPeak = AscendC::Core().ubPeak;
    return 0;
}
}  // namespace

extern "C" {

const char* dsv4_emu_last_error() { return g_error.c_str(); }
uint32_t dsv4_emu_last_ub_peak() { return g_ubPeak; }
uint32_t dsv4_emu_tiling_sizes(uint32_t which) {
    return which == 0 ? sizeof(dsv4::CompressorTiling) : sizeof(dsv4::MlaTiling);
}

int dsv4_emu_compressor_tiling(uint32_t M, uint32_t K, uint32_t S, uint32_t W, uint32_t overlap, uint32_t dt, uint32_t soc,
                               uint32_t forceCTile, uint32_t forceUb, uint32_t epilogue, uint32_t ropeDim, float eps,
                               dsv4::CompressorTiling* out) {
    try {
        *out = dsv4::CompressorTilingFor(M, K, S, W, overlap, dt, soc, forceCTile, forceUb, epilogue, ropeDim, eps);
    } catch (const std::exception& e) {
        g_error = e.what();
        return 1;
    }
    return 0;
}

int dsv4_emu_mla_tiling(uint32_t T, uint32_t H, uint32_t C, uint32_t R, uint32_t L0, uint32_t L1, uint32_t P0, uint32_t P1,
                        uint32_t hasSink, float scale, uint32_t qdt, uint32_t kvdt, uint32_t soc, uint32_t forceHg,
                        uint32_t forceNb, uint32_t forceUb, dsv4::MlaTiling* out) {
    try {
        *out = dsv4::MlaTilingFor(T, H, C, R, L0, L1, P0, P1, hasSink, scale, qdt, kvdt, soc, forceHg, forceNb, forceUb);
    } catch (const std::exception& e) {
        g_error = e.what();
        return 1;
    }
    return 0;
}

// Runs one deliberately wrong API use (see selftest_emu.cpp); returns 1 with the emulation's message, 0 if it passed.
int dsv4_emu_selftest(int which) {
    return RunBlocks(1, 192 * 1024, [&] { dsv4_selftest::Run(which); });
}

int dsv4_emu_mla_cube_tiling(uint32_t T, uint32_t H, uint32_t C, uint32_t R, uint32_t L0, uint32_t L1, uint32_t P0, uint32_t P1,
                             uint32_t hasSink, float scale, uint32_t qdt, uint32_t kvdt, uint32_t soc, uint32_t forceHg,
                             uint32_t forceNb, uint32_t forceUb, dsv4::MlaTiling* out) {
    try {
        *out = dsv4::MlaCubeTilingFor(T, H, C, R, L0, L1, P0, P1, hasSink, scale, qdt, kvdt, soc, forceHg, forceNb, forceUb);
    } catch (const std::exception& e) {
        g_error = e.what();
        return 1;
    }
    return 0;
}

int dsv4_emu_compressor(uint8_t* kv, uint8_t* score, uint8_t* cand, uint8_t* normWeight, uint8_t* cosT, uint8_t* sinT,
                        uint8_t* out, const dsv4::CompressorTiling* t) {
    dsv4::CompressorTiling tiling = *t;
    return RunBlocks(t->blockDim, t->socUb, [&] {
        dsv4_compressor(kv, score, cand, normWeight, cosT, sinT, out, nullptr, reinterpret_cast<uint8_t*>(&tiling));
    });
}

int dsv4_emu_mla_decode(uint8_t* q, uint8_t* qpe, uint8_t* pool0, uint8_t* idx0, uint8_t* pool1, uint8_t* idx1, uint8_t* sink,
                        uint8_t* out, const dsv4::MlaTiling* t) {
    dsv4::MlaTiling tiling = *t;
    return RunBlocks(t->blockDim, t->socUb, [&] {
        dsv4_mla_decode(q, qpe, pool0, idx0, pool1, idx1, sink, out, nullptr, reinterpret_cast<uint8_t*>(&tiling));
    });
}

// The cube variant: the tiling buffer is the MlaTiling followed by the TCubeTiling of its three GEMMs.
int dsv4_emu_mla_decode_cube(uint8_t* q, uint8_t* qpe, uint8_t* pool0, uint8_t* idx0, uint8_t* pool1, uint8_t* idx1,
                             uint8_t* sink, uint8_t* out, const dsv4::MlaTiling* t) {
    struct {
        dsv4::MlaTiling base;
        TCubeTiling cube[3];
    } buf{};
    buf.base = *t;
    dsv4::CubeShapes g[3];
    dsv4::MlaCubeGemms(*t, g);
    for (int i = 0; i < 3; ++i) {
        const int32_t m = g[i].m, n = g[i].n, k = g[i].k;
        buf.cube[i] = TCubeTiling{1, m, n, k, k, m, n, k, 16, 16, 16};
    }
    static_assert(sizeof(buf) == sizeof(dsv4::MlaTiling) + 3 * sizeof(TCubeTiling), "tiling buffer must be packed");
    return RunBlocks(t->blockDim, t->socUb, [&] {
        dsv4_mla_decode_cube(q, qpe, pool0, idx0, pool1, idx1, sink, out, nullptr, reinterpret_cast<uint8_t*>(&buf));
    });
}

}  // extern "C"
