// Deliberately wrong uses of the emulated API, one per check, so that tests can prove each emulation check fires.
// Not a kernel: compiled only into the host library (included by launch_emu.cpp).
#include "kernel_operator_emu.h"

namespace dsv4_selftest {
using namespace AscendC;

// which: 0 DataCopy of 20 bytes (not whole 32-byte blocks), 1 vector op on a UB address that is not 32-byte aligned,
// 2 AllocTensor beyond the queue's buffers, 3 GM read past the tensor, 4 DataCopy from an unaligned GM address,
// 5 a correct DataCopyPad of 20 bytes (must pass), 6 DeQue of an empty queue, 7 TPipe over the UB capacity.
inline void Run(int which) {
    alignas(64) static float gm[64];
    GlobalTensor<float> g;
    g.SetGlobalBuffer(gm, 64);
    TPipe pipe;
    TQue<QuePosition::VECIN, 2> que;
    TBuf<TPosition::VECCALC> buf;
    pipe.InitBuffer(que, 2, 256);
    pipe.InitBuffer(buf, 256);
    LocalTensor<float> t = que.AllocTensor<float>();
    LocalTensor<float> b = buf.Get<float>();
    switch (which) {
        case 0: DataCopy(t, g, 5); break;
        case 1: Adds(b[3], b[3], 1.0f, 8); break;
        case 2: que.AllocTensor<float>(); que.AllocTensor<float>(); break;
        case 3: g.GetValue(64); break;
        case 4: DataCopy(t, g[1], 8); break;
        case 5: {
            DataCopyExtParams p{1, 20, 0, 0, 0};
            DataCopyPadExtParams<float> pad{true, 0, 3, 0.0f};
            DataCopyPad(t, g[1], p, pad);
            break;
        }
        case 6: que.DeQue<float>(); break;
        case 7: pipe.InitBuffer(buf, Core().ubCapacity); break;
        default: break;
    }
}
}  // namespace dsv4_selftest
