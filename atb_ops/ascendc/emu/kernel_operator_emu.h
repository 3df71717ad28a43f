// Host emulation of the subset of the AscendC kernel API that atb_ops/ascendc/kernels use.
//
// Written for this project from the public AscendC API documentation (hiascend.com "Ascend C API reference":
// GlobalTensor, LocalTensor, TPipe/TQue/TBuf, DataCopy, DataCopyPad, Duplicate, Add/Sub/Mul/Div/Max,
// Adds/Muls, Exp, Sqrt, Axpy, Gather, Cast, ReduceMax/ReduceSum, SetFlag/WaitFlag, PipeBarrier). It is NOT derived from
// CANN's headers and does not try to be complete: only what the kernels call exists, so a kernel that starts
// using another API fails to compile here until the emulation is extended deliberately.
//
// What it checks (each violation throws AscendC::EmuError, reported to Python as an exception):
//   - unified-buffer capacity: TPipe::InitBuffer sums every queue/buffer (each rounded up to 32 bytes) and
//     fails when the total exceeds the UB size of the emulated SoC;
//   - the 32-byte rules: every LocalTensor operand starts 32-byte aligned in UB; DataCopy moves a multiple of
//     32 bytes between 32-byte aligned GM addresses (anything else must use DataCopyPad; the GM address rule is
//     the conservative reading of the documentation);
//   - bounds: every GM and UB access lies inside its tensor;
//   - queue discipline: AllocTensor beyond the queue's buffer count, DeQue of an empty queue, FreeTensor of a
//     tensor that is not allocated;
//   - DataCopyPad without isPad leaves the padding bytes of a UB block as NaN, so a kernel that reads them fails.
// What it cannot check: pipeline synchronisation (every op completes immediately, flags are no-ops), hardware
// alignment faults beyond the rules above, the NPU's Exp/Div precision, speed. Cores run one after another.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#define __aicore__
#define __global__
#define __gm__
#define GM_ADDR uint8_t*
#define KERNEL_TASK_TYPE_DEFAULT(type) ((void)(type))

namespace AscendC {

struct EmuError : std::runtime_error {
    explicit EmuError(const std::string& m) : std::runtime_error(m) {}
};

#define ASC_EMU_CHECK(cond, msg)                                                       \
    do {                                                                               \
        if (!(cond)) throw ::AscendC::EmuError(std::string(__func__) + ": " + (msg)); \
    } while (0)

constexpr uint32_t ONE_BLK_SIZE = 32;  // bytes: the UB block and the DataCopy granule

// ---- data types -----------------------------------------------------------------------------------------------
struct bfloat16_t {
    uint16_t bits = 0;
    bfloat16_t() = default;
    explicit bfloat16_t(float f) {  // round to nearest even (NaN kept quiet)
        uint32_t u;
        std::memcpy(&u, &f, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            bits = static_cast<uint16_t>((u >> 16) | 0x40u);
        } else {
            u += 0x7fffu + ((u >> 16) & 1u);
            bits = static_cast<uint16_t>(u >> 16);
        }
    }
    explicit operator float() const {
        uint32_t u = static_cast<uint32_t>(bits) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
};

template <typename T> inline float ToFloat(T v) { return static_cast<float>(v); }
template <typename T> inline T FromFloat(float v) { return static_cast<T>(v); }
template <> inline bfloat16_t FromFloat<bfloat16_t>(float v) { return bfloat16_t(v); }

enum class TPosition { GM, VECIN, VECOUT, VECCALC };
using QuePosition = TPosition;
enum class RoundMode { CAST_NONE, CAST_RINT };
enum class HardEvent { MTE2_V, V_MTE3, MTE3_MTE2, MTE3_V, V_S, S_V, MTE2_S, S_MTE2, MTE3_S, S_MTE3 };
enum pipe_t { PIPE_S, PIPE_V, PIPE_MTE2, PIPE_MTE3, PIPE_ALL };
using event_t = int32_t;
constexpr event_t EVENT_ID0 = 0, EVENT_ID1 = 1, EVENT_ID2 = 2, EVENT_ID3 = 3;

enum KernelType { KERNEL_TYPE_AIV_ONLY, KERNEL_TYPE_AIC_ONLY, KERNEL_TYPE_MIX_AIC_1_2 };

template <HardEvent E> inline void SetFlag(event_t) {}
template <HardEvent E> inline void WaitFlag(event_t) {}
template <pipe_t P> inline void PipeBarrier() {}

// ---- the emulated core ----------------------------------------------------------------------------------------
struct EmuCore {
    int64_t blockIdx = 0;
    int64_t blockNum = 1;
    uint32_t ubCapacity = 192 * 1024;  // set per launch from the SoC table of the tiling
    uint32_t ubPeak = 0;               // largest InitBuffer total seen during the launch (reported to the host)
};
inline EmuCore& Core() {
    static thread_local EmuCore c;
    return c;
}
inline int64_t GetBlockIdx() { return Core().blockIdx; }
inline int64_t GetBlockNum() { return Core().blockNum; }
inline int64_t GetTaskRation() { return 1; }  // the emulation launches every vector block itself

inline uint32_t AlignUp32(uint32_t bytes) { return (bytes + ONE_BLK_SIZE - 1) / ONE_BLK_SIZE * ONE_BLK_SIZE; }

// ---- tensors --------------------------------------------------------------------------------------------------
template <typename T>
class GlobalTensor {
public:
    void SetGlobalBuffer(__gm__ T* buffer, uint64_t bufferSize) {
        base_ = buffer;
        size_ = bufferSize;
    }
    GlobalTensor operator[](uint64_t offset) const {
        ASC_EMU_CHECK(offset <= size_, "GM offset " + std::to_string(offset) + " beyond size " + std::to_string(size_));
        GlobalTensor g;
        g.base_ = base_ + offset;
        g.size_ = size_ - offset;
        return g;
    }
    T GetValue(uint64_t i) const {
        ASC_EMU_CHECK(i < size_, "GM read at " + std::to_string(i) + " beyond size " + std::to_string(size_));
        return base_[i];
    }
    void SetValue(uint64_t i, T v) {
        ASC_EMU_CHECK(i < size_, "GM write at " + std::to_string(i) + " beyond size " + std::to_string(size_));
        base_[i] = v;
    }
    T* GetPhyAddr() const { return base_; }
    uint64_t GetSize() const { return size_; }

private:
    T* base_ = nullptr;
    uint64_t size_ = 0;
};

template <typename T>
class LocalTensor {
public:
    LocalTensor() = default;
    LocalTensor(T* p, uint32_t n, uint32_t ubOffset, int bufId) : ptr_(p), size_(n), ubOffset_(ubOffset), bufId_(bufId) {}
    LocalTensor operator[](uint32_t offset) const {
        ASC_EMU_CHECK(offset <= size_, "UB offset " + std::to_string(offset) + " beyond size " + std::to_string(size_));
        return LocalTensor(ptr_ + offset, size_ - offset, ubOffset_ + offset * sizeof(T), bufId_);
    }
    T GetValue(uint32_t i) const {
        ASC_EMU_CHECK(i < size_, "UB read at " + std::to_string(i) + " beyond size " + std::to_string(size_));
        return ptr_[i];
    }
    void SetValue(uint32_t i, T v) const {
        ASC_EMU_CHECK(i < size_, "UB write at " + std::to_string(i) + " beyond size " + std::to_string(size_));
        ptr_[i] = v;
    }
    uint32_t GetSize() const { return size_; }
    template <typename U>
    LocalTensor<U> ReinterpretCast() const {
        return LocalTensor<U>(reinterpret_cast<U*>(ptr_), static_cast<uint32_t>(size_ * sizeof(T) / sizeof(U)), ubOffset_, bufId_);
    }
    // emulation internals
    T* Ptr() const { return ptr_; }
    uint32_t UbOffset() const { return ubOffset_; }
    int BufId() const { return bufId_; }

private:
    T* ptr_ = nullptr;
    uint32_t size_ = 0;
    uint32_t ubOffset_ = 0;
    int bufId_ = -1;
};

template <typename T>
inline void CheckOperand(const LocalTensor<T>& t, uint32_t count, const char* what) {
    ASC_EMU_CHECK(t.Ptr() != nullptr, std::string(what) + ": LocalTensor not allocated");
    ASC_EMU_CHECK(t.UbOffset() % ONE_BLK_SIZE == 0,
                  std::string(what) + ": UB address offset " + std::to_string(t.UbOffset()) + " is not 32-byte aligned");
    ASC_EMU_CHECK(count <= t.GetSize(), std::string(what) + ": count " + std::to_string(count) + " exceeds the tensor's " +
                                            std::to_string(t.GetSize()) + " elements");
}

// ---- TPipe / TQue / TBuf --------------------------------------------------------------------------------------
class TPipe;

struct EmuBuffer {
    uint32_t offset = 0;
    uint32_t len = 0;
    bool inUse = false;
};

template <TPosition POS, int32_t DEPTH>
class TQue {
public:
    template <typename T>
    LocalTensor<T> AllocTensor() {
        ASC_EMU_CHECK(ub_ != nullptr, "TQue used before TPipe::InitBuffer");
        for (size_t i = 0; i < bufs_.size(); ++i) {
            if (!bufs_[i].inUse) {
                bufs_[i].inUse = true;
                // fresh buffers hold garbage on the NPU: fill with NaN bytes so reads before writes show up
                std::memset(ub_ + bufs_[i].offset, 0xff, bufs_[i].len);
                return LocalTensor<T>(reinterpret_cast<T*>(ub_ + bufs_[i].offset), bufs_[i].len / sizeof(T),
                                      bufs_[i].offset, static_cast<int>(i));
            }
        }
        throw EmuError("AllocTensor: all " + std::to_string(bufs_.size()) + " buffers of the queue are in use (missing FreeTensor)");
    }
    template <typename T>
    void EnQue(const LocalTensor<T>& t) {
        ASC_EMU_CHECK(t.BufId() >= 0 && t.BufId() < static_cast<int>(bufs_.size()) && bufs_[t.BufId()].inUse,
                      "EnQue of a tensor not allocated from this queue");
        ASC_EMU_CHECK(fifo_.size() < static_cast<size_t>(DEPTH) || DEPTH == 0, "EnQue beyond the queue depth");
        fifo_.push_back(t.BufId());
    }
    template <typename T>
    LocalTensor<T> DeQue() {
        ASC_EMU_CHECK(!fifo_.empty(), "DeQue of an empty queue");
        int id = fifo_.front();
        fifo_.pop_front();
        return LocalTensor<T>(reinterpret_cast<T*>(ub_ + bufs_[id].offset), bufs_[id].len / sizeof(T), bufs_[id].offset, id);
    }
    template <typename T>
    void FreeTensor(const LocalTensor<T>& t) {
        ASC_EMU_CHECK(t.BufId() >= 0 && t.BufId() < static_cast<int>(bufs_.size()) && bufs_[t.BufId()].inUse,
                      "FreeTensor of a tensor that is not allocated from this queue");
        bufs_[t.BufId()].inUse = false;
    }

private:
    friend class TPipe;
    uint8_t* ub_ = nullptr;
    std::vector<EmuBuffer> bufs_;
    std::deque<int> fifo_;
};

template <TPosition POS>
class TBuf {
public:
    template <typename T>
    LocalTensor<T> Get() const {
        ASC_EMU_CHECK(ub_ != nullptr, "TBuf::Get before TPipe::InitBuffer");
        return LocalTensor<T>(reinterpret_cast<T*>(ub_ + offset_), len_ / sizeof(T), offset_, -1);
    }
    template <typename T>
    LocalTensor<T> Get(uint32_t count) const {
        ASC_EMU_CHECK(count * sizeof(T) <= len_, "TBuf::Get(" + std::to_string(count) + ") beyond the buffer");
        return LocalTensor<T>(reinterpret_cast<T*>(ub_ + offset_), count, offset_, -1);
    }

private:
    friend class TPipe;
    uint8_t* ub_ = nullptr;
    uint32_t offset_ = 0;
    uint32_t len_ = 0;
};

class TPipe {
public:
    TPipe() : cap_(Core().ubCapacity), ub_(static_cast<uint8_t*>(std::aligned_alloc(ONE_BLK_SIZE, AlignUp32(Core().ubCapacity)))) {
        ASC_EMU_CHECK(ub_ != nullptr, "cannot allocate the emulated UB");
        std::memset(ub_, 0xff, cap_);
    }
    ~TPipe() { std::free(ub_); }
    TPipe(const TPipe&) = delete;
    TPipe& operator=(const TPipe&) = delete;

    template <TPosition POS, int32_t DEPTH>
    void InitBuffer(TQue<POS, DEPTH>& que, uint8_t num, uint32_t len) {
        ASC_EMU_CHECK(num >= 1 && len > 0, "InitBuffer: empty queue");
        que.ub_ = ub_;
        que.bufs_.clear();
        for (uint8_t i = 0; i < num; ++i) que.bufs_.push_back(EmuBuffer{Reserve(AlignUp32(len)), AlignUp32(len), false});
    }
    template <TPosition POS>
    void InitBuffer(TBuf<POS>& buf, uint32_t len) {
        ASC_EMU_CHECK(len > 0, "InitBuffer: empty buffer");
        buf.ub_ = ub_;
        buf.len_ = AlignUp32(len);
        buf.offset_ = Reserve(buf.len_);
    }
    uint32_t Used() const { return used_; }

private:
    uint32_t Reserve(uint32_t bytes) {
        ASC_EMU_CHECK(used_ + bytes <= cap_, "unified buffer overflow: " + std::to_string(used_ + bytes) +
                                                 " bytes requested, the SoC's UB holds " + std::to_string(cap_));
        uint32_t off = used_;
        used_ += bytes;
        Core().ubPeak = std::max(Core().ubPeak, used_);
        return off;
    }
    uint32_t cap_;
    uint8_t* ub_;
    uint32_t used_ = 0;
};

// ---- data movement --------------------------------------------------------------------------------------------
struct DataCopyExtParams {
    uint16_t blockCount = 0;
    uint32_t blockLen = 0;   // bytes per block
    uint32_t srcStride = 0;  // GM->UB: bytes between GM blocks; UB->GM: 32-byte blocks between UB blocks
    uint32_t dstStride = 0;  // GM->UB: 32-byte blocks between UB blocks; UB->GM: bytes between GM blocks
    uint32_t rsv = 0;
};

template <typename T>
struct DataCopyPadExtParams {
    bool isPad = false;
    uint8_t leftPadding = 0;
    uint8_t rightPadding = 0;
    T paddingValue{};
};

template <typename T>
inline void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, uint32_t count) {
    CheckOperand(dst, count, "DataCopy GM->UB");
    ASC_EMU_CHECK((count * sizeof(T)) % ONE_BLK_SIZE == 0,
                  "DataCopy GM->UB of " + std::to_string(count * sizeof(T)) + " bytes: not a multiple of 32 (use DataCopyPad)");
    ASC_EMU_CHECK(reinterpret_cast<uintptr_t>(src.GetPhyAddr()) % ONE_BLK_SIZE == 0,
                  "DataCopy GM->UB from a GM address that is not 32-byte aligned (use DataCopyPad)");
    ASC_EMU_CHECK(count <= src.GetSize(), "DataCopy GM->UB reads beyond the GM tensor");
    std::memcpy(dst.Ptr(), src.GetPhyAddr(), count * sizeof(T));
}

template <typename T>
inline void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src, uint32_t count) {
    CheckOperand(src, count, "DataCopy UB->GM");
    ASC_EMU_CHECK((count * sizeof(T)) % ONE_BLK_SIZE == 0,
                  "DataCopy UB->GM of " + std::to_string(count * sizeof(T)) + " bytes: not a multiple of 32 (use DataCopyPad)");
    ASC_EMU_CHECK(reinterpret_cast<uintptr_t>(dst.GetPhyAddr()) % ONE_BLK_SIZE == 0,
                  "DataCopy UB->GM to a GM address that is not 32-byte aligned (use DataCopyPad)");
    ASC_EMU_CHECK(count <= dst.GetSize(), "DataCopy UB->GM writes beyond the GM tensor");
    std::memcpy(dst.GetPhyAddr(), src.Ptr(), count * sizeof(T));
}

template <typename T>
inline void DataCopyPad(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const DataCopyExtParams& p,
                        const DataCopyPadExtParams<T>& pad) {
    ASC_EMU_CHECK(p.blockLen % sizeof(T) == 0, "DataCopyPad: blockLen is not a whole number of elements");
    const uint32_t ubBlock = AlignUp32(p.blockLen) + p.dstStride * ONE_BLK_SIZE;
    const uint32_t n = p.blockLen / sizeof(T);
    CheckOperand(dst, p.blockCount ? ((p.blockCount - 1) * ubBlock + AlignUp32(p.blockLen)) / sizeof(T) : 0, "DataCopyPad GM->UB");
    uint8_t* out = reinterpret_cast<uint8_t*>(dst.Ptr());
    const uint8_t* in = reinterpret_cast<const uint8_t*>(src.GetPhyAddr());
    for (uint32_t b = 0; b < p.blockCount; ++b) {
        const uint64_t gOff = static_cast<uint64_t>(b) * (p.blockLen + p.srcStride);
        ASC_EMU_CHECK((gOff + p.blockLen) / sizeof(T) <= src.GetSize(), "DataCopyPad GM->UB reads beyond the GM tensor");
        uint8_t* o = out + b * ubBlock;
        std::memcpy(o, in + gOff, p.blockLen);
        T* tail = reinterpret_cast<T*>(o) + n;
        const uint32_t padElems = (AlignUp32(p.blockLen) - p.blockLen) / sizeof(T);
        for (uint32_t i = 0; i < padElems; ++i) {
            if (pad.isPad) {
                tail[i] = pad.paddingValue;
            } else {
                std::memset(static_cast<void*>(&tail[i]), 0xff, sizeof(T));  // undefined on the NPU: NaN here
            }
        }
    }
}

template <typename T>
inline void DataCopyPad(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const DataCopyExtParams& p) {
    ASC_EMU_CHECK(p.blockLen % sizeof(T) == 0, "DataCopyPad: blockLen is not a whole number of elements");
    const uint32_t ubBlock = AlignUp32(p.blockLen) + p.srcStride * ONE_BLK_SIZE;
    CheckOperand(src, p.blockCount ? ((p.blockCount - 1) * ubBlock + p.blockLen) / sizeof(T) : 0, "DataCopyPad UB->GM");
    const uint8_t* in = reinterpret_cast<const uint8_t*>(src.Ptr());
    uint8_t* out = reinterpret_cast<uint8_t*>(dst.GetPhyAddr());
    for (uint32_t b = 0; b < p.blockCount; ++b) {
        const uint64_t gOff = static_cast<uint64_t>(b) * (p.blockLen + p.dstStride);
        ASC_EMU_CHECK((gOff + p.blockLen) / sizeof(T) <= dst.GetSize(), "DataCopyPad UB->GM writes beyond the GM tensor");
        std::memcpy(out + gOff, in + b * ubBlock, p.blockLen);
    }
}

}  // namespace AscendC

#include "vector_ops_emu.h"
