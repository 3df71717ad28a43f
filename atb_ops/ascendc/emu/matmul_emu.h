// Host emulation of the AscendC high-level Matmul API subset the cube kernel uses (written from the public "Matmul"
// API reference: MatmulType, Matmul, REGIST_MATMUL_OBJ, SetTensorA/B, IterateAll, End). It computes a plain GEMM in
// float32 from the operands' values and checks what the kernel controls: operand positions (UB = VECCALC), ND
// layout, dtypes of A/B (equal), shapes in whole 16 x 16 fractals, and that every operand fits its LocalTensor.
// It cannot check the real L1/L0 staging, fractal conversions, the AIC/AIV message passing or the workspace.
#pragma once

#include "kernel_operator_emu.h"

enum class CubeFormat { ND, NZ };

// The host-computed cube tiling (CANN's TCubeTiling has many more fields; the kernel only hands it to the API).
struct TCubeTiling {
    int32_t usedCoreNum;
    int32_t M, N, Ka, Kb;
    int32_t singleCoreM, singleCoreN, singleCoreK;
    int32_t baseM, baseN, baseK;
};

namespace matmul {

template <AscendC::TPosition POSITION, CubeFormat FORMAT, typename TYPE, bool ISTRANS = false>
struct MatmulType {
    constexpr static AscendC::TPosition pos = POSITION;
    constexpr static CubeFormat format = FORMAT;
    using T = TYPE;
    constexpr static bool isTrans = ISTRANS;
};

template <class A_TYPE, class B_TYPE, class C_TYPE, class BIAS_TYPE = C_TYPE>
class Matmul {
    using TA = typename A_TYPE::T;
    using TB = typename B_TYPE::T;
    using TC = typename C_TYPE::T;
    static_assert(std::is_same<TA, TB>::value, "Matmul: A and B must have the same dtype");
    static_assert(std::is_same<TC, float>::value, "Matmul emulation: float32 C only");
    static_assert(A_TYPE::format == CubeFormat::ND && B_TYPE::format == CubeFormat::ND && C_TYPE::format == CubeFormat::ND,
                  "Matmul emulation: ND only");

public:
    void Init(const TCubeTiling* tiling, AscendC::TPipe* = nullptr) {
        t_ = *tiling;
        ASC_EMU_CHECK(t_.M > 0 && t_.N > 0 && t_.Ka > 0 && t_.Ka == t_.Kb, "Matmul: bad tiling shape");
        ASC_EMU_CHECK(t_.M % 16 == 0 && t_.N % 16 == 0 && t_.Ka % 16 == 0, "Matmul: M, N, K must be whole 16-element fractals");
        inited_ = true;
    }
    void SetTensorA(const AscendC::LocalTensor<TA>& a, bool isTransposeA = false) {
        static_assert(A_TYPE::pos == AscendC::TPosition::VECCALC, "Matmul emulation: A in UB (VECCALC)");
        CheckOperand(a, static_cast<uint32_t>(t_.M * t_.Ka), "Matmul A");
        a_ = a;
        transA_ = isTransposeA;
    }
    void SetTensorB(const AscendC::LocalTensor<TB>& b, bool isTransposeB = false) {
        static_assert(B_TYPE::pos == AscendC::TPosition::VECCALC, "Matmul emulation: B in UB (VECCALC)");
        CheckOperand(b, static_cast<uint32_t>(t_.Kb * t_.N), "Matmul B");
        b_ = b;
        transB_ = isTransposeB;
    }
    // C[M, N] = A[M, K] . B[K, N] (enAtomic = 1: C += A . B); A^T / B^T layouts when set transposed
    template <bool sync = true>
    void IterateAll(const AscendC::LocalTensor<TC>& c, uint8_t enAtomic = 0) {
        ASC_EMU_CHECK(inited_, "Matmul: IterateAll before REGIST_MATMUL_OBJ / Init");
        ASC_EMU_CHECK(a_.Ptr() && b_.Ptr(), "Matmul: IterateAll before SetTensorA / SetTensorB");
        CheckOperand(c, static_cast<uint32_t>(t_.M * t_.N), "Matmul C");
        const int M = t_.M, N = t_.N, K = t_.Ka;
        for (int i = 0; i < M; ++i) {
            for (int j = 0; j < N; ++j) {
                float acc = enAtomic ? c.Ptr()[i * N + j] : 0.0f;
                for (int k = 0; k < K; ++k) {
                    const float x = AscendC::ToFloat(transA_ ? a_.Ptr()[k * M + i] : a_.Ptr()[i * K + k]);
                    const float y = AscendC::ToFloat(transB_ ? b_.Ptr()[j * K + k] : b_.Ptr()[k * N + j]);
                    acc += x * y;
                }
                c.Ptr()[i * N + j] = acc;
            }
        }
    }
    void End() {
        a_ = AscendC::LocalTensor<TA>();
        b_ = AscendC::LocalTensor<TB>();
    }

private:
    TCubeTiling t_{};
    bool inited_ = false, transA_ = false, transB_ = false;
    AscendC::LocalTensor<TA> a_;
    AscendC::LocalTensor<TB> b_;
};

}  // namespace matmul

inline GM_ADDR GetSysWorkSpacePtr() { return nullptr; }
inline void SetSysWorkspace(GM_ADDR) {}

template <class MM>
inline void RegistMatmulObjEmu(MM& mm, const TCubeTiling* t) { mm.Init(t); }
template <class MM, class... Rest>
inline void RegistMatmulObjEmu(MM& mm, const TCubeTiling* t, Rest&&... rest) {
    mm.Init(t);
    RegistMatmulObjEmu(rest...);
}
#define REGIST_MATMUL_OBJ(pipe, workspace, ...) RegistMatmulObjEmu(__VA_ARGS__)
