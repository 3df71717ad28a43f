"""The CUDA C FP8-block linear of 1-8 rows with K split inside the block (atb_ops/cuda/fp8_gemv.py), built by NVRTC.

On the CPU: its word decoder (PTX) over every 32-bit word's two 16-bit halves by the emulator of test_gemm_decode.py,
against torch's e4m3 conversion; the eligibility rules, the launch plan and the override parser. On the GPU
(``cuda``): every output within one bfloat16 rounding (plus float32 summation noise) of the exact float64 product
(``check_close``) and close to the reference op, over token counts 1..8, every split and depth, float32 and E8M0
scales, uneven K step counts per warp, row counts that leave a block's last row tiles empty, every byte value of the
weights, extreme scales, rows of zeros; the decode step's shapes; the weights loaded before the PDL wait or after;
the public op's routing; a CUDA-graph replay equal to the eager call; a chain of PDL launches (each reading what the
kernel before it wrote) captured in a graph equal to the same chain without PDL.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import atb_ops  # noqa: E402
from atb_ops.cuda import fp8_gemv as fg  # noqa: E402
from atb_ops.cuda import gemm  # noqa: E402
from quant.fp8_block import quant_fp8_block  # noqa: E402

from test_gemm_decode import _bf16_bits_to_f32, check_close, run_ptx  # noqa: E402
from test_pdl import assert_pdl_graph_equals_plain  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_fp8x4_ptx_decodes_every_word():
    """Output 0 = (code 0, code 1), output 1 = (code 2, code 3) of a word of 4 e4m3 codes (code i in byte i),
    bit-exact against torch's e4m3 -> bfloat16 (signs of zeros included) for every 16-bit half in both positions,
    the NaN codes (0x7F, 0xFF) as +-480 as gemm_tc's pair decoder gives them."""
    h = np.arange(65536, dtype=np.uint32)
    regs = np.concatenate([h | (h[::-1] << 16), h[::-1] | (h << 16)]).astype(np.uint32)
    out0, out1 = run_ptx(fg.FP8X4_PTX, [regs], 2)
    got = torch.stack([_bf16_bits_to_f32(out0 & 0xFFFF), _bf16_bits_to_f32(out0 >> 16),
                       _bf16_bits_to_f32(out1 & 0xFFFF), _bf16_bits_to_f32(out1 >> 16)], 1)
    lut = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    lut[0x7F], lut[0xFF] = 480.0, -480.0
    codes = torch.from_numpy(regs.astype(np.int64))
    want = torch.stack([lut[(codes >> (8 * i)) & 0xFF] for i in range(4)], 1)
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))


def _fake(shape, dtype, device="cpu"):
    return torch.empty(shape, dtype=dtype, device=device)


def test_eligible_rules():
    """bfloat16 x of 1..8 rows on a CUDA device, N a multiple of 16, K of 128, scales [ceil(N/128), K/128]."""
    w = _fake((144, 256), torch.float8_e4m3fn)
    s = _fake((2, 2), torch.uint8)
    x = _fake((8, 256), torch.bfloat16)
    assert not fg.eligible(x, w, s)  # on the CPU
    if DEV == "cuda":
        xd, wd, sd = x.to(DEV), w.to(DEV), s.to(DEV)
        assert fg.eligible(xd, wd, sd) and fg.eligible(xd, wd, sd.float())
        assert not fg.eligible(_fake((9, 256), torch.bfloat16, DEV), wd, sd)  # 9 rows
        assert not fg.eligible(xd.half(), wd, sd)
        assert not fg.eligible(xd, _fake((152, 256), torch.float8_e4m3fn, DEV), sd)  # N = 152
        assert not fg.eligible(xd, wd, _fake((2, 3), torch.uint8, DEV))  # scale shape
        assert not fg.eligible(xd, wd, None)
        assert not fg.eligible(_fake((8, 257), torch.bfloat16, DEV)[:, 1:], wd, sd)  # x off its 16-byte boundary


def test_launch_plan_fills_the_gpu(monkeypatch):
    """The smallest K split giving 15/8 blocks an SM, at most the K step count: the decode step's shapes on 132 SMs
    take the splits measured fastest there (h200_session38.txt)."""
    monkeypatch.delenv("ATB_CUDA_FP8_GEMV_CFG", raising=False)
    monkeypatch.setattr(fg, "sm_count", lambda device: 132)
    dev = torch.device("cpu")
    assert fg.launch_plan(32768, 1024, dev) == (1, 3, 256)  # wq_b: 256 blocks of 128 rows
    assert fg.launch_plan(8192, 1024, dev) == (4, 3, 256)  # the indexer's wq_b
    assert fg.launch_plan(4096, 4096, dev) == (8, 2, 256)  # 256 blocks of 16 rows
    assert fg.launch_plan(1536, 4096, dev) == (8, 2, 96)  # 96 blocks: the most the split can give
    assert fg.launch_plan(4096, 256, dev).s == 2  # two K steps: no more than two warps a row tile
    assert fg.launch_plan(4096, 128, dev) == (1, 3, 4096 // 128)


@pytest.mark.parametrize("bad", ["s=3", "d=5", "d", "nt=2", "s=two"])
def test_cfg_override_errors_name_the_variable(monkeypatch, bad):
    monkeypatch.setenv("ATB_CUDA_FP8_GEMV_CFG", f"d=2,{bad}")
    with pytest.raises(ValueError, match="ATB_CUDA_FP8_GEMV_CFG"):
        fg.launch_plan(256, 256, torch.device("cpu"))
    monkeypatch.setenv("ATB_CUDA_FP8_GEMV_CFG", "d=4, s=2")
    p = fg.launch_plan(256, 256, torch.device("cpu"))
    assert (p.s, p.d) == (2, 4)


def _built():
    if not fg.available(torch.device(DEV)):
        pytest.fail(f"fp8_gemv did not build: {fg.PROGRAM.error}")


def _weights(n, k, g, float_scale):
    w = torch.randn(n, k, generator=g) * 0.1
    q, s = quant_fp8_block(w, scale_fmt=None if float_scale else "ue8m0")
    return q.to(DEV), s.to(DEV)


def _check(x, w, s):
    got = fg.linear(x, w, s)
    assert got.shape == (x.shape[0], w.shape[0]) and got.dtype == torch.bfloat16
    check_close(got, x, w, s, "fp8_block")
    ref = atb_ops.implementations("linear")["reference"](x, w, s, "fp8_block")
    assert float((got.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)) < 1e-2
    return got


@pytest.mark.cuda
@pytest.mark.parametrize("pre", ["0", "1"])
@pytest.mark.parametrize("cfg", ["", "s=1,d=2", "s=2,d=3", "s=4,d=4", "s=8,d=2", "s=8,d=3"])
@pytest.mark.parametrize("float_scale", [False, True])
@pytest.mark.parametrize("m", [1, 5, 8])
def test_fp8_gemv_random(m, float_scale, cfg, pre, monkeypatch):
    """N = 400: 25 row tiles (a block's last tiles empty at every split but 8); K = 1408: 11 steps, uneven per warp."""
    _built()
    monkeypatch.setenv("ATB_CUDA_FP8_GEMV_CFG", cfg)
    monkeypatch.setenv("ATB_CUDA_FP8_GEMV_PRE", pre)
    g = torch.Generator().manual_seed(71 + m)
    n, k = 400, 1408
    w, s = _weights(n, k, g, float_scale)
    x = torch.randn(m, k, generator=g).to(DEV, torch.bfloat16)
    assert fg.eligible(x, w, s)
    _check(x, w, s)


@pytest.mark.cuda
@pytest.mark.parametrize("n,k", [(16, 128), (1536, 4096), (4096, 4096), (32768, 1024), (4096, 8192), (4096, 2048),
                                 (8192, 1024)])
@pytest.mark.parametrize("m", [1, 8])
def test_fp8_gemv_shapes(n, k, m):
    """One row tile and one K step; DeepSeek-V4-Flash's decode linears (wq_a + wkv, shared w13, wq_b, wo_b, shared
    w2, the indexer's wq_b)."""
    _built()
    g = torch.Generator(device=DEV).manual_seed(n + k + m)
    w, s = quant_fp8_block(torch.randn(n, k, device=DEV, generator=g) * 0.05, scale_fmt="ue8m0")
    x = (torch.randn(m, k, device=DEV, generator=g)).to(torch.bfloat16)
    _check(x, w, s)


@pytest.mark.cuda
@pytest.mark.parametrize("float_scale", [False, True])
def test_fp8_gemv_every_byte_and_extreme_scales(float_scale):
    """Every e4m3 byte but the NaNs (subnormals, zeros of both signs, +-448) in every K position, scales from 2^-30
    to 2^20 across the blocks, rows of zeros among the tokens."""
    _built()
    n, k = 256, 512
    codes = torch.arange(n * k, dtype=torch.int64).remainder(256).to(torch.uint8)
    codes[(codes == 0x7F) | (codes == 0xFF)] = 0x7E
    w = codes.view(n, k)[:, torch.randperm(k, generator=torch.Generator().manual_seed(3))].contiguous()
    w = w.view(torch.float8_e4m3fn).to(DEV)
    e = torch.tensor([[97, 127, 147, 110], [127, 120, 100, 130]], dtype=torch.int64)  # 2^-30 .. 2^20
    s = (e.to(torch.uint8) if not float_scale else torch.exp2((e - 127).double()).float()).to(DEV)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, k, generator=g)
    x[3] = 0
    x[6, :128] = 0
    x = x.to(DEV, torch.bfloat16)
    got = _check(x, w, s)
    assert bool((got[3] == 0).all())


@pytest.mark.cuda
def test_public_linear_routes_here_and_graph_replay_equals_eager(monkeypatch):
    """atb_ops.linear sends fp8_block linears of up to FP8_GEMV_MAX_ROWS rows here (ATB_CUDA_FP8_GEMV_ROWS=0: none);
    a CUDA-graph replay gives the eager call's bits."""
    _built()
    monkeypatch.delenv("ATB_CUDA_GEMM", raising=False)
    g = torch.Generator().manual_seed(9)
    w, s = _weights(1024, 2048, g, False)
    x = torch.randn(gemm.FP8_GEMV_MAX_ROWS, 2048, generator=g).to(DEV, torch.bfloat16)
    calls = []
    real = fg.linear
    monkeypatch.setattr(fg, "linear", lambda *a: calls.append(1) or real(*a))
    eager = atb_ops.linear(x, w, s, "fp8_block")
    assert calls, "the auto rule did not take the fp8 gemv kernel"
    assert torch.equal(eager, real(x, w, s))
    n_before = len(calls)
    atb_ops.linear(torch.randn(gemm.FP8_GEMV_MAX_ROWS + 1, 2048, device=DEV, dtype=torch.bfloat16), w, s, "fp8_block")
    assert len(calls) == n_before  # more rows: another kernel
    monkeypatch.setenv("ATB_CUDA_FP8_GEMV_ROWS", "0")
    atb_ops.linear(x, w, s, "fp8_block")
    assert len(calls) == n_before
    monkeypatch.delenv("ATB_CUDA_FP8_GEMV_ROWS")
    static = x.clone()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        real(static, w, s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = real(static, w, s)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("bad", ["9", "-1", "x", ""])
def test_gemv_rows_override_errors_name_the_variable(monkeypatch, bad):
    monkeypatch.setenv("ATB_CUDA_FP8_GEMV_ROWS", bad)
    with pytest.raises(ValueError, match="ATB_CUDA_FP8_GEMV_ROWS"):
        gemm.gemv_rows()
    monkeypatch.setenv("ATB_CUDA_FP8_GEMV_ROWS", "0")
    assert gemm.gemv_rows() == 0
    monkeypatch.delenv("ATB_CUDA_FP8_GEMV_ROWS")
    assert gemm.gemv_rows() == gemm.FP8_GEMV_MAX_ROWS


@pytest.mark.cuda
@pytest.mark.parametrize("pre", ["0", "1"])
def test_pdl_chain_in_cuda_graph_equals_plain(monkeypatch, pre):
    """16 dependent pairs (the Triton RMSNorm, PDL with early launch, then this kernel reading the norm's output; the
    next norm reads this kernel's), captured with PDL and replayed on new inputs: a read of x before the norm had
    finished would change the bits against the same chain launched eagerly without PDL."""
    _built()
    norm = atb_ops.implementations("rms_norm")["cuda"]
    g = torch.Generator(device=DEV).manual_seed(0)
    w, s = quant_fp8_block(torch.randn(2048, 2048, device=DEV, generator=g) * 0.05, scale_fmt="ue8m0")
    x = torch.randn(8, 2048, device=DEV, generator=g).to(torch.bfloat16)

    def chain():
        y = x
        for _ in range(16):
            y = fg.linear(norm(y, None, 1e-6), w, s)
        return y

    monkeypatch.setenv("ATB_CUDA_FP8_GEMV_PRE", pre)
    assert_pdl_graph_equals_plain(chain, lambda: x.copy_(torch.randn(8, 2048, device=DEV, generator=g).bfloat16()),
                                  monkeypatch)


def test_launch_plan_counts_every_group(monkeypatch):
    """DeepSeek-V4-Flash's wo_a: 8 groups of 1024 x 4096 on 132 SMs take split 4 (256 blocks in all)."""
    monkeypatch.delenv("ATB_CUDA_FP8_GEMV_CFG", raising=False)
    monkeypatch.setattr(fg, "sm_count", lambda device: 132)
    assert fg.launch_plan(1024, 4096, torch.device("cpu"), groups=8) == (4, 3, 32)


def test_group_eligible_rules():
    x = _fake((4, 8, 256), torch.bfloat16)
    w = _fake((8, 256, 256), torch.float8_e4m3fn)
    s = _fake((8, 2, 2), torch.uint8)
    assert not fg.group_eligible(x, w, s)  # on the CPU
    if DEV == "cuda":
        xd, wd, sd = x.to(DEV), w.to(DEV), s.to(DEV)
        assert fg.group_eligible(xd, wd, sd) and fg.group_eligible(xd, wd, sd.float())
        assert fg.group_eligible(_fake((32, 8, 256), torch.bfloat16, DEV), wd, sd)
        assert not fg.group_eligible(_fake((33, 8, 256), torch.bfloat16, DEV), wd, sd)  # 33 tokens
        w144, s144 = _fake((8, 144, 256), torch.float8_e4m3fn, DEV), _fake((8, 2, 2), torch.uint8, DEV)
        assert not fg.group_eligible(xd, w144, s144)  # N not a multiple of 128
        assert not fg.group_eligible(xd[:, :4], wd[:4], sd[:4])  # x not contiguous
        assert not fg.group_eligible(xd, wd, sd[:, :1])


@pytest.mark.cuda
@pytest.mark.parametrize("float_scale", [False, True])
@pytest.mark.parametrize("t,g,n,k", [(1, 8, 1024, 4096), (8, 8, 1024, 4096), (3, 3, 384, 1408), (8, 1, 128, 128),
                                     (5, 16, 256, 512), (9, 2, 384, 1408), (16, 8, 1024, 4096), (17, 3, 256, 640),
                                     (32, 8, 1024, 4096), (29, 1, 128, 128)])
def test_fp8_gemv_group_linear(t, g, n, k, float_scale):
    """out[t, g] = x[t, g] @ W[g]^T over every group in one launch (blockIdx.y the group), DeepSeek-V4-Flash's wo_a
    first: each group within one bfloat16 rounding of its float64 product and close to the reference op."""
    _built()
    gen = torch.Generator().manual_seed(t + g + n)
    q, s = quant_fp8_block(torch.randn(g, n, k, generator=gen) * 0.05, scale_fmt=None if float_scale else "ue8m0")
    q, s = q.to(DEV), s.to(DEV)
    x = torch.randn(t, g, k, generator=gen).to(DEV, torch.bfloat16)
    assert fg.group_eligible(x, q, s)
    got = fg.group_linear(x, q, s)
    assert got.shape == (t, g, n) and got.dtype == torch.bfloat16 and got.is_contiguous()
    for j in range(g):
        check_close(got[:, j].contiguous(), x[:, j].contiguous(), q[j], s[j], "fp8_block")
    ref = atb_ops.implementations("group_linear")["reference"](x, q, s, "fp8_block")
    assert float((got.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


# ---- the BF16 form: float32-output linears over BF16 weights (the float32-compute projections) -----------------

def test_bf16_eligible_rules_and_plan(monkeypatch):
    """bfloat16 x of 1..8 rows and a bfloat16 weight, N a multiple of 16, K of 128, both contiguous and aligned;
    one step in flight at split 8, else two (three would spill: 32 registers a step)."""
    w, x = _fake((144, 256), torch.bfloat16), _fake((8, 256), torch.bfloat16)
    assert not fg.bf16_eligible(x, w)  # on the CPU
    if DEV == "cuda":
        xd, wd = x.to(DEV), w.to(DEV)
        assert fg.bf16_eligible(xd, wd)
        assert not fg.bf16_eligible(_fake((9, 256), torch.bfloat16, DEV), wd)
        assert not fg.bf16_eligible(xd.float(), wd) and not fg.bf16_eligible(xd, wd.float())
        assert not fg.bf16_eligible(xd, _fake((152, 256), torch.bfloat16, DEV))  # N = 152
        assert not fg.bf16_eligible(_fake((8, 264), torch.bfloat16, DEV)[:, 8:], wd)  # not contiguous
    monkeypatch.delenv("ATB_CUDA_FP8_GEMV_CFG", raising=False)
    monkeypatch.setattr(fg, "sm_count", lambda device: 132)
    assert fg.launch_plan(2048, 4096, torch.device("cpu"), bf16=True) == (8, 1, 128)  # the CSA compressor's
    assert fg.launch_plan(32768, 1024, torch.device("cpu"), bf16=True) == (1, 2, 256)
    monkeypatch.setenv("ATB_CUDA_FP8_GEMV_CFG", "d=3")
    with pytest.raises(ValueError, match="ATB_CUDA_FP8_GEMV_CFG"):
        fg.launch_plan(2048, 4096, torch.device("cpu"), bf16=True)


def _check_f32(x, w, got):
    """Within float32 summation noise of the exact float64 product (every BF16 product is exact in float32)."""
    want = x.double() @ w.double().t()
    assert got.dtype == torch.float32 and got.shape == want.shape
    bound = 1e-5 * (x.double().abs() @ w.double().abs().t()) + 1e-30  # (a bfloat16 rounding: 4e-3)
    assert bool(((got.double() - want).abs() <= bound).all()), float(((got.double() - want).abs() / bound).max())


@pytest.mark.cuda
@pytest.mark.parametrize("pre", ["0", "1"])
@pytest.mark.parametrize("cfg", ["", "s=1,d=1", "s=1,d=2", "s=2,d=2", "s=4,d=1", "s=8,d=2"])
@pytest.mark.parametrize("m", [1, 5, 8])
def test_bf16_gemv_random(m, cfg, pre, monkeypatch):
    """N = 400 (a block's last row tiles empty), K = 1408 (11 steps, uneven per warp); rows of zeros; every split
    and depth, the weights loaded before the PDL wait or after."""
    _built()
    monkeypatch.setenv("ATB_CUDA_FP8_GEMV_CFG", cfg)
    monkeypatch.setenv("ATB_CUDA_FP8_GEMV_PRE", pre)
    g = torch.Generator().manual_seed(91 + m)
    w = (torch.randn(400, 1408, generator=g) * 0.05).to(DEV, torch.bfloat16)
    x = torch.randn(m, 1408, generator=g).to(DEV, torch.bfloat16)
    x[m // 2] = 0
    assert fg.bf16_eligible(x, w)
    _check_f32(x, w, fg.linear_f32(x, w))


@pytest.mark.cuda
@pytest.mark.parametrize("n,k", [(16, 128), (2048, 4096), (1024, 4096), (512, 4096), (129280 // 8, 4096)])
@pytest.mark.parametrize("m", [1, 8])
def test_bf16_gemv_shapes_and_extremes(n, k, m):
    """One row tile and one K step; DeepSeek-V4-Flash's compressor projections (CSA, HCA, the indexer's; wkv and
    wgate stacked) and a slice of its head; BF16 weights from 2^-60 to 2^60, inputs scaled against them."""
    _built()
    g = torch.Generator(device=DEV).manual_seed(n + k + m)
    w = (torch.randn(n, k, device=DEV, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
    _check_f32(x, w, fg.linear_f32(x, w))
    e = torch.randint(-60, 61, (n, k), device=DEV, generator=g).float()
    w2 = (torch.randn(n, k, device=DEV, generator=g).sign() * torch.exp2(e)).to(torch.bfloat16)
    x2 = (torch.randn(m, k, device=DEV, generator=g) * torch.exp2(-e[:m] / 4)).to(torch.bfloat16)
    _check_f32(x2, w2, fg.linear_f32(x2, w2))


@pytest.mark.cuda
def test_float32_output_linear_routes_here_and_graph_replay_equals_eager(monkeypatch):
    """atb_ops.linear(..., out_dtype=torch.float32) of a BF16 input and weight: this kernel up to 8 rows (the same
    bits as the direct call), cuBLAS beyond 8 rows, beyond BF16_GEMV_MAX_N columns and with ATB_CUDA_BF16_GEMV=0
    (within float32 noise of it); a CUDA-graph replay equals the eager call."""
    _built()
    g = torch.Generator(device=DEV).manual_seed(7)
    w = (torch.randn(1024, 4096, device=DEV, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(8, 4096, device=DEV, generator=g).to(torch.bfloat16)
    f32 = gemm.linear_float32_from_16bit
    monkeypatch.delenv("ATB_CUDA_BF16_GEMV", raising=False)
    got = f32(x, w)
    assert torch.equal(got, fg.linear_f32(x, w))
    assert torch.equal(f32(x[:3].view(1, 3, 4096), w)[0], fg.linear_f32(x[:3].contiguous(), w))  # [..., K] inputs
    monkeypatch.setenv("ATB_CUDA_BF16_GEMV", "0")
    _check_f32(x, w, f32(x, w))
    monkeypatch.setenv("ATB_CUDA_BF16_GEMV", "yes")
    with pytest.raises(ValueError, match="ATB_CUDA_BF16_GEMV"):
        f32(x, w)
    monkeypatch.delenv("ATB_CUDA_BF16_GEMV")
    x9 = torch.randn(9, 4096, device=DEV, generator=g).to(torch.bfloat16)
    calls = []
    monkeypatch.setattr(fg, "linear_f32", lambda *a: calls.append(a) or 1 / 0)
    _check_f32(x9, w, f32(x9, w))  # 9 rows: cuBLAS
    monkeypatch.setattr(gemm, "BF16_GEMV_MAX_N", 512)
    _check_f32(x, w, f32(x, w))  # more columns than BF16_GEMV_MAX_N (the head's case): cuBLAS
    assert not calls
    monkeypatch.undo()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f32(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)


@pytest.mark.cuda
def test_bf16_pdl_chain_in_cuda_graph_equals_plain(monkeypatch):
    """16 dependent pairs (the Triton RMSNorm, PDL with early launch, then this kernel's BF16 form reading the
    norm's output, float32), captured with PDL and replayed on new inputs, equal the chain without PDL."""
    _built()
    norm = atb_ops.implementations("rms_norm")["cuda"]
    g = torch.Generator(device=DEV).manual_seed(0)
    w = (torch.randn(2048, 2048, device=DEV, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(8, 2048, device=DEV, generator=g).to(torch.bfloat16)

    def chain():
        y = x
        for _ in range(16):
            y = fg.linear_f32(norm(y, None, 1e-6), w).to(torch.bfloat16)
        return y

    assert_pdl_graph_equals_plain(chain, lambda: x.copy_(torch.randn(8, 2048, device=DEV, generator=g).bfloat16()),
                                  monkeypatch)
