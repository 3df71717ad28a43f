// DeepSeek-V4 KV compressor pooling (the contract of atb_ops.compressor_pool), AscendC vector kernel.
//
// entry[m, ch] = sum_k softmax_k(z[cand[m,k], col(k) + ch]) * a[cand[m,k], col(k) + ch] over the present candidates
// (cand = -1: absent), col(k) = c for k >= r with overlap (the B half of the current block), else 0. Float32 math.
// An entry whose candidates are all absent is 0 (the model never produces one; the reference gives NaN there).
//
// Work split: item = (entry m, channel tile) over the vector cores (GetBlockIdx strided). Per item the candidate
// rows stream through double-buffered input queues while an online softmax runs per channel:
//   first candidate: max = z, sum = 1, acc = a
//   next:            new = Max(max, z); f = Exp(max - new); sum = sum*f + Exp(z - new); acc = acc*f + Exp(z - new)*a
// then entry = acc / sum.
//
// Optional fused epilogue (tiling.epilogue; the whole entry is one tile): y = w * x * rsqrt(mean(x^2) + eps), then
// the interleaved RoPE of the last R channels with the entry's cos / sin ([M, R/2] from the host):
//   y[2i] = x[2i] cos_i - x[2i+1] sin_i,  y[2i+1] = x[2i+1] cos_i + x[2i] sin_i
// done as y = x * cosI + swap(x) * sinI with cosI = (c0, c0, c1, c1, ..), sinI = (-s0, s0, -s1, s1, ..) built by Gather.
#include "kernel_common.h"

using namespace AscendC;

namespace dsv4 {

template <typename T>
class CompressorKernel {
public:
    __aicore__ inline void Init(GM_ADDR kv, GM_ADDR score, GM_ADDR cand, GM_ADDR out, GM_ADDR normWeight, GM_ADDR cosGm,
                                GM_ADDR sinGm, const CompressorTiling& t, TPipe* pipe) {
        t_ = t;
        const uint64_t rowsElems = static_cast<uint64_t>(t.numRows) * t.width;
        kvGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(kv), rowsElems);
        scoreGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(score), rowsElems);
        candGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t*>(cand), static_cast<uint64_t>(t.numEntries) * t.numCand);
        outGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(out), static_cast<uint64_t>(t.numEntries) * t.c);
        const uint32_t inBytes = AlignUp(t.cTile, BlockElems<T>()) * sizeof(T);
        const uint32_t fBytes = AlignUp(t.cTile, 8) * sizeof(float);
        pipe->InitBuffer(zQue_, 2, inBytes);
        pipe->InitBuffer(aQue_, 2, inBytes);
        pipe->InitBuffer(idxBuf_, AlignUp(t.numCand * 8, 32));
        pipe->InitBuffer(maxBuf_, fBytes);
        pipe->InitBuffer(newBuf_, fBytes);
        pipe->InitBuffer(sumBuf_, fBytes);
        pipe->InitBuffer(accBuf_, fBytes);
        if constexpr (!std::is_same<T, float>::value) {
            pipe->InitBuffer(zfBuf_, fBytes);
            pipe->InitBuffer(afBuf_, fBytes);
        }
        pipe->InitBuffer(outQue_, 2, fBytes);
        if (t.epilogue) InitEpilogue(normWeight, cosGm, sinGm, fBytes, pipe);
    }

    __aicore__ inline void Process() {
        for (uint32_t item = GetBlockIdx(); item < t_.numItems; item += GetBlockNum()) {
            const uint32_t m = item / t_.nCTiles;
            const uint32_t c0 = (item % t_.nCTiles) * t_.cTile;
            const uint32_t cw = (t_.c - c0 < t_.cTile) ? t_.c - c0 : t_.cTile;
            PoolEntry(m, c0, cw);
        }
    }

private:
    __aicore__ inline void PoolEntry(uint32_t m, uint32_t c0, uint32_t cw) {
        LocalTensor<int64_t> idx = idxBuf_.Get<int64_t>();
        CopyInRow(idx, candGm_[static_cast<uint64_t>(m) * t_.numCand], t_.numCand, static_cast<int64_t>(-1));
        SetFlag<HardEvent::MTE2_S>(EVENT_ID0);
        WaitFlag<HardEvent::MTE2_S>(EVENT_ID0);
        LocalTensor<float> mx = maxBuf_.Get<float>(), mn = newBuf_.Get<float>();
        LocalTensor<float> sum = sumBuf_.Get<float>(), acc = accBuf_.Get<float>();
        bool first = true;
        for (uint32_t k = 0; k < t_.numCand; ++k) {
            const int64_t row = idx.GetValue(k);
            if (row < 0) continue;
            const uint32_t col = (t_.overlap && k >= t_.half) ? t_.c : 0;
            const uint64_t off = static_cast<uint64_t>(row) * t_.width + col + c0;
            CopyIn(off, cw);
            Accumulate(cw, first, mx, mn, sum, acc);
            first = false;
        }
        LocalTensor<float> res = outQue_.AllocTensor<float>();
        if (first) {
            Duplicate(res, 0.0f, cw);
        } else {
            Div(res, acc, sum, cw);
        }
        if (t_.epilogue) NormRope(res, m);
        outQue_.EnQue(res);
        res = outQue_.DeQue<float>();
        CopyOutRow(outGm_[static_cast<uint64_t>(m) * t_.c + c0], res, cw);
        outQue_.FreeTensor(res);
    }

    __aicore__ inline void InitEpilogue(GM_ADDR normWeight, GM_ADDR cosGm, GM_ADDR sinGm, uint32_t fBytes, TPipe* pipe) {
        const uint32_t R = t_.ropeDim, rB = AlignUp(R, 8) * 4, hB = AlignUp(R / 2, 8) * 4;
        wGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(normWeight), t_.c);
        cosGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(cosGm), static_cast<uint64_t>(t_.numEntries) * (R / 2));
        sinGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(sinGm), static_cast<uint64_t>(t_.numEntries) * (R / 2));
        pipe->InitBuffer(wBuf_, fBytes);
        pipe->InitBuffer(sqBuf_, fBytes);
        pipe->InitBuffer(normRedBuf_, 8 * 4 + AlignUp(CeilDiv(t_.c, 64), 8) * 4);
        CopyInRow(wBuf_.Get<float>(), wGm_, t_.c, 0.0f);
        SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
        WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
        if (R == 0) return;
        pipe->InitBuffer(csBuf_, 2 * hB);
        pipe->InitBuffer(ropeBuf_, 5 * rB);
        pipe->InitBuffer(offBuf_, 2 * rB);
        // gather byte offsets: dup (0, 0, 4, 4, ..) and swap (4, 0, 12, 8, ..); sign (-1, 1, -1, 1, ..)
        LocalTensor<uint32_t> off = offBuf_.Get<uint32_t>();
        LocalTensor<float> rope = ropeBuf_.Get<float>();
        const uint32_t rp = AlignUp(R, 8);
        for (uint32_t i = 0; i < R; ++i) {
            off.SetValue(i, (i / 2) * 4);
            off.SetValue(rp + i, (i ^ 1u) * 4);
            rope.SetValue(4 * rp + i, (i % 2) ? 1.0f : -1.0f);
        }
        SetFlag<HardEvent::S_V>(EVENT_ID0);
        WaitFlag<HardEvent::S_V>(EVENT_ID0);
    }

    // x: the pooled entry [c] (float32, in UB); m: its entry index (row of cos / sin)
    __aicore__ inline void NormRope(const LocalTensor<float>& x, uint32_t m) {
        const uint32_t c = t_.c, R = t_.ropeDim, rp = AlignUp(R, 8), hp = AlignUp(R / 2, 8);
        LocalTensor<float> sq = sqBuf_.Get<float>(), red = normRedBuf_.Get<float>();
        Mul(sq, x, x, c);
        ReduceSum(red, sq, red[8], c);
        Muls(red, red, 1.0f / static_cast<float>(c), 1);
        Adds(red, red, t_.eps, 1);
        Sqrt(red, red, 1);
        SetFlag<HardEvent::V_S>(EVENT_ID2);
        WaitFlag<HardEvent::V_S>(EVENT_ID2);
        const float inv = 1.0f / red.GetValue(0);
        Muls(x, x, inv, c);
        Mul(x, x, wBuf_.Get<float>(), c);
        if (R == 0) return;
        LocalTensor<float> cs = csBuf_.Get<float>(), rope = ropeBuf_.Get<float>();
        LocalTensor<uint32_t> off = offBuf_.Get<uint32_t>();
        CopyInRow(cs, cosGm_[static_cast<uint64_t>(m) * (R / 2)], R / 2, 0.0f);
        CopyInRow(cs[hp], sinGm_[static_cast<uint64_t>(m) * (R / 2)], R / 2, 0.0f);
        SetFlag<HardEvent::MTE2_V>(EVENT_ID1);
        WaitFlag<HardEvent::MTE2_V>(EVENT_ID1);
        LocalTensor<float> cosI = rope, sinI = rope[rp], xs = rope[2 * rp], prod = rope[3 * rp], sign = rope[4 * rp];
        LocalTensor<float> xr = x[c - R];
        Gather(cosI, cs, off, 0, R);
        Gather(sinI, cs[hp], off, 0, R);
        Mul(sinI, sinI, sign, R);
        Gather(xs, xr, off[rp], 0, R);
        Mul(prod, xs, sinI, R);
        Mul(xr, xr, cosI, R);
        Add(xr, xr, prod, R);
    }

    __aicore__ inline void CopyIn(uint64_t off, uint32_t cw) {
        LocalTensor<T> z = zQue_.AllocTensor<T>();
        LocalTensor<T> a = aQue_.AllocTensor<T>();
        CopyInRow(z, scoreGm_[off], cw, T(0.0f));
        CopyInRow(a, kvGm_[off], cw, T(0.0f));
        zQue_.EnQue(z);
        aQue_.EnQue(a);
    }

    __aicore__ inline void Accumulate(uint32_t cw, bool first, LocalTensor<float>& mx, LocalTensor<float>& mn,
                                      const LocalTensor<float>& sum, const LocalTensor<float>& acc) {
        LocalTensor<T> z = zQue_.DeQue<T>();
        LocalTensor<T> a = aQue_.DeQue<T>();
        LocalTensor<float> zf, af;
        if constexpr (std::is_same<T, float>::value) {
            zf = z;
            af = a;
        } else {
            zf = zfBuf_.Get<float>();
            af = afBuf_.Get<float>();
            Cast(zf, z, RoundMode::CAST_NONE, cw);
            Cast(af, a, RoundMode::CAST_NONE, cw);
        }
        if (first) {
            Adds(mx, zf, 0.0f, cw);
            Duplicate(sum, 1.0f, cw);
            Adds(acc, af, 0.0f, cw);
        } else {
            Max(mn, mx, zf, cw);     // new running max
            Sub(mx, mx, mn, cw);     // old max - new max
            Exp(mx, mx, cw);         // rescale factor of what was accumulated
            Mul(sum, sum, mx, cw);
            Mul(acc, acc, mx, cw);
            Sub(zf, zf, mn, cw);
            Exp(zf, zf, cw);         // weight of this candidate
            Add(sum, sum, zf, cw);
            Mul(zf, zf, af, cw);
            Add(acc, acc, zf, cw);
            LocalTensor<float> tmp = mx;  // the new max becomes the running max
            mx = mn;
            mn = tmp;
        }
        zQue_.FreeTensor(z);
        aQue_.FreeTensor(a);
    }

    CompressorTiling t_;
    GlobalTensor<T> kvGm_, scoreGm_;
    GlobalTensor<int64_t> candGm_;
    GlobalTensor<float> outGm_, wGm_, cosGm_, sinGm_;
    TQue<QuePosition::VECIN, 2> zQue_, aQue_;
    TQue<QuePosition::VECOUT, 2> outQue_;
    TBuf<TPosition::VECCALC> idxBuf_, maxBuf_, newBuf_, sumBuf_, accBuf_, zfBuf_, afBuf_;
    TBuf<TPosition::VECCALC> wBuf_, sqBuf_, normRedBuf_, csBuf_, ropeBuf_, offBuf_;
};

}  // namespace dsv4

// kv_state, score_state: [S, W] (float32 or bfloat16); cand: [M, K] int64; out: [M, c] float32. With the epilogue:
// norm_weight [c] float32, cos / sin [M, R/2] float32 (unused, may be null, without it).
extern "C" __global__ __aicore__ void dsv4_compressor(GM_ADDR kv, GM_ADDR score, GM_ADDR cand, GM_ADDR normWeight,
                                                      GM_ADDR cosGm, GM_ADDR sinGm, GM_ADDR out, GM_ADDR workspace,
                                                      GM_ADDR tiling) {
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
    (void)workspace;
    dsv4::CompressorTiling t;
    dsv4::LoadTiling(t, tiling);
    TPipe pipe;
    if (t.dtype == dsv4::DT_BFLOAT16) {
        dsv4::CompressorKernel<bfloat16_t> op;
        op.Init(kv, score, cand, out, normWeight, cosGm, sinGm, t, &pipe);
        op.Process();
    } else {
        dsv4::CompressorKernel<float> op;
        op.Init(kv, score, cand, out, normWeight, cosGm, sinGm, t, &pipe);
        op.Process();
    }
}
