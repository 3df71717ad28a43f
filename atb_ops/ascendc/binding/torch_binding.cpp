// torch binding of our AscendC kernels on the NPU: implementations of torch.ops.ascend_dsv4.{compressor_pool,
// sparse_attention, mla_decode} for the PrivateUse1 (NPU) dispatch key. The schemas and the meta ("fake")
// implementations are registered from Python (atb_ops/ascendc/loader.py) before this library is loaded, so that
// graph capture works and the schemas can be tested without CANN.
//
// Each op computes the host tiling (kernels/tiling.h, the same function the host emulation runs), copies it to
// the device and launches the kernel on the current NPU stream through OpCommand's custom handler with the
// launch function that ascendc_library generated (ACLRT_LAUNCH_KERNEL). Built only on a machine with CANN; this
// project has not run it on an NPU.
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "acl/acl.h"
#include "torch_npu/csrc/core/npu/NPUStream.h"
#include "torch_npu/csrc/framework/OpCommand.h"

#include "aclrtlaunch_dsv4_compressor.h"
#include "aclrtlaunch_dsv4_mla_decode.h"
#include "aclrtlaunch_dsv4_mla_decode_cube.h"
#include "tiling.h"
#include "tiling/platform/platform_ascendc.h"
#include "tiling/tiling_api.h"

namespace {

// SoC of the current device -> row of dsv4::Soc(); ASCEND_DSV4_ASCENDC_SOC overrides (ascend910b2 | ascend910b4 | ascend910c)
uint32_t SocId() {
    const char* env = std::getenv("ASCEND_DSV4_ASCENDC_SOC");
    std::string name = env ? env : "";
    if (name.empty()) {
        const char* soc = aclrtGetSocName();
        name = soc ? soc : "";
    }
    if (name.find("910_93") != std::string::npos || name == "ascend910c") return 2;
    if (name.find("910B3") != std::string::npos || name.find("910B4") != std::string::npos || name == "ascend910b4") return 1;
    return 0;
}

uint32_t DType(const at::Tensor& t, const char* what) {
    if (t.scalar_type() == at::kFloat) return dsv4::DT_FLOAT32;
    if (t.scalar_type() == at::kBFloat16) return dsv4::DT_BFLOAT16;
    TORCH_CHECK(false, what, ": float32 or bfloat16 expected, got ", t.scalar_type());
}

template <typename S>
at::Tensor TilingOnDevice(const S& t, const at::Device& dev) {
    at::Tensor host = at::empty({static_cast<int64_t>(sizeof(S))}, at::TensorOptions().dtype(at::kByte));
    std::memcpy(host.data_ptr(), &t, sizeof(S));
    return host.to(dev);  // blocking copy: the host buffer dies with this function
}

at::Tensor CompressorPool(const at::Tensor& kv_state, const at::Tensor& score_state, const at::Tensor& cand, bool overlap) {
    TORCH_CHECK(kv_state.dim() == 2 && score_state.sizes() == kv_state.sizes(), "compressor_pool: kv_state/score_state [S, W]");
    TORCH_CHECK(cand.dim() == 2 && cand.scalar_type() == at::kLong, "compressor_pool: cand [M, K] int64");
    const uint32_t dt = DType(kv_state, "compressor_pool kv_state");
    at::Tensor kv = kv_state.contiguous(), sc = score_state.to(kv.scalar_type()).contiguous(), cd = cand.contiguous();
    const int64_t M = cd.size(0), K = cd.size(1), S = kv.size(0), W = kv.size(1);
    const int64_t c = overlap ? W / 2 : W;
    at::Tensor out = at::empty({M, c}, kv.options().dtype(at::kFloat));
    if (M == 0) return out;
    const dsv4::CompressorTiling t = dsv4::CompressorTilingFor(M, K, S, W, overlap, dt, SocId(), 0, 0);
    at::Tensor tiling = TilingOnDevice(t, kv.device());
    void *pkv = kv.data_ptr(), *psc = sc.data_ptr(), *pcd = cd.data_ptr(), *pout = out.data_ptr(), *pt = tiling.data_ptr();
    aclrtStream stream = c10_npu::getCurrentNPUStream().stream(false);
    at_npu::native::OpCommand cmd;
    cmd.Name("dsv4_compressor");
    cmd.SetCustomHandler([=]() -> int {
        return ACLRT_LAUNCH_KERNEL(dsv4_compressor)(t.blockDim, stream, pkv, psc, pcd, nullptr, nullptr, nullptr, pout,
                                                    nullptr, pt);  // no fused epilogue: atb_ops has no such op yet
    });
    cmd.Run();
    return out;
}

// ASCEND_DSV4_ASCENDC_MLA: auto (cube where C, R are multiples of 16) | vector | cube, as in the host emulation.
bool UseCube(int64_t C, int64_t R) {
    const char* env = std::getenv("ASCEND_DSV4_ASCENDC_MLA");
    const std::string mode = env ? env : "auto";
    const bool ok = dsv4::MlaCubeSupported(static_cast<uint32_t>(C), static_cast<uint32_t>(R));
    TORCH_CHECK(mode == "auto" || mode == "vector" || mode == "cube", "ASCEND_DSV4_ASCENDC_MLA must be auto|vector|cube");
    TORCH_CHECK(mode != "cube" || ok, "ASCEND_DSV4_ASCENDC_MLA=cube needs C and R multiples of 16");
    return mode == "cube" || (mode == "auto" && ok);
}

// MlaTiling followed by CANN's TCubeTiling of the three GEMMs (QK^T nope, QK^T rope, PV), computed by the Matmul
// tiling API for operands in UB (VECCALC), ND, float32 results.
at::Tensor CubeTilingOnDevice(const dsv4::MlaTiling& t, uint32_t cubeDt, const at::Device& dev) {
    auto* platform = platform_ascendc::PlatformAscendCManager::GetInstance();
    dsv4::CubeShapes g[3];
    dsv4::MlaCubeGemms(t, g);
    const auto dt = cubeDt == dsv4::DT_BFLOAT16 ? matmul_tiling::DataType::DT_BF16 : matmul_tiling::DataType::DT_FLOAT;
    std::vector<uint8_t> buf(sizeof(dsv4::MlaTiling));
    std::memcpy(buf.data(), &t, sizeof(t));
    for (int i = 0; i < 3; ++i) {
        matmul_tiling::MatmulApiTiling mt(*platform);
        mt.SetAType(matmul_tiling::TPosition::VECCALC, matmul_tiling::CubeFormat::ND, dt, false);
        mt.SetBType(matmul_tiling::TPosition::VECCALC, matmul_tiling::CubeFormat::ND, dt, i < 2);
        mt.SetCType(matmul_tiling::TPosition::VECCALC, matmul_tiling::CubeFormat::ND, matmul_tiling::DataType::DT_FLOAT);
        mt.SetShape(g[i].m, g[i].n, g[i].k);
        mt.SetOrgShape(g[i].m, g[i].n, g[i].k);
        mt.SetBias(false);
        mt.SetBufferSpace(-1, -1, -1);
        optiling::TCubeTiling cube;
        TORCH_CHECK(mt.GetTiling(cube) != -1, "mla cube kernel: Matmul tiling failed for GEMM ", i);
        const size_t at = buf.size();
        buf.resize(at + cube.GetDataSize());
        cube.SaveToBuffer(buf.data() + at, cube.GetDataSize());
    }
    at::Tensor host = at::empty({static_cast<int64_t>(buf.size())}, at::TensorOptions().dtype(at::kByte));
    std::memcpy(host.data_ptr(), buf.data(), buf.size());
    return host.to(dev);
}

// q [T, H, C], qpe [T, H, R] or undefined, pools [P, C + R], idx [T, L] int64, sink [H] float32 or undefined.
at::Tensor Attention(const at::Tensor& q, const c10::optional<at::Tensor>& qpe, const at::Tensor& pool0, const at::Tensor& idx0,
                     const c10::optional<at::Tensor>& pool1, const c10::optional<at::Tensor>& idx1,
                     const c10::optional<at::Tensor>& sink, double scale) {
    TORCH_CHECK(q.dim() == 3, "attention: q [T, H, C]");
    const uint32_t qdt = DType(q, "attention q"), kvdt = DType(pool0, "attention kv");
    at::Tensor qc = q.contiguous();
    at::Tensor pe = qpe.has_value() ? qpe->to(q.scalar_type()).contiguous() : at::Tensor();
    at::Tensor p0 = pool0.contiguous(), i0 = idx0.to(at::kLong).contiguous();
    const bool two = pool1.has_value() && idx1.has_value() && idx1->size(-1) > 0;
    at::Tensor p1 = two ? pool1->to(pool0.scalar_type()).contiguous() : at::Tensor();
    at::Tensor i1 = two ? idx1->to(at::kLong).contiguous() : at::Tensor();
    at::Tensor sk = sink.has_value() ? sink->to(at::kFloat).contiguous() : at::Tensor();
    const int64_t T = qc.size(0), H = qc.size(1), C = qc.size(2), R = pe.defined() ? pe.size(-1) : 0;
    TORCH_CHECK(p0.size(-1) == C + R, "attention: pool row width ", p0.size(-1), " != C + R = ", C, " + ", R);
    at::Tensor out = at::empty({T, H, C}, qc.options());
    if (T == 0) return out;
    const bool cube = UseCube(C, R);
    const uint32_t nI1 = two ? i1.size(-1) : 0, nP1 = two ? p1.size(0) : 0;
    const dsv4::MlaTiling t =
        cube ? dsv4::MlaCubeTilingFor(T, H, C, R, i0.size(-1), nI1, p0.size(0), nP1, sk.defined(), static_cast<float>(scale),
                                      qdt, kvdt, SocId(), 0, 0, 0)
             : dsv4::MlaTilingFor(T, H, C, R, i0.size(-1), nI1, p0.size(0), nP1, sk.defined(), static_cast<float>(scale), qdt,
                                  kvdt, SocId(), 0, 0, 0);
    at::Tensor tiling = cube ? CubeTilingOnDevice(t, dsv4::CubeDType(qdt, kvdt), qc.device()) : TilingOnDevice(t, qc.device());
    // the Matmul API's system workspace (cube variant only)
    const size_t wsBytes = cube ? platform_ascendc::PlatformAscendCManager::GetInstance()->GetLibApiWorkSpaceSize() : 0;
    at::Tensor ws = at::empty({static_cast<int64_t>(wsBytes ? wsBytes : 1)}, qc.options().dtype(at::kByte));
    auto ptr = [](const at::Tensor& x) -> void* { return x.defined() && x.numel() ? x.data_ptr() : nullptr; };
    void *pq = ptr(qc), *ppe = ptr(pe), *pp0 = ptr(p0), *pi0 = ptr(i0), *pp1 = ptr(p1), *pi1 = ptr(i1), *psk = ptr(sk);
    void *pout = out.data_ptr(), *pt = tiling.data_ptr(), *pws = ws.data_ptr();
    const uint32_t cubeCores = (t.blockDim + 1) / 2;  // MIX 1:2 launch: one cube core drives two vector cores
    aclrtStream stream = c10_npu::getCurrentNPUStream().stream(false);
    at_npu::native::OpCommand cmd;
    cmd.Name(cube ? "dsv4_mla_decode_cube" : "dsv4_mla_decode");
    cmd.SetCustomHandler([=]() -> int {
        if (cube)
            return ACLRT_LAUNCH_KERNEL(dsv4_mla_decode_cube)(cubeCores, stream, pq, ppe, pp0, pi0, pp1, pi1, psk, pout, pws, pt);
        return ACLRT_LAUNCH_KERNEL(dsv4_mla_decode)(t.blockDim, stream, pq, ppe, pp0, pi0, pp1, pi1, psk, pout, nullptr, pt);
    });
    cmd.Run();
    return out;
}

at::Tensor SparseAttention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& idx, const at::Tensor& sink, double scale,
                           const c10::optional<at::Tensor>& extra_kv, const c10::optional<at::Tensor>& extra_idx) {
    return Attention(q, c10::nullopt, kv, idx, extra_kv, extra_idx, sink, scale);
}

at::Tensor MlaDecode(const at::Tensor& q_nope_absorbed, const at::Tensor& q_pe, const at::Tensor& latent, const at::Tensor& idx,
                     double scale) {
    if (idx.size(-1) == 0) return at::zeros_like(q_nope_absorbed);
    return Attention(q_nope_absorbed, q_pe.size(-1) ? c10::optional<at::Tensor>(q_pe) : c10::nullopt, latent, idx, c10::nullopt,
                     c10::nullopt, c10::nullopt, scale);
}

}  // namespace

TORCH_LIBRARY_IMPL(ascend_dsv4, PrivateUse1, m) {
    m.impl("compressor_pool", &CompressorPool);
    m.impl("sparse_attention", &SparseAttention);
    m.impl("mla_decode", &MlaDecode);
}
