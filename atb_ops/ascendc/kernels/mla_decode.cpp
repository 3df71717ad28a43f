// Decode attention over gathered latent / compressed KV rows with one softmax and an optional per-head sink: the
// contract of atb_ops.mla_decode (DeepSeek-V3 absorbed MLA: C = kv_lora_rank, R = qk_rope_head_dim, no sink) and of
// atb_ops.sparse_attention (DeepSeek-V4: C = head_dim, R = 0, window rows idx0 of pool0 plus compressed entries
// idx1 of pool1, sink). AscendC vector kernel, float32 accumulation.
//
//   s_j = scale * (q[t,h] . row_j[:C] + qpe[t,h] . row_j[C:C+R])      rows j = pool0[idx0[t,:]] then pool1[idx1[t,:]],
//   p_j = exp(s_j) / (sum_j exp(s_j) + [sink] exp(sink_h))              negative indices skipped (never read)
//   out[t,h] = sum_j p_j row_j[:C]                                      (0 when no row and no sink mass)
//
// Work split: item = (token t, head group of `headGroup` heads) over the vector cores. Per item the valid rows are
// gathered `blockRows` at a time into a double-buffered queue (so the next block's DMA overlaps this block's
// vector work on the NPU) and folded into an online softmax: running max M, running sum L and accumulator acc per
// head. The sink is the initial state (M = sink, L = 1, acc = 0): a key of value 0 in the same softmax.
#include "kernel_common.h"

using namespace AscendC;

namespace dsv4 {

template <typename TQ, typename TKV>
class MlaDecodeKernel {
public:
    __aicore__ inline void Init(GM_ADDR q, GM_ADDR qpe, GM_ADDR pool0, GM_ADDR idx0, GM_ADDR pool1, GM_ADDR idx1,
                                GM_ADDR sink, GM_ADDR out, const MlaTiling& t, TPipe* pipe) {
        t_ = t;
        C_ = t.dimC;
        R_ = t.dimR;
        rowLen_ = C_ + R_;
        const uint64_t TH = static_cast<uint64_t>(t.numTokens) * t.numHeads;
        qGm_.SetGlobalBuffer(reinterpret_cast<__gm__ TQ*>(q), TH * C_);
        if (R_) qpeGm_.SetGlobalBuffer(reinterpret_cast<__gm__ TQ*>(qpe), TH * R_);
        pool0Gm_.SetGlobalBuffer(reinterpret_cast<__gm__ TKV*>(pool0), static_cast<uint64_t>(t.rows0) * rowLen_);
        idx0Gm_.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t*>(idx0), static_cast<uint64_t>(t.numTokens) * t.numIdx0);
        if (t.numIdx1) {
            pool1Gm_.SetGlobalBuffer(reinterpret_cast<__gm__ TKV*>(pool1), static_cast<uint64_t>(t.rows1) * rowLen_);
            idx1Gm_.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t*>(idx1), static_cast<uint64_t>(t.numTokens) * t.numIdx1);
        }
        if (t.hasSink) sinkGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(sink), t.numHeads);
        outGm_.SetGlobalBuffer(reinterpret_cast<__gm__ TQ*>(out), TH * C_);

        const uint32_t hg = t.headGroup, nb = t.blockRows;
        cf_ = AlignUp(C_, 8);
        rf_ = AlignUp(R_, 8);
        ck_ = AlignUp(C_, BlockElems<TKV>());
        rk_ = AlignUp(R_, BlockElems<TKV>());
        cq_ = AlignUp(C_, BlockElems<TQ>());
        rq_ = AlignUp(R_, BlockElems<TQ>());
        nbp_ = AlignUp(nb, 8);
        const uint32_t hgp = AlignUp(hg, 8);
        pipe->InitBuffer(qBuf_, hg * (cf_ + rf_) * 4);
        if constexpr (!std::is_same<TQ, float>::value) pipe->InitBuffer(stageBuf_, hg * (cq_ + rq_) * sizeof(TQ));
        pipe->InitBuffer(accBuf_, hg * cf_ * 4);
        pipe->InitBuffer(rowQue_, 2, nb * (ck_ + rk_) * sizeof(TKV));
        if constexpr (!std::is_same<TKV, float>::value) pipe->InitBuffer(rowFBuf_, nb * (cf_ + rf_) * 4);
        pipe->InitBuffer(scBuf_, hg * nbp_ * 4);
        pipe->InitBuffer(statBuf_, 5 * hgp * 4);
        pipe->InitBuffer(idxBuf_, AlignUp(t.idxChunk * 8, 32));
        const uint32_t prodElems = cf_ > rf_ ? cf_ : rf_;
        pipe->InitBuffer(prodBuf_, (prodElems > 8 ? prodElems : 8) * 4);
        const uint32_t widest = (C_ > R_ ? C_ : R_) > nb ? (C_ > R_ ? C_ : R_) : nb;
        // reduction results, one 32-byte slot each: per (head, row) the nope (and rope) dot products, per head the
        // block max and the block sum; then the ReduceSum/ReduceMax work area
        slotsPerHead_ = nb * (R_ ? 2 : 1);
        pipe->InitBuffer(redBuf_, (hg * slotsPerHead_ + 2 * hg) * 8 * 4 + AlignUp(CeilDiv(widest, 64), 8) * 4);
        LocalTensor<float> stat = statBuf_.Get<float>();
        M_ = stat;
        Mn_ = stat[hgp];
        Al_ = stat[2 * hgp];
        Bm_ = stat[3 * hgp];
        L_ = stat[4 * hgp];
        LocalTensor<float> red = redBuf_.Get<float>();
        dots_ = red;
        bmax_ = red[hg * slotsPerHead_ * 8];
        bsum_ = red[(hg * slotsPerHead_ + hg) * 8];
        work_ = red[(hg * slotsPerHead_ + 2 * hg) * 8];
    }

    __aicore__ inline void Process() {
        for (uint32_t item = GetBlockIdx(); item < t_.numItems; item += GetBlockNum()) {
            const uint32_t tok = item / t_.numGroups;
            const uint32_t h0 = (item % t_.numGroups) * t_.headGroup;
            const uint32_t hw = (t_.numHeads - h0 < t_.headGroup) ? t_.numHeads - h0 : t_.headGroup;
            Attend(tok, h0, hw);
        }
    }

private:
    // q rows of the group into qBuf (float): head h at h*(cf+rf), nope part then rope part.
    __aicore__ inline void LoadQ(uint32_t tok, uint32_t h0, uint32_t hw) {
        LocalTensor<float> qf = qBuf_.Get<float>();
        for (uint32_t h = 0; h < hw; ++h) {
            const uint64_t head = static_cast<uint64_t>(tok) * t_.numHeads + h0 + h;
            if constexpr (std::is_same<TQ, float>::value) {
                CopyInRow(qf[h * (cf_ + rf_)], qGm_[head * C_], C_, 0.0f);
                if (R_) CopyInRow(qf[h * (cf_ + rf_) + cf_], qpeGm_[head * R_], R_, 0.0f);
            } else {
                LocalTensor<TQ> st = stageBuf_.Get<TQ>();
                CopyInRow(st[h * (cq_ + rq_)], qGm_[head * C_], C_, TQ(0.0f));
                if (R_) CopyInRow(st[h * (cq_ + rq_) + cq_], qpeGm_[head * R_], R_, TQ(0.0f));
            }
        }
        SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
        WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
        if constexpr (!std::is_same<TQ, float>::value) {
            LocalTensor<TQ> st = stageBuf_.Get<TQ>();
            for (uint32_t h = 0; h < hw; ++h) {
                Cast(qf[h * (cf_ + rf_)], st[h * (cq_ + rq_)], RoundMode::CAST_NONE, C_);
                if (R_) Cast(qf[h * (cf_ + rf_) + cf_], st[h * (cq_ + rq_) + cq_], RoundMode::CAST_NONE, R_);
            }
        }
    }

    __aicore__ inline void InitState(uint32_t h0, uint32_t hw) {
        Duplicate(accBuf_.Get<float>(), 0.0f, hw * cf_);
        if (t_.hasSink) {
            for (uint32_t h = 0; h < hw; ++h) M_.SetValue(h, sinkGm_.GetValue(h0 + h));  // exp(sink - M) = 1
            Duplicate(L_, 1.0f, hw);
        } else {
            Duplicate(M_, -3.4028234663852886e38f, hw);  // lowest float: exp(M - anything finite) = 0
            Duplicate(L_, 0.0f, hw);
        }
    }

    __aicore__ inline void Attend(uint32_t tok, uint32_t h0, uint32_t hw) {
        LoadQ(tok, h0, hw);
        InitState(h0, hw);
        LocalTensor<TKV> rows = rowQue_.AllocTensor<TKV>();
        uint32_t n = 0;
        for (uint32_t set = 0; set < 2; ++set) {
            const uint32_t width = set ? t_.numIdx1 : t_.numIdx0;
            const GlobalTensor<int64_t>& idxGm = set ? idx1Gm_ : idx0Gm_;
            const GlobalTensor<TKV>& pool = set ? pool1Gm_ : pool0Gm_;
            for (uint32_t start = 0; start < width; start += t_.idxChunk) {
                const uint32_t cnt = (width - start < t_.idxChunk) ? width - start : t_.idxChunk;
                LocalTensor<int64_t> idx = idxBuf_.Get<int64_t>();
                CopyInRow(idx, idxGm[static_cast<uint64_t>(tok) * width + start], cnt, static_cast<int64_t>(-1));
                SetFlag<HardEvent::MTE2_S>(EVENT_ID1);
                WaitFlag<HardEvent::MTE2_S>(EVENT_ID1);
                for (uint32_t i = 0; i < cnt; ++i) {
                    const int64_t row = idx.GetValue(i);
                    if (row < 0) continue;
                    const uint64_t off = static_cast<uint64_t>(row) * rowLen_;
                    CopyInRow(rows[n * (ck_ + rk_)], pool[off], C_, TKV(0.0f));
                    if (R_) CopyInRow(rows[n * (ck_ + rk_) + ck_], pool[off + C_], R_, TKV(0.0f));
                    if (++n == t_.blockRows) {
                        rowQue_.EnQue(rows);
                        ComputeBlock(hw, n);
                        rows = rowQue_.AllocTensor<TKV>();
                        n = 0;
                    }
                }
            }
        }
        if (n) {
            rowQue_.EnQue(rows);
            ComputeBlock(hw, n);
        } else {
            rowQue_.FreeTensor(rows);
        }
        Finish(tok, h0, hw);
    }

    // Fold n gathered rows into the online softmax of the hw heads.
    __aicore__ inline void ComputeBlock(uint32_t hw, uint32_t n) {
        LocalTensor<TKV> rows = rowQue_.DeQue<TKV>();
        LocalTensor<float> rf;
        uint32_t rstride;
        if constexpr (std::is_same<TKV, float>::value) {
            rf = rows;
            rstride = ck_ + rk_;
        } else {
            rf = rowFBuf_.Get<float>();
            rstride = cf_ + rf_;
            for (uint32_t j = 0; j < n; ++j) {
                Cast(rf[j * rstride], rows[j * (ck_ + rk_)], RoundMode::CAST_NONE, C_);
                if (R_) Cast(rf[j * rstride + cf_], rows[j * (ck_ + rk_) + ck_], RoundMode::CAST_NONE, R_);
            }
        }
        const uint32_t roff = std::is_same<TKV, float>::value ? ck_ : cf_;  // rope part offset inside a row
        LocalTensor<float> qf = qBuf_.Get<float>(), sc = scBuf_.Get<float>(), prod = prodBuf_.Get<float>();
        LocalTensor<float> acc = accBuf_.Get<float>();
        // 1. every dot product of the block into its own slot: vector work only, no scalar round trip
        for (uint32_t h = 0; h < hw; ++h) {
            for (uint32_t j = 0; j < n; ++j) {
                const uint32_t slot = (h * slotsPerHead_ + j * (R_ ? 2 : 1)) * 8;
                Mul(prod, qf[h * (cf_ + rf_)], rf[j * rstride], C_);
                ReduceSum(dots_[slot], prod, work_, C_);
                if (R_) {
                    Mul(prod, qf[h * (cf_ + rf_) + cf_], rf[j * rstride + roff], R_);
                    ReduceSum(dots_[slot + 8], prod, work_, R_);
                }
            }
        }
        // 2. one vector->scalar hand-over for the whole block: scores = scale * (nope + rope)
        SetFlag<HardEvent::V_S>(EVENT_ID2);
        WaitFlag<HardEvent::V_S>(EVENT_ID2);
        for (uint32_t h = 0; h < hw; ++h) {
            for (uint32_t j = 0; j < n; ++j) {
                const uint32_t slot = (h * slotsPerHead_ + j * (R_ ? 2 : 1)) * 8;
                const float s = dots_.GetValue(slot) + (R_ ? dots_.GetValue(slot + 8) : 0.0f);
                sc.SetValue(h * nbp_ + j, s * t_.scale);
            }
        }
        SetFlag<HardEvent::S_V>(EVENT_ID3);
        WaitFlag<HardEvent::S_V>(EVENT_ID3);
        for (uint32_t h = 0; h < hw; ++h) ReduceMax(bmax_[h * 8], sc[h * nbp_], work_, n);
        SetFlag<HardEvent::V_S>(EVENT_ID2);
        WaitFlag<HardEvent::V_S>(EVENT_ID2);
        for (uint32_t h = 0; h < hw; ++h) Bm_.SetValue(h, bmax_.GetValue(h * 8));
        SetFlag<HardEvent::S_V>(EVENT_ID3);
        WaitFlag<HardEvent::S_V>(EVENT_ID3);
        // 3. online softmax update: Mn = max(M, block max); Al = exp(M - Mn); p = exp(s - Mn)
        Max(Mn_, M_, Bm_, hw);
        Sub(Al_, M_, Mn_, hw);
        Exp(Al_, Al_, hw);
        SetFlag<HardEvent::V_S>(EVENT_ID2);
        WaitFlag<HardEvent::V_S>(EVENT_ID2);
        for (uint32_t h = 0; h < hw; ++h) {
            LocalTensor<float> p = sc[h * nbp_];
            Adds(p, p, -Mn_.GetValue(h), n);
            Exp(p, p, n);
            ReduceSum(bsum_[h * 8], p, work_, n);
            Muls(acc[h * cf_], acc[h * cf_], Al_.GetValue(h), C_);
        }
        // 4. one more hand-over: L = L * Al + block sum; acc += p_j * row_j
        SetFlag<HardEvent::V_S>(EVENT_ID2);
        WaitFlag<HardEvent::V_S>(EVENT_ID2);
        for (uint32_t h = 0; h < hw; ++h) {
            L_.SetValue(h, L_.GetValue(h) * Al_.GetValue(h) + bsum_.GetValue(h * 8));
            LocalTensor<float> a = acc[h * cf_];
            for (uint32_t j = 0; j < n; ++j) Axpy(a, rf[j * rstride], sc.GetValue(h * nbp_ + j), C_);
        }
        SetFlag<HardEvent::S_V>(EVENT_ID3);
        WaitFlag<HardEvent::S_V>(EVENT_ID3);
        LocalTensor<float> tmp = M_;  // the new max becomes the running max
        M_ = Mn_;
        Mn_ = tmp;
        rowQue_.FreeTensor(rows);
    }

    __aicore__ inline void Finish(uint32_t tok, uint32_t h0, uint32_t hw) {
        LocalTensor<float> acc = accBuf_.Get<float>();
        for (uint32_t h = 0; h < hw; ++h) {
            SetFlag<HardEvent::V_S>(EVENT_ID2);
            WaitFlag<HardEvent::V_S>(EVENT_ID2);
            const float l = L_.GetValue(h);
            Muls(acc[h * cf_], acc[h * cf_], l > 0.0f ? 1.0f / l : 0.0f, C_);
        }
        SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
        WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
        for (uint32_t h = 0; h < hw; ++h) {
            const uint64_t head = static_cast<uint64_t>(tok) * t_.numHeads + h0 + h;
            if constexpr (std::is_same<TQ, float>::value) {
                CopyOutRow(outGm_[head * C_], acc[h * cf_], C_);
            } else {
                LocalTensor<TQ> st = stageBuf_.Get<TQ>();
                Cast(st[h * (cq_ + rq_)], acc[h * cf_], RoundMode::CAST_RINT, C_);
                SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
                WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
                CopyOutRow(outGm_[head * C_], st[h * (cq_ + rq_)], C_);
            }
        }
        // the next item reloads q / stage: wait for the stores to leave UB
        SetFlag<HardEvent::MTE3_MTE2>(EVENT_ID0);
        WaitFlag<HardEvent::MTE3_MTE2>(EVENT_ID0);
    }

    MlaTiling t_;
    uint32_t C_, R_, rowLen_, cf_, rf_, ck_, rk_, cq_, rq_, nbp_, slotsPerHead_;
    GlobalTensor<TQ> qGm_, qpeGm_, outGm_;
    GlobalTensor<TKV> pool0Gm_, pool1Gm_;
    GlobalTensor<int64_t> idx0Gm_, idx1Gm_;
    GlobalTensor<float> sinkGm_;
    TQue<QuePosition::VECIN, 2> rowQue_;
    TBuf<TPosition::VECCALC> qBuf_, stageBuf_, accBuf_, rowFBuf_, scBuf_, statBuf_, idxBuf_, prodBuf_, redBuf_;
    LocalTensor<float> M_, Mn_, Al_, Bm_, L_, dots_, bmax_, bsum_, work_;
};

template <typename TQ, typename TKV>
__aicore__ inline void RunMla(GM_ADDR q, GM_ADDR qpe, GM_ADDR pool0, GM_ADDR idx0, GM_ADDR pool1, GM_ADDR idx1, GM_ADDR sink,
                              GM_ADDR out, const MlaTiling& t) {
    TPipe pipe;
    MlaDecodeKernel<TQ, TKV> op;
    op.Init(q, qpe, pool0, idx0, pool1, idx1, sink, out, t, &pipe);
    op.Process();
}

}  // namespace dsv4

// q: [T, H, C]; qpe: [T, H, R] (unused when R = 0); pool0: [P0, C + R]; idx0: [T, L0] int64; pool1 / idx1: the second
// row set (unused when L1 = 0); sink: [H] float32 (unused without sink); out: [T, H, C] in q's dtype.
extern "C" __global__ __aicore__ void dsv4_mla_decode(GM_ADDR q, GM_ADDR qpe, GM_ADDR pool0, GM_ADDR idx0, GM_ADDR pool1,
                                                      GM_ADDR idx1, GM_ADDR sink, GM_ADDR out, GM_ADDR workspace,
                                                      GM_ADDR tiling) {
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
    (void)workspace;
    dsv4::MlaTiling t;
    dsv4::LoadTiling(t, tiling);
    const bool qbf = t.qDtype == dsv4::DT_BFLOAT16, kvbf = t.kvDtype == dsv4::DT_BFLOAT16;
    if (qbf && kvbf) {
        dsv4::RunMla<bfloat16_t, bfloat16_t>(q, qpe, pool0, idx0, pool1, idx1, sink, out, t);
    } else if (qbf) {
        dsv4::RunMla<bfloat16_t, float>(q, qpe, pool0, idx0, pool1, idx1, sink, out, t);
    } else if (kvbf) {
        dsv4::RunMla<float, bfloat16_t>(q, qpe, pool0, idx0, pool1, idx1, sink, out, t);
    } else {
        dsv4::RunMla<float, float>(q, qpe, pool0, idx0, pool1, idx1, sink, out, t);
    }
}
