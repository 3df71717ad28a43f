"""Split-K "skinny" matmul used by the hyper-connection mixes and the MoE router logits.

out[t, o] = sum_k x[t, k] W[o, k] for a small number of outputs O (24 mixes, <= 384 experts) over a long K
(4 * 4096 streams, 4096 hidden). A tile of BT tokens times all O outputs per program, with K split over
programs so that a decode step (a few tokens) still fills the GPU; the partial sums (and optionally the
partial sums of x^2) are reduced in a fixed order afterwards (deterministic). Products are exact float32
(16-bit operands); float32 operands go through the tensor cores in three TF32 passes ("tf32x3": a = a_hi + a_lo,
a_hi b_hi + a_hi b_lo + a_lo b_hi, about float32 accuracy): Triton's IEEE float32 dot runs on the FMA units at
~2.5 us per 64-wide K step of a 16 x 32 tile on an H100, which made the hyper-connection mix of a decode step
(16384-long K) take 11.3 us a call; tf32x3 takes 6.1-6.4 us, error against float64 no larger
(scripts/bench_results/decode_h100_session6.txt).
``ATB_CUDA_SKINNY=f32=ieee`` keeps the FMA path.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._util import mma, pow2, sm_count, tl_dtype, pdl_wait, pdl


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, part_ptr, ss_ptr, T, K, O, k_per_split,
                   BT: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr, CT: tl.constexpr, PREC: tl.constexpr,
                   WANT_SS: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    sp = tl.program_id(1)
    o = tl.arange(0, BO)
    tm = t < T
    om = o < O
    acc = tl.zeros((BT, BO), tl.float32)
    ss = tl.zeros((BT,), tl.float32)
    k_lo = sp * k_per_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        xa = tl.load(x_ptr + t[:, None].to(tl.int64) * K + k[None, :], mask=tm[:, None] & km[None, :], other=0.0)
        wa = tl.load(w_ptr + o[:, None].to(tl.int64) * K + k[None, :], mask=om[:, None] & km[None, :], other=0.0)
        acc += mma(xa.to(CT), tl.trans(wa.to(CT)), PREC)
        if WANT_SS:
            xf = xa.to(tl.float32)
            ss += tl.sum(xf * xf, 1)
    base = sp.to(tl.int64) * T + t
    tl.store(part_ptr + base[:, None] * BO + o[None, :], acc, mask=tm[:, None])
    if WANT_SS:
        tl.store(ss_ptr + base, ss, mask=tm)


def _split_policy() -> tuple[int, int, str]:
    """(fewest K steps per program, programs per SM aimed at, float32 dot precision):
    ATB_CUDA_SKINNY="iters=4,per_sm=2,f32=tf32x3" (the defaults; a benchmark knob: fewer K steps per program shorten
    the dependent-load chain, more splits lengthen the consumer's sum; f32=ieee: float32 products on the FMA units)."""
    cfg = {"iters": 4, "per_sm": 2, "f32": "tf32x3"}
    for item in filter(None, os.environ.get("ATB_CUDA_SKINNY", "").split(",")):
        key, _, val = item.partition("=")
        ok = (val in ("tf32x3", "ieee")) if key == "f32" else (key in cfg and val.isdigit() and int(val) >= 1)
        if not ok:
            raise ValueError(f"ATB_CUDA_SKINNY: bad item {item!r}; expected iters=N, per_sm=N (N >= 1), "
                             f"f32=tf32x3|ieee")
        cfg[key] = val if key == "f32" else int(val)
    return cfg["iters"], cfg["per_sm"], cfg["f32"]


def skinny_matmul(x: torch.Tensor, w: torch.Tensor, want_ss: bool = False, partials: bool = False):
    """x [T, K], w [O, K] -> (float32 [T, BO] with BO = pow2(O) >= 16 (columns >= O are 0), sum(x^2) [T] or None).
    ``partials``: the per-split sums unreduced, float32 [S, T, BO] and [S, T] (a consumer kernel adds them up in
    split order, saving the two reduction launches)."""
    t_count, k = x.shape
    n_out = w.shape[0]
    bo = pow2(n_out, 16)
    ct = x.dtype if (x.dtype == w.dtype and x.dtype != torch.float32) else torch.float32
    iters, per_sm, f32 = _split_policy()
    prec = f32 if ct == torch.float32 else "tf32"  # (the precision is ignored for 16-bit operands)
    bt = 16
    bk = 64 if bo <= 64 else 32
    t_tiles = triton.cdiv(t_count, bt)
    max_split = triton.cdiv(k, iters * bk)
    n_split = max(1, min(max_split, triton.cdiv(per_sm * sm_count(x.device), t_tiles)))
    kps = triton.cdiv(triton.cdiv(k, n_split), bk) * bk
    n_split = triton.cdiv(k, kps)
    part = torch.empty(n_split, t_count, bo, dtype=torch.float32, device=x.device)
    ss = torch.empty(n_split, t_count, dtype=torch.float32, device=x.device) if want_ss else part
    _skinny_kernel[(t_tiles, n_split)](x, w, part, ss, t_count, k, n_out, kps, BT=bt, BO=bo, BK=bk,
                                       CT=tl_dtype(ct), PREC=prec, WANT_SS=want_ss, num_warps=4, **pdl())
    if partials:
        return part, (ss if want_ss else None)
    out = part[0] if n_split == 1 else part.sum(0)
    if not want_ss:
        return out, None
    return out, (ss[0] if n_split == 1 else ss.sum(0))
