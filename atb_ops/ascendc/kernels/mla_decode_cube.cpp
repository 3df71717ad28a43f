// Cube variant of dsv4_mla_decode (same contract, see mla_decode.cpp): QK^T and PV of each gathered row block run on
// the cube through the high-level Matmul API, the online softmax on the vector unit. Requires C and R to be multiples
// of 16 (host tiling MlaCubeTilingFor). Per (token, head group) work item and row block of nb rows:
//   S  = Qn . Kn^T (+ Qr . Kr^T)            [hgp, nb] float32   (mm1, mm2; hgp = head group padded to 16)
//   M' = max(M, rowmax S); P = exp(scale S - M'); L = L exp(M - M') + rowsum P
//   acc = acc exp(M - M') + P . Kn           [hg, C]   float32   (mm3)
// Inputs of the cube are in the shared dtype of q and the pools (float32 when they differ); P is rounded to that
// dtype before PV (the reference keeps it in float32). Rows of a block beyond the valid ones and heads beyond the
// group are zero, so they add nothing. Host-emulated through emu/matmul_emu.h (a plain GEMM): not run on an NPU.
#define DSV4_NEEDS_MATMUL 1
#include "kernel_common.h"

using namespace AscendC;

namespace dsv4 {

template <typename TQ, typename TKV>
class MlaDecodeCubeKernel {
    using CT = typename std::conditional<std::is_same<TQ, TKV>::value, TKV, float>::type;
    using AType = matmul::MatmulType<TPosition::VECCALC, CubeFormat::ND, CT>;
    using BTType = matmul::MatmulType<TPosition::VECCALC, CubeFormat::ND, CT, true>;
    using CType = matmul::MatmulType<TPosition::VECCALC, CubeFormat::ND, float>;

public:
    matmul::Matmul<AType, BTType, CType> mmQK, mmQKr;
    matmul::Matmul<AType, BTType, CType> mmPV;

    __aicore__ inline void Init(GM_ADDR q, GM_ADDR qpe, GM_ADDR pool0, GM_ADDR idx0, GM_ADDR pool1, GM_ADDR idx1,
                                GM_ADDR sink, GM_ADDR out, const MlaTiling& t, TPipe* pipe) {
        t_ = t;
        C_ = t.dimC;
        R_ = t.dimR;
        hg_ = t.headGroup;
        hgp_ = AlignUp(hg_, 16);
        nb_ = t.blockRows;
        const uint64_t TH = static_cast<uint64_t>(t.numTokens) * t.numHeads;
        qGm_.SetGlobalBuffer(reinterpret_cast<__gm__ TQ*>(q), TH * C_);
        if (R_) qpeGm_.SetGlobalBuffer(reinterpret_cast<__gm__ TQ*>(qpe), TH * R_);
        pool0Gm_.SetGlobalBuffer(reinterpret_cast<__gm__ TKV*>(pool0), static_cast<uint64_t>(t.rows0) * (C_ + R_));
        idx0Gm_.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t*>(idx0), static_cast<uint64_t>(t.numTokens) * t.numIdx0);
        if (t.numIdx1) {
            pool1Gm_.SetGlobalBuffer(reinterpret_cast<__gm__ TKV*>(pool1), static_cast<uint64_t>(t.rows1) * (C_ + R_));
            idx1Gm_.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t*>(idx1), static_cast<uint64_t>(t.numTokens) * t.numIdx1);
        }
        if (t.hasSink) sinkGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(sink), t.numHeads);
        outGm_.SetGlobalBuffer(reinterpret_cast<__gm__ TQ*>(out), TH * C_);
        const uint32_t hg8 = AlignUp(hg_, 8);
        pipe->InitBuffer(qBuf_, hgp_ * (C_ + R_) * sizeof(CT));
        if constexpr (!std::is_same<TQ, CT>::value || !std::is_same<TQ, float>::value)
            pipe->InitBuffer(stageBuf_, hg_ * (C_ + R_) * sizeof(TQ));
        pipe->InitBuffer(rowQue_, 2, nb_ * (C_ + R_) * sizeof(TKV));
        if constexpr (!std::is_same<TKV, CT>::value) pipe->InitBuffer(rowCBuf_, nb_ * (C_ + R_) * sizeof(CT));
        pipe->InitBuffer(sBuf_, 2 * hgp_ * nb_ * 4);
        if constexpr (!std::is_same<CT, float>::value) pipe->InitBuffer(pBuf_, hgp_ * nb_ * sizeof(CT));
        pipe->InitBuffer(oBuf_, hgp_ * C_ * 4);
        pipe->InitBuffer(accBuf_, hg_ * C_ * 4);
        pipe->InitBuffer(statBuf_, 5 * hg8 * 4);
        pipe->InitBuffer(redBuf_, 2 * hg_ * 8 * 4 + AlignUp(CeilDiv(nb_, 64), 8) * 4);
        pipe->InitBuffer(idxBuf_, AlignUp(t.idxChunk * 8, 32));
        LocalTensor<float> stat = statBuf_.Get<float>();
        M_ = stat;
        Mn_ = stat[hg8];
        Al_ = stat[2 * hg8];
        Bm_ = stat[3 * hg8];
        L_ = stat[4 * hg8];
        LocalTensor<float> red = redBuf_.Get<float>();
        bmax_ = red;
        bsum_ = red[hg_ * 8];
        work_ = red[2 * hg_ * 8];
    }

    __aicore__ inline void Process() {
        // a MIX (1 cube : 2 vector) launch of N cores runs N * GetTaskRation() vector blocks (the emulation: ration 1)
        for (uint32_t item = GetBlockIdx(); item < t_.numItems; item += GetBlockNum() * GetTaskRation()) {
            const uint32_t tok = item / t_.numGroups;
            const uint32_t h0 = (item % t_.numGroups) * hg_;
            const uint32_t hw = (t_.numHeads - h0 < hg_) ? t_.numHeads - h0 : hg_;
            Attend(tok, h0, hw);
        }
        mmQK.End();
        mmQKr.End();
        mmPV.End();
    }

private:
    __aicore__ inline void LoadQ(uint32_t tok, uint32_t h0, uint32_t hw) {
        LocalTensor<CT> qc = qBuf_.Get<CT>();
        Duplicate(qc, CT(0.0f), hgp_ * (C_ + R_));  // heads beyond the group stay zero
        for (uint32_t h = 0; h < hw; ++h) {
            const uint64_t head = static_cast<uint64_t>(tok) * t_.numHeads + h0 + h;
            if constexpr (std::is_same<TQ, CT>::value) {
                CopyInRow(qc[h * C_], qGm_[head * C_], C_, TQ(0.0f));
                if (R_) CopyInRow(qc[hgp_ * C_ + h * R_], qpeGm_[head * R_], R_, TQ(0.0f));
            } else {
                LocalTensor<TQ> st = stageBuf_.Get<TQ>();
                CopyInRow(st[h * C_], qGm_[head * C_], C_, TQ(0.0f));
                if (R_) CopyInRow(st[hg_ * C_ + h * R_], qpeGm_[head * R_], R_, TQ(0.0f));
            }
        }
        SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
        WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
        if constexpr (!std::is_same<TQ, CT>::value) {
            LocalTensor<TQ> st = stageBuf_.Get<TQ>();
            Cast(qc, st, RoundMode::CAST_NONE, hw * C_);
            if (R_) Cast(qc[hgp_ * C_], st[hg_ * C_], RoundMode::CAST_NONE, hw * R_);
        }
    }

    __aicore__ inline void InitState(uint32_t h0, uint32_t hw) {
        Duplicate(accBuf_.Get<float>(), 0.0f, hw * C_);
        if (t_.hasSink) {
            for (uint32_t h = 0; h < hw; ++h) M_.SetValue(h, sinkGm_.GetValue(h0 + h));
            Duplicate(L_, 1.0f, hw);
        } else {
            Duplicate(M_, -3.4028234663852886e38f, hw);
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
                    const uint64_t off = static_cast<uint64_t>(row) * (C_ + R_);
                    CopyInRow(rows[n * C_], pool[off], C_, TKV(0.0f));
                    if (R_) CopyInRow(rows[nb_ * C_ + n * R_], pool[off + C_], R_, TKV(0.0f));
                    if (++n == nb_) {
                        rowQue_.EnQue(rows);
                        ComputeBlock(hw, n);
                        rows = rowQue_.AllocTensor<TKV>();
                        n = 0;
                    }
                }
            }
        }
        if (n) {
            Duplicate(rows[n * C_], TKV(0.0f), (nb_ - n) * C_);  // the block's missing rows add nothing
            if (R_) Duplicate(rows[nb_ * C_ + n * R_], TKV(0.0f), (nb_ - n) * R_);
            rowQue_.EnQue(rows);
            ComputeBlock(hw, n);
        } else {
            rowQue_.FreeTensor(rows);
        }
        Finish(tok, h0, hw);
    }

    __aicore__ inline void ComputeBlock(uint32_t hw, uint32_t n) {
        LocalTensor<TKV> rows = rowQue_.DeQue<TKV>();
        LocalTensor<CT> kc;
        if constexpr (std::is_same<TKV, CT>::value) {
            kc = rows;
        } else {
            kc = rowCBuf_.Get<CT>();
            Cast(kc, rows, RoundMode::CAST_NONE, nb_ * (C_ + R_));
        }
        LocalTensor<CT> qc = qBuf_.Get<CT>();
        LocalTensor<float> s = sBuf_.Get<float>(), s2 = s[hgp_ * nb_], o = oBuf_.Get<float>(), acc = accBuf_.Get<float>();
        // scores on the cube: S = Qn . Kn^T (+ Qr . Kr^T)
        mmQK.SetTensorA(qc);
        mmQK.SetTensorB(kc, true);
        mmQK.IterateAll(s);
        if (R_) {
            mmQKr.SetTensorA(qc[hgp_ * C_]);
            mmQKr.SetTensorB(kc[nb_ * C_], true);
            mmQKr.IterateAll(s2);
            Add(s, s, s2, hgp_ * nb_);
        }
        Muls(s, s, t_.scale, hgp_ * nb_);
        for (uint32_t h = 0; h < hw; ++h) ReduceMax(bmax_[h * 8], s[h * nb_], work_, n);
        SetFlag<HardEvent::V_S>(EVENT_ID2);
        WaitFlag<HardEvent::V_S>(EVENT_ID2);
        for (uint32_t h = 0; h < hw; ++h) Bm_.SetValue(h, bmax_.GetValue(h * 8));
        SetFlag<HardEvent::S_V>(EVENT_ID3);
        WaitFlag<HardEvent::S_V>(EVENT_ID3);
        Max(Mn_, M_, Bm_, hw);
        Sub(Al_, M_, Mn_, hw);
        Exp(Al_, Al_, hw);
        SetFlag<HardEvent::V_S>(EVENT_ID2);
        WaitFlag<HardEvent::V_S>(EVENT_ID2);
        for (uint32_t h = 0; h < hw; ++h) {
            LocalTensor<float> p = s[h * nb_];  // columns >= n stay 0 (zero rows), so P is 0 there
            Adds(p, p, -Mn_.GetValue(h), n);
            Exp(p, p, n);
            ReduceSum(bsum_[h * 8], p, work_, n);
            Muls(acc[h * C_], acc[h * C_], Al_.GetValue(h), C_);
        }
        // PV on the cube: O = P . Kn, then acc += O for the group's heads
        if constexpr (std::is_same<CT, float>::value) {
            mmPV.SetTensorA(s);
        } else {
            LocalTensor<CT> pc = pBuf_.Get<CT>();
            Cast(pc, s, RoundMode::CAST_RINT, hgp_ * nb_);
            mmPV.SetTensorA(pc);
        }
        mmPV.SetTensorB(kc, false);
        mmPV.IterateAll(o);
        Add(acc, acc, o, hw * C_);
        SetFlag<HardEvent::V_S>(EVENT_ID2);
        WaitFlag<HardEvent::V_S>(EVENT_ID2);
        for (uint32_t h = 0; h < hw; ++h) L_.SetValue(h, L_.GetValue(h) * Al_.GetValue(h) + bsum_.GetValue(h * 8));
        SetFlag<HardEvent::S_V>(EVENT_ID3);
        WaitFlag<HardEvent::S_V>(EVENT_ID3);
        LocalTensor<float> tmp = M_;
        M_ = Mn_;
        Mn_ = tmp;
        rowQue_.FreeTensor(rows);
    }

    __aicore__ inline void Finish(uint32_t tok, uint32_t h0, uint32_t hw) {
        LocalTensor<float> acc = accBuf_.Get<float>();
        SetFlag<HardEvent::V_S>(EVENT_ID2);
        WaitFlag<HardEvent::V_S>(EVENT_ID2);
        for (uint32_t h = 0; h < hw; ++h) {
            const float l = L_.GetValue(h);
            Muls(acc[h * C_], acc[h * C_], l > 0.0f ? 1.0f / l : 0.0f, C_);
        }
        const uint64_t head0 = static_cast<uint64_t>(tok) * t_.numHeads + h0;
        if constexpr (std::is_same<TQ, float>::value) {
            SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
            WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
            CopyOutRow(outGm_[head0 * C_], acc, hw * C_);  // the group's heads are contiguous in out
        } else {
            LocalTensor<TQ> st = stageBuf_.Get<TQ>();
            Cast(st, acc, RoundMode::CAST_RINT, hw * C_);
            SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
            WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
            CopyOutRow(outGm_[head0 * C_], st, hw * C_);
        }
        SetFlag<HardEvent::MTE3_MTE2>(EVENT_ID0);
        WaitFlag<HardEvent::MTE3_MTE2>(EVENT_ID0);
    }

    MlaTiling t_;
    uint32_t C_, R_, hg_, hgp_, nb_;
    GlobalTensor<TQ> qGm_, qpeGm_, outGm_;
    GlobalTensor<TKV> pool0Gm_, pool1Gm_;
    GlobalTensor<int64_t> idx0Gm_, idx1Gm_;
    GlobalTensor<float> sinkGm_;
    TQue<QuePosition::VECIN, 2> rowQue_;
    TBuf<TPosition::VECCALC> qBuf_, stageBuf_, rowCBuf_, sBuf_, pBuf_, oBuf_, accBuf_, statBuf_, redBuf_, idxBuf_;
    LocalTensor<float> M_, Mn_, Al_, Bm_, L_, bmax_, bsum_, work_;
};

template <typename TQ, typename TKV>
__aicore__ inline void RunMlaCube(GM_ADDR q, GM_ADDR qpe, GM_ADDR pool0, GM_ADDR idx0, GM_ADDR pool1, GM_ADDR idx1,
                                  GM_ADDR sink, GM_ADDR out, const MlaTiling& t, const TCubeTiling* cube) {
    TPipe pipe;
    MlaDecodeCubeKernel<TQ, TKV> op;
    REGIST_MATMUL_OBJ(&pipe, GetSysWorkSpacePtr(), op.mmQK, &cube[0], op.mmQKr, &cube[1], op.mmPV, &cube[2]);
    op.Init(q, qpe, pool0, idx0, pool1, idx1, sink, out, t, &pipe);
    op.Process();
}

}  // namespace dsv4

// Arguments as dsv4_mla_decode; tiling = MlaTiling followed by the three TCubeTiling of QK^T (nope), QK^T (rope), PV.
extern "C" __global__ __aicore__ void dsv4_mla_decode_cube(GM_ADDR q, GM_ADDR qpe, GM_ADDR pool0, GM_ADDR idx0,
                                                           GM_ADDR pool1, GM_ADDR idx1, GM_ADDR sink, GM_ADDR out,
                                                           GM_ADDR workspace, GM_ADDR tiling) {
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
    SetSysWorkspace(workspace);
    dsv4::MlaTiling t;
    dsv4::LoadTiling(t, tiling);
    TCubeTiling cube[3];
    for (uint32_t i = 0; i < 3; ++i) dsv4::LoadTiling(cube[i], tiling + sizeof(dsv4::MlaTiling) + i * sizeof(TCubeTiling));
    const bool qbf = t.qDtype == dsv4::DT_BFLOAT16, kvbf = t.kvDtype == dsv4::DT_BFLOAT16;
    if (qbf && kvbf) {
        dsv4::RunMlaCube<bfloat16_t, bfloat16_t>(q, qpe, pool0, idx0, pool1, idx1, sink, out, t, cube);
    } else if (qbf) {
        dsv4::RunMlaCube<bfloat16_t, float>(q, qpe, pool0, idx0, pool1, idx1, sink, out, t, cube);
    } else if (kvbf) {
        dsv4::RunMlaCube<float, bfloat16_t>(q, qpe, pool0, idx0, pool1, idx1, sink, out, t, cube);
    } else {
        dsv4::RunMlaCube<float, float>(q, qpe, pool0, idx0, pool1, idx1, sink, out, t, cube);
    }
}
