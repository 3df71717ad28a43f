// Host emulation of the AscendC vector instructions the kernels use (the "first count elements" forms), part of
// kernel_operator_emu.h (see there for what is checked). Written from the public AscendC API reference.
#pragma once

#include "kernel_operator_emu.h"

namespace AscendC {

// ---- vector ops (the "first count elements" forms) ---------------------------------------------------------------
template <typename T>
inline void Duplicate(const LocalTensor<T>& dst, const T& scalar, int32_t count) {
    CheckOperand(dst, count, "Duplicate");
    for (int32_t i = 0; i < count; ++i) dst.Ptr()[i] = scalar;
}

#define ASC_EMU_BINARY(NAME, EXPR)                                                                        \
    template <typename T>                                                                                 \
    inline void NAME(const LocalTensor<T>& dst, const LocalTensor<T>& a, const LocalTensor<T>& b,         \
                     const int32_t& count) {                                                              \
        CheckOperand(dst, count, #NAME);                                                                  \
        CheckOperand(a, count, #NAME);                                                                    \
        CheckOperand(b, count, #NAME);                                                                    \
        for (int32_t i = 0; i < count; ++i) {                                                             \
            const T x = a.Ptr()[i], y = b.Ptr()[i];                                                       \
            dst.Ptr()[i] = (EXPR);                                                                        \
        }                                                                                                 \
    }
ASC_EMU_BINARY(Add, x + y)
ASC_EMU_BINARY(Sub, x - y)
ASC_EMU_BINARY(Mul, x * y)
ASC_EMU_BINARY(Div, x / y)
ASC_EMU_BINARY(Max, (x > y ? x : y))
#undef ASC_EMU_BINARY

template <typename T>
inline void Adds(const LocalTensor<T>& dst, const LocalTensor<T>& src, const T& scalar, const int32_t& count) {
    CheckOperand(dst, count, "Adds");
    CheckOperand(src, count, "Adds");
    for (int32_t i = 0; i < count; ++i) dst.Ptr()[i] = src.Ptr()[i] + scalar;
}

template <typename T>
inline void Muls(const LocalTensor<T>& dst, const LocalTensor<T>& src, const T& scalar, const int32_t& count) {
    CheckOperand(dst, count, "Muls");
    CheckOperand(src, count, "Muls");
    for (int32_t i = 0; i < count; ++i) dst.Ptr()[i] = src.Ptr()[i] * scalar;
}

template <typename T>
inline void Exp(const LocalTensor<T>& dst, const LocalTensor<T>& src, const int32_t& count) {
    CheckOperand(dst, count, "Exp");
    CheckOperand(src, count, "Exp");
    for (int32_t i = 0; i < count; ++i) dst.Ptr()[i] = std::exp(src.Ptr()[i]);
}

template <typename T>
inline void Sqrt(const LocalTensor<T>& dst, const LocalTensor<T>& src, const int32_t& count) {
    CheckOperand(dst, count, "Sqrt");
    CheckOperand(src, count, "Sqrt");
    for (int32_t i = 0; i < count; ++i) dst.Ptr()[i] = std::sqrt(src.Ptr()[i]);
}

// dst[i] = src[(srcBaseAddr + srcOffset[i]) / sizeof(T)]: byte offsets, each a whole element, inside src
template <typename T>
inline void Gather(const LocalTensor<T>& dst, const LocalTensor<T>& src, const LocalTensor<uint32_t>& srcOffset,
                   const uint32_t srcBaseAddr, const uint32_t count) {
    CheckOperand(dst, count, "Gather");
    CheckOperand(srcOffset, count, "Gather offsets");
    CheckOperand(src, 0, "Gather source");
    for (uint32_t i = 0; i < count; ++i) {
        const uint32_t byte = srcBaseAddr + srcOffset.Ptr()[i];
        ASC_EMU_CHECK(byte % sizeof(T) == 0, "Gather: byte offset " + std::to_string(byte) + " is not a whole element");
        ASC_EMU_CHECK(byte / sizeof(T) < src.GetSize(), "Gather: offset " + std::to_string(byte) + " beyond the source");
        dst.Ptr()[i] = src.Ptr()[byte / sizeof(T)];
    }
}

// dst = scalar * src + dst
template <typename T, typename U>
inline void Axpy(const LocalTensor<T>& dst, const LocalTensor<U>& src, const U& scalar, const int32_t& count) {
    CheckOperand(dst, count, "Axpy");
    CheckOperand(src, count, "Axpy");
    for (int32_t i = 0; i < count; ++i) dst.Ptr()[i] = scalar * src.Ptr()[i] + dst.Ptr()[i];
}

template <typename D, typename S>
inline void Cast(const LocalTensor<D>& dst, const LocalTensor<S>& src, const RoundMode& mode, const uint32_t& count) {
    CheckOperand(dst, count, "Cast");
    CheckOperand(src, count, "Cast");
    if constexpr (std::is_same<D, float>::value) {
        ASC_EMU_CHECK(mode == RoundMode::CAST_NONE, "Cast to float takes RoundMode::CAST_NONE");
    } else {
        ASC_EMU_CHECK(mode == RoundMode::CAST_RINT, "Cast from float to a narrower type: this kernel set uses CAST_RINT");
    }
    for (uint32_t i = 0; i < count; ++i) dst.Ptr()[i] = FromFloat<D>(ToFloat(src.Ptr()[i]));
}

// Work-buffer elements the count form of ReduceMax/ReduceSum needs for float: one partial per 256-byte repeat,
// rounded up to a 32-byte block (the API reference's sizing rule for the first pass).
inline uint32_t ReduceWorkElems(uint32_t count) {
    const uint32_t perRepeat = 256 / sizeof(float);
    const uint32_t partials = (count + perRepeat - 1) / perRepeat;
    return (partials + 7) / 8 * 8;
}

// Tree order: partials over 64-element repeats, then the partials (as the hardware's repeat-wise reduction).
template <typename T>
inline void ReduceSum(const LocalTensor<T>& dst, const LocalTensor<T>& src, const LocalTensor<T>& work, const int32_t count) {
    static_assert(std::is_same<T, float>::value, "emulated ReduceSum: float only");
    CheckOperand(dst, 1, "ReduceSum");
    CheckOperand(src, count, "ReduceSum");
    CheckOperand(work, ReduceWorkElems(count), "ReduceSum work");
    float total = 0.0f;
    for (int32_t r = 0; r < count; r += 64) {
        float part = 0.0f;
        for (int32_t i = r; i < std::min<int32_t>(count, r + 64); ++i) part += src.Ptr()[i];
        work.Ptr()[r / 64] = part;
        total += part;
    }
    dst.Ptr()[0] = total;
}

template <typename T>
inline void ReduceMax(const LocalTensor<T>& dst, const LocalTensor<T>& src, const LocalTensor<T>& work, const int32_t count,
                      bool calIndex = false) {
    static_assert(std::is_same<T, float>::value, "emulated ReduceMax: float only");
    ASC_EMU_CHECK(!calIndex, "ReduceMax: calIndex is not emulated");
    ASC_EMU_CHECK(count >= 1, "ReduceMax of zero elements");
    CheckOperand(dst, 1, "ReduceMax");
    CheckOperand(src, count, "ReduceMax");
    CheckOperand(work, ReduceWorkElems(count), "ReduceMax work");
    float m = src.Ptr()[0];
    for (int32_t i = 1; i < count; ++i) m = src.Ptr()[i] > m ? src.Ptr()[i] : m;
    dst.Ptr()[0] = m;
}

}  // namespace AscendC
