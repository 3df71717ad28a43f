"""The public atb_ops surface: one function per fused op.

Each function documents shapes, dtypes and the math, then dispatches (see :mod:`atb_ops._dispatch`).
``T`` is the number of tokens of a ragged batch (several sequences concatenated).
"""

from __future__ import annotations

import torch

from . import reference  # noqa: F401  (registers the reference backend)
from ._dispatch import resolve


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y = w * x * rsqrt(mean(x^2, -1) + eps), computed in float32, returned in x.dtype.

    x: [..., n] any float dtype; weight: [n] (float32 in the model) or None for the weightless norm.
    """
    return resolve("rms_norm", x)(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: ``h = x + residual`` (in x's dtype, as the unfused ``x + r`` rounds it), returns
    ``(rms_norm(h, weight, eps), h)``.

    x, residual: [..., n] same float dtype; weight: [n] float32 or None. Outputs: both [..., n] in x.dtype.
    """
    return resolve("add_rms_norm", x)(x, residual, weight, eps)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved RoPE on the LAST ``R = 2 * len(inv_freq)`` channels of x; other channels pass through.

    x: [T, ..., D] (D >= R), positions: [T] int64 absolute positions, inv_freq: [R/2] float32
    (:func:`atb_ops.rope_inv_freq`). Pair i = (x[2i], x[2i+1]) of the rope slice is rotated as the complex
    number x[2i] + j x[2i+1] times exp(j * pos * theta_i); ``inverse`` rotates by -pos * theta_i (the
    attention output de-rotation). Computed in float32, returned in x.dtype. Returns a new tensor.
    """
    return resolve("apply_rope", x)(x, positions, inv_freq, inverse)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
                  inv_freq: torch.Tensor, out: torch.Tensor | None = None,
                  out_rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """RMSNorm then RoPE: ``apply_rope(rms_norm(x, weight, eps), positions, inv_freq)``, the norm's result rounded
    to x.dtype in between (exactly the two ops in sequence); V4's query (weightless, per head) and KV head.

    x: [T, ..., D]; weight: [D] float32 or None; positions: [T] int64; inv_freq: [R/2] float32. Returns
    [T, ..., D] in x.dtype. With ``out`` ([S, ...] of x's row shape, any float dtype) and ``out_rows`` ([T] int64,
    distinct valid rows of ``out``) the result is stored instead, ``out[out_rows[t]] = y[t]`` cast to out.dtype,
    and None is returned (the sliding-window KV write: ``out.index_copy_(0, out_rows, y.to(out.dtype))``).
    A backend whose rms_norm kernel has this fused form (``impl.rope_epilogue``) runs it in one launch; otherwise
    the ops run in sequence.
    """
    if (out is None) != (out_rows is None):
        raise ValueError("rms_norm_rope: out and out_rows go together (the pool and the rows to write)")
    if positions.shape != x.shape[:1]:
        raise ValueError(f"rms_norm_rope: positions {tuple(positions.shape)} must be [T] = [{x.shape[0]}]")
    if out is not None:
        if out_rows.shape != x.shape[:1]:
            raise ValueError(f"rms_norm_rope: out_rows {tuple(out_rows.shape)} must be [T] = [{x.shape[0]}]")
        if out.shape[1:] != x.shape[1:]:
            raise ValueError(f"rms_norm_rope: out rows {tuple(out.shape[1:])} must have x's row shape "
                             f"{tuple(x.shape[1:])}")
    fused = getattr(resolve("rms_norm", x), "rope_epilogue", None)
    if fused is not None:
        return fused(x, weight, eps, positions, inv_freq, out, out_rows)
    return rms_norm_rope_in_sequence(x, weight, eps, positions, inv_freq, out, out_rows)


def rms_norm_rope_in_sequence(x, weight, eps, positions, inv_freq, out=None, out_rows=None):
    """:func:`rms_norm_rope` as the ops in sequence (the specification; a backend's fallback for layouts its fused
    kernel does not take). Arguments as there, unchecked."""
    y = apply_rope(rms_norm(x, weight, eps), positions, inv_freq)
    if out is None:
        return y
    out.index_copy_(0, out_rows, y.to(out.dtype))
    return None


def hc_pre(x, fn, base, scale, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    """mHC collapse (ascend_dsv4/models/deepseek_v4/README.md §2.2 steps 1-3).

    x: [T, N, d] streams; fn: [(2+N)N, N*d] fp32; base: [(2+N)N]; scale: [3].
    m = (flat(x) @ fn^T) * rsqrt(mean(flat(x)^2) + norm_eps)        (fp32)
    pre_j = sigmoid(scale0 m_j + base_j) + hc_eps; post_j = 2 sigmoid(scale1 m_{N+j} + base_{N+j})
    comb = row-softmax(scale2 m_{2N:} + base_{2N:}) + hc_eps, then column-normalised, then
    (sinkhorn_iters - 1) times row- then column-normalised (each with + hc_eps in the denominator).
    Returns u = sum_j pre_j x_j ([T, d], x.dtype), post [T, N] fp32, comb [T, N, N] fp32.
    """
    return resolve("hc_pre", x)(x, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)


def hc_post(y, x, post, comb):
    """mHC expand: out_k = post_k * y + sum_j comb[j, k] * x_j (comb applied transposed).

    y: [T, d]; x: [T, N, d]; post: [T, N]; comb: [T, N, N]. Computed in fp32, returned in x.dtype.
    """
    return resolve("hc_post", x)(y, x, post, comb)


def hc_head(x, fn, base, scale, hc_eps: float, norm_eps: float):
    """Final stream collapse (ascend_dsv4/models/deepseek_v4/README.md §2.5): pre = sigmoid(m * scale + base) +
    hc_eps with
    m = (flat(x) @ fn^T) * rsqrt(mean(flat(x)^2) + norm_eps); returns sum_j pre_j x_j ([T, d], x.dtype).

    x: [T, N, d]; fn: [N, N*d]; base: [N]; scale: [1].
    """
    return resolve("hc_head", x)(x, fn, base, scale, hc_eps, norm_eps)


def compressor_pool(kv_state: torch.Tensor, score_state: torch.Tensor, cand: torch.Tensor, overlap: bool) -> torch.Tensor:
    """Pool compressed KV entries from per-token compressor rows (ascend_dsv4/models/deepseek_v4/README.md §2.3
    "Compressor").

    kv_state, score_state: [S, W] float32 rows, one per token (a = wkv x_t; z = wgate x_t + ape[t mod r]).
    cand: [M, K] int64 row indices of each entry's candidate tokens in token order, -1 = absent.
    Without overlap (ratio 128): K = r, W = c; entry[ch] = sum_k softmax_k(z_k[ch]) a_k[ch].
    With overlap (ratio 4): K = 2r, W = 2c; candidates 0..r-1 (the previous block) use channels [:c]
    (A half), candidates r..2r-1 (the current block) use channels [c:] (B half); one softmax over all 2r
    per channel. Absent candidates get score -inf (entry 0 of a sequence has no previous block).
    Returns [M, c] float32 (before the compressor's RMSNorm and RoPE).
    """
    return resolve("compressor_pool", kv_state)(kv_state, score_state, cand, overlap)


def compressor_entries(kv_state: torch.Tensor, score_state: torch.Tensor, cand: torch.Tensor, overlap: bool,
                       norm_weight: torch.Tensor | None, norm_eps: float, positions: torch.Tensor,
                       inv_freq: torch.Tensor, dtype: torch.dtype, out: torch.Tensor, out_rows: torch.Tensor) -> None:
    """The compressor's entry path (ascend_dsv4/models/deepseek_v4/README.md §2.3 "Compressor"): pool, RMSNorm,
    RoPE and the store into the entry pool, in place. Exactly the sequence

        e = compressor_pool(kv_state, score_state, cand, overlap).to(dtype)   # [M, c] float32 -> dtype
        e = rms_norm(e, norm_weight, norm_eps)                                # float32 inside, result in dtype
        e = apply_rope(e, positions, inv_freq)                                # last R channels, result in dtype
        out.index_copy_(0, out_rows, e.to(out.dtype))

    kv_state, score_state, cand, overlap: as :func:`compressor_pool` (rows float32 or bfloat16; cand [M, K]).
    norm_weight: [c] float32 or None; positions: [M] int64 (each entry's RoPE position); inv_freq: [R/2] float32
    with R <= c; dtype: the model's activation dtype (the roundings between the ops); out: [S, c] entry pool (any
    float dtype); out_rows: [M] int64 distinct valid rows of out. An entry whose candidates are all absent has no
    defined value (NaN in the reference) but its row is still written. Returns None; M == 0 is a no-op.
    A backend whose compressor_pool kernel has this epilogue (``impl.entries_epilogue``) runs it in one launch
    (five on CUDA otherwise); other backends run the ops in sequence.
    """
    if cand.dim() != 2 or kv_state.dim() != 2 or score_state.shape != kv_state.shape:
        raise ValueError(f"compressor_entries: cand {tuple(cand.shape)} must be [M, K] and kv_state "
                         f"{tuple(kv_state.shape)} / score_state {tuple(score_state.shape)} the same [S, W]")
    m = cand.shape[0]
    c = kv_state.shape[1] // 2 if overlap else kv_state.shape[1]
    if out_rows.shape != (m,):
        raise ValueError(f"compressor_entries: out_rows {tuple(out_rows.shape)} must be [M] = [{m}]")
    if positions.shape != (m,):
        raise ValueError(f"compressor_entries: positions {tuple(positions.shape)} must be [M] = [{m}]")
    if out.dim() != 2 or out.shape[1] != c:
        raise ValueError(f"compressor_entries: out {tuple(out.shape)} must be [S, c] with c = {c} (the entry width)")
    if norm_weight is not None and norm_weight.shape != (c,):
        raise ValueError(f"compressor_entries: norm_weight {tuple(norm_weight.shape)} must be [c] = [{c}]")
    if inv_freq.dim() != 1 or 2 * inv_freq.shape[0] > c:
        raise ValueError(f"compressor_entries: inv_freq {tuple(inv_freq.shape)} must be [R/2] with R <= c = {c}")
    if m == 0:
        return None
    impl = resolve("compressor_pool", kv_state)
    fused = getattr(impl, "entries_epilogue", None)
    if fused is not None:
        return fused(kv_state, score_state, cand, overlap, norm_weight, norm_eps, positions, inv_freq, dtype, out,
                     out_rows)
    return compressor_entries_in_sequence(kv_state, score_state, cand, overlap, norm_weight, norm_eps, positions,
                                          inv_freq, dtype, out, out_rows)


def compressor_entries_in_sequence(kv_state, score_state, cand, overlap, norm_weight, norm_eps, positions, inv_freq,
                                   dtype, out, out_rows) -> None:
    """:func:`compressor_entries` as the ops in sequence (the specification; a backend's fallback where its fused
    kernel does not apply). Arguments as there, unchecked."""
    e = compressor_pool(kv_state, score_state, cand, overlap).to(dtype)
    rms_norm_rope_in_sequence(e, norm_weight, norm_eps, positions, inv_freq, out, out_rows)


def compressor_state_write(kv_state: torch.Tensor, score_state: torch.Tensor, a: torch.Tensor, z: torch.Tensor,
                           ape: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
    """Write a step's compressor rows into the per-token state pools, in place (ascend_dsv4/models/deepseek_v4/
    README.md §2.3 "Compressor": a_t = wkv x_t, z_t = wgate x_t + ape[t mod r]).

    kv_state, score_state: [S, W] pools (float32 in the model); a, z: [T, W] float32 (rows may be strided: the two
    halves of one stacked GEMM's output); ape: [r, W] float32; positions: [T] integer absolute positions (>= 0);
    slots: [T] int64 pool rows (distinct, as for ``index_copy_``).
    kv_state[slots[t]] = a[t]; score_state[slots[t]] = z[t] + ape[positions[t] mod r] (float32 add), both cast to
    the pool's dtype. Returns None. One launch on CUDA where the model wrote it as five (mod, gather, add, two
    index copies) -- scripts/bench_results/decode_h100_session7.txt.
    """
    t = slots.shape[0]
    if a.shape != z.shape or a.dim() != 2 or a.shape[0] != t or positions.shape != (t,):
        raise ValueError(f"compressor_state_write: a {tuple(a.shape)} and z {tuple(z.shape)} must be the same [T, W] "
                         f"with positions {tuple(positions.shape)} and slots {tuple(slots.shape)} of [T]")
    if ape.dim() != 2 or ape.shape[1] != a.shape[1] or kv_state.shape[1:] != a.shape[1:] or \
            score_state.shape != kv_state.shape:
        raise ValueError(f"compressor_state_write: ape {tuple(ape.shape)} must be [r, W] and the pools "
                         f"{tuple(kv_state.shape)} / {tuple(score_state.shape)} [S, W] for rows of width {a.shape[1]}")
    return resolve("compressor_state_write", a)(kv_state, score_state, a, z, ape, positions, slots)


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, cand: torch.Tensor, topk: int) -> torch.Tensor:
    """Lightning-indexer selection (ascend_dsv4/models/deepseek_v4/README.md §2.3 "CSA Indexer").

    q: [T, Hi, Di]; weights: [T, Hi] (already scaled by Di^-1/2 Hi^-1/2); k_cache: [P, Di] rows;
    cand: [T, N] int64 rows of k_cache that token t may see (causal entries), -1 = padding.
    score(t, n) = sum_h weights[t, h] * ReLU(q[t, h] . k_cache[cand[t, n]])   (float32)
    Returns [T, min(topk, N)] int64: the k_cache rows of the top-scoring candidates, -1 where a token has
    fewer valid candidates than that. Equal scores are taken in candidate order (the reference sorts stably), so
    a selection does not depend on padding; other backends must break ties the same way.
    """
    return resolve("indexer_topk", q)(q, weights, k_cache, cand, topk)


def sparse_attention(q, kv, idx, sink, scale: float, extra_kv=None, extra_idx=None):
    """One-softmax attention over gathered K=V rows plus a per-head sink (ascend_dsv4/models/deepseek_v4/README.md
    §2.3).

    q: [T, H, D]; kv: [P, D] rows (K = V); idx: [T, K] int64 rows of kv, -1 ignored;
    optional extra_kv: [P2, D] with extra_idx: [T, K2] (the compressed entries; same softmax).
    s_j = scale * q_h . v_j; p_j = exp(s_j) / (sum_j exp(s_j) + exp(sink_h)); o_h = sum_j p_j v_j.
    sink: [H] float32. Computed in float32, returned in q.dtype. A row with no valid key returns 0.
    """
    return resolve("sparse_attention", q)(q, kv, idx, sink, scale, extra_kv, extra_idx)


def moe_gate(x, weight, bias, topk: int, route_scale: float, tid2eid=None, token_ids=None,
             score_func: str = "sqrtsoftplus", n_groups: int = 1, topk_groups: int = 1, normalize: bool = True):
    """DeepSeek router (V4 ascend_dsv4/models/deepseek_v4/README.md §2.4; V3 group-limited routing).

    x: [T, d]; weight: [E, d]; bias: [E] or None (aux-loss-free correction, used only for selection);
    tid2eid: [V, k] int table for hash layers with token_ids: [T].
    scores = f(x @ weight^T) in float32, f = sqrt(softplus) (V4), sigmoid (V3) or softmax.
    Selection: tid2eid[token_ids] in hash layers; otherwise top-k of scores + bias, restricted (when
    ``n_groups > 1``) to the ``topk_groups`` expert groups whose two best biased scores sum highest.
    weights = scores[sel], divided by their sum when ``normalize``, times route_scale.
    Returns (weights [T, k] float32, expert ids [T, k] int64).
    """
    return resolve("moe_gate", x)(x, weight, bias, topk, route_scale, tid2eid, token_ids, score_func, n_groups,
                                  topk_groups, normalize)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, row_scale: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """h = silu(min(gate, limit)) * clamp(up, -limit, limit) in float32 (no clamp when limit <= 0); then, if given,
    h * row_scale[..., None] (float32: the MoE routing weight of each row) and h rounded to ``out_dtype``.

    gate, up: [..., I] any float dtype; row_scale: [...] float32. Returns [..., I], float32 or ``out_dtype``.
    A backend whose kernel takes the scale and the output dtype itself (``impl.fuses_row_scale``) gets them (one
    launch); otherwise the multiply and the rounding follow the kernel as torch ops.
    """
    if row_scale is not None and row_scale.shape != gate.shape[:-1]:
        raise ValueError(f"swiglu: row_scale {tuple(row_scale.shape)} must have gate's row shape "
                         f"{tuple(gate.shape[:-1])} (one routing weight per row)")
    impl = resolve("swiglu", gate)
    if (row_scale is not None or out_dtype is not None) and getattr(impl, "fuses_row_scale", False):
        return impl(gate, up, limit, row_scale, out_dtype)
    h = impl(gate, up, limit)
    if row_scale is not None:
        h = h * row_scale.unsqueeze(-1)
    return h if out_dtype is None else h.to(out_dtype)


def linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None = None, fmt: str = "dense",
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ W^T for a weight stored as ``fmt``:

    - ``dense``: w [N, K] in any float dtype (w_scale None);
    - ``fp8_block``: w float8_e4m3fn [N, K], w_scale [ceil(N/128), ceil(K/128)] float32 or E8M0 (uint8):
      W[i, j] = w[i, j] * s[i // 128, j // 128];
    - ``fp4``: w int8 [N, K/2], two e2m1 codes per byte (element 2c in the low nibble), w_scale E8M0 (uint8)
      [N, K/32]: W[i, j] = e2m1(code) * 2^(s[i, j // 32] - 127).
    x: [M, K]. Accumulates in float32 unless dense weight and x share a dtype; returns x.dtype [M, N].
    Activation rounding (reference numerics) is the caller's job (``fp8_act_round``).
    ``out_dtype=torch.float32`` with a 16-bit x: the float32-compute form of the official model's head and
    compressor projections, ``linear(x.float(), ...)`` (the upcast is exact). A backend whose kernel takes the
    16-bit input itself (``impl.float32_from_16bit``: BF16 x BF16 products are exact in float32) runs it without
    the upcast copy.
    """
    impl = resolve("linear", x)
    if out_dtype is not None and out_dtype != x.dtype:
        if out_dtype != torch.float32:
            raise ValueError(f"linear: out_dtype {out_dtype} is not supported; expected None or torch.float32 "
                             f"(the float32-compute form)")
        fused = getattr(impl, "float32_from_16bit", None)
        if fused is not None:
            return fused(x, w, w_scale, fmt)
        x = x.float()
    return impl(x, w, w_scale, fmt)


def group_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None = None,
                 fmt: str = "dense") -> torch.Tensor:
    """Per-group (per-head) projection: out[t, g] = x[t, g] @ w[g]^T.

    x: [T, G, K]; w: [G, N, K] (any strides: a transposed view of a [G, K, N] weight works). The DeepSeek-V4
    grouped output projection ``wo_a`` (G = o_groups) and the DeepSeek-V3 absorbed-MLA ``W_UK`` / ``W_UV``
    products (G = heads). Same dtypes: computed in that dtype with float32 accumulation; otherwise in float32.
    ``fmt="fp8_block"``: w is e4m3 [G, N, K] with w_scale [G, ceil(N/128), K/128] (float32 or E8M0), the weight
    each group stands for being its dequantised matrix (:func:`dequantize_weight`) rounded to x's dtype -- what
    a loader that dequantises the FP8 checkpoint weight gives (exact for E8M0 scales), so both storages give the
    same results (DeepSeek-V4's ``wo_a``, stored back in FP8 on CUDA by ``parallel.linear.compact_fp8_weights_``
    with ``ASCEND_DSV4_WO_A_FP8=1``).
    Returns x.dtype [T, G, N].
    """
    if fmt not in ("dense", "fp8_block"):
        raise ValueError(f"group_linear: fmt must be 'dense' or 'fp8_block', got {fmt!r}")
    if fmt == "dense":
        return resolve("group_linear", x)(x, w)
    if w.dim() != 3:
        raise ValueError(f"group_linear: fp8_block weight w must be [G, N, K], got shape {tuple(w.shape)}")
    g, n, k = w.shape
    want = (g, -(-n // 128), -(-k // 128))
    if w_scale is None or tuple(w_scale.shape) != want:
        got = None if w_scale is None else tuple(w_scale.shape)
        raise ValueError(f"group_linear: fp8_block w_scale must be {want} ([G, ceil(N/128), ceil(K/128)] for w "
                         f"{tuple(w.shape)}), got {got}")
    return resolve("group_linear", x)(x, w, w_scale, fmt)


def dequantize_weight(w: torch.Tensor, w_scale: torch.Tensor | None = None, fmt: str = "dense") -> torch.Tensor:
    """The float32 matrix W of a weight stored as ``fmt`` (the formats and the math of :func:`linear`).

    w: [N, K] (``dense``, ``fp8_block``) or int8 [N, K/2] (``fp4``), w_scale as in :func:`linear`; returns
    float32 [N, K] on w's device. What a loader calls to convert a weight at load time (``dequantize=True``,
    layers that compute in float32) and what a backend without a kernel for a format falls back to.
    """
    return resolve("dequantize_weight", w)(w, w_scale, fmt)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor, w_scale: torch.Tensor | None = None,
                   fmt: str = "dense") -> torch.Tensor:
    """Per-row expert matmul: out[m] = x[m] @ W[expert_ids[m]]^T.

    x: [M, K]; w: [E, N, K] (or [E, N, K/2] packed FP4) with w_scale [E, ...] as in :func:`linear`;
    expert_ids: [M] int64 in [0, E]; a row of id E (no expert here: the capture-safe expert-parallel path marks
    the rows of other ranks' experts so, ``layers/experts.py`` ``ep_static_rows``) comes out as zeros.
    Accumulates in float32, returns x.dtype [M, N].
    """
    return resolve("grouped_matmul", x)(x, w, expert_ids, w_scale, fmt)


def fp8_act_round(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """FP8-e4m3 quantise -> dequantise per ``block`` channels of the last dim (official ``act_quant``).

    amax = max(|x_block|, 1e-4); s = 2^ceil(log2(amax / 448)) (UE8M0 scale);
    y = e4m3(clamp(x / s, -448, 448)) * s. Returns x.dtype.
    """
    return resolve("fp8_act_round", x)(x, block)


def fp4_act_round(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP4-e2m1 quantise -> dequantise per ``block`` channels (official ``fp4_act_quant``).

    amax = max(|x_block|, 6 * 2^-126); s = 2^ceil(log2(amax / 6)); y = e2m1_rne(clamp(x / s, -6, 6)) * s
    with the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} and ties to the even code. Returns x.dtype.
    """
    return resolve("fp4_act_round", x)(x, block)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Sylvester-Walsh-Hadamard transform of the last dim (size a power of two):
    y = x @ H_n / sqrt(n), computed in float32, returned in x.dtype."""
    return resolve("hadamard", x)(x)


def mla_decode(q_nope_absorbed: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, idx: torch.Tensor,
               scale: float) -> torch.Tensor:
    """Multi-head Latent Attention, absorbed form over a latent cache (DeepSeek-V2/V3 MLA, decode).

    The "Absorbed + MoveElision" MLA: the cache holds one latent row per token, shared by all heads;
    W_UK is already folded into the query and W_UV (then o_proj) is applied by the caller to the output.

    q_nope_absorbed: [T, H, C] with C = kv_lora_rank: q_nope[t, h] @ W_UK[h] (W_UK[h]: [Dn, C]);
    q_pe: [T, H, R] with R = qk_rope_head_dim, RoPE already applied;
    latent: [P, C + R] rows of a paged latent pool, row = [c_kv (C, after kv_a_layernorm) | k_pe (R, RoPE
    applied)]; idx: [T, L] int64 rows of ``latent`` that token t attends to, -1 = padding (ignored; the
    padded slots never read the pool, so NaN in unreferenced rows cannot leak); scale: softmax scale
    (DeepSeek: (Dn + R)^-1/2, times the YaRN mscale^2 where used).

    With c = latent[:, :C] and k_pe = latent[:, C:], in float32:
        score[t, h, l] = scale * (q_nope_absorbed[t, h] . c[idx[t, l]] + q_pe[t, h] . k_pe[idx[t, l]])
    (two separate dot products added: no concatenation of q or k), p = softmax over the valid l,
        out[t, h] = sum_l p[t, h, l] * c[idx[t, l]].
    Returns [T, H, C] in q_nope_absorbed.dtype; the attention output of head h is out[t, h] @ W_UV[h]^T
    (W_UV[h]: [Dv, C]). A token with no valid index (or L = 0) returns 0; T = 0 gives an empty result.
    """
    return resolve("mla_decode", q_nope_absorbed)(q_nope_absorbed, q_pe, latent, idx, scale)


def mla_decode_split(q_nope_absorbed: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                     idx: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`mla_decode` over a latent pool kept as two caches (the layout ``npu_fused_infer_attention_score``'s
    paged MLA form reads: ``atb_ops.layout.KVLayout.mla_split_rope``): ``c_kv`` [P, C] and ``k_pe`` [P, R] with
    row p of both = pool row p. The math is exactly ``mla_decode(q_nope_absorbed, q_pe, cat([c_kv, k_pe], -1),
    idx, scale)``; shapes and dtypes as there. Returns [T, H, C] in q_nope_absorbed.dtype.
    """
    return resolve("mla_decode_split", q_nope_absorbed)(q_nope_absorbed, q_pe, c_kv, k_pe, idx, scale)


def mla_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                idx: torch.Tensor, scale: float) -> torch.Tensor:
    """Multi-head Latent Attention, decompressed form ("CacheDecompressed" MLA, e.g. prefill).

    q_nope: [T, H, Dn]; q_pe: [T, H, R] (RoPE applied); k_nope: [S, H, Dn] (= c_kv @ W_UK^T per head);
    k_pe: [S, R] (RoPE applied, shared by all heads); v: [S, H, Dv] (= c_kv @ W_UV^T per head);
    idx: [T, L] int64 rows of the S keys that token t attends to, -1 = padding (ignored, never read).
    In float32:
        score[t, h, l] = scale * (q_nope[t, h] . k_nope[idx[t, l], h] + q_pe[t, h] . k_pe[idx[t, l]])
    p = softmax over the valid l; out[t, h] = sum_l p[t, h, l] * v[idx[t, l], h].
    Returns [T, H, Dv] in q_nope.dtype. A token with no valid index (or L = 0) returns 0. Equal to
    :func:`mla_decode` (q_nope absorbed through W_UK) followed by W_UV, up to rounding.
    """
    return resolve("mla_prefill", q_nope)(q_nope, q_pe, k_nope, k_pe, v, idx, scale)


def quant_linear(x: torch.Tensor, weight: torch.Tensor, mode: str, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 offset: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
                 input_offset: torch.Tensor | None = None, group_size: int = 0) -> torch.Tensor:
    """Integer-path quantised linear with NPU-layout parameters (msModelSlim checkpoints after
    ``quant.msmodelslim.npu_params`` conversion). x: [M, K] float; weight: int8 [K, N] (``x2`` layout), or for
    ``weight_only`` also int4 packed 8 per int32 [K, N/8] (element 0 in bits 0-3). Returns [M, N] in x.dtype.

    - ``dynamic`` (W8A8_DYNAMIC, W4A8 per channel): per-token symmetric quant ``s_t = max|x_t| / 127``,
      ``q = round(x / s_t)`` (half to even; a zero row gives 0); ``y = (q @ W) * scale[n] * s_t + bias``;
      scale float32 [N], bias float [N] or None.
    - ``static`` (W8A8, W8A8S, W8A8_MIX decode): ``q = clamp(round(x * (1 / input_scale) + input_offset), -128,
      127)`` (the offset added before rounding; multiplied by the float32 reciprocal, as the NPU quantiser does);
      ``y = float32(q @ W + bias) * deq`` with bias = ``quant_bias`` int32 [N] and scale = ``deq_scale``:
      int64 words holding float32 bits in the low 32 bits, or float32 [N].
    - ``weight_only`` (W8A16, W4A16): ``y = x @ ((W + offset) * scale) + bias``, the NPU antiquant form (offset =
      the negated checkpoint zero point), scale / offset [N] per channel or [G, N] with ``group_size`` = K / G.

    Integer products are exact (accumulated in int64 here; the NPU accumulates in int32: a sum outside the
    int32 range raises).
    """
    return resolve("quant_linear", x)(x, weight, mode, scale, bias, offset, input_scale, input_offset, group_size)


def quant_grouped_matmul(x: torch.Tensor, weight: torch.Tensor, expert_ids: torch.Tensor,
                         scale: torch.Tensor) -> torch.Tensor:
    """Per-row expert matmul of the dynamic int path (msModelSlim W8A8_DYNAMIC / W4A8 per-channel experts):
    ``out[m] = quant_linear(x[m], weight[expert_ids[m]], "dynamic", scale[expert_ids[m]])``, i.e. per-token
    ``s_m = max|x_m| / 127``, ``q = round(x_m / s_m)``, ``out[m] = (q @ W_e) * scale[e] * s_m``.

    x: [M, K] float; weight: int8 [E, K, N] (``x2`` layout); expert_ids: [M] int64 in [0, E] (id E: a zero
    row, as in :func:`grouped_matmul`); scale: float32 [E, N]. Returns [M, N] in x.dtype.
    """
    return resolve("quant_grouped_matmul", x)(x, weight, expert_ids, scale)


def kv_quant(x: torch.Tensor, inv_scale: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """C8 KV-cache quantisation per channel: ``q = clamp(round(x * inv_scale + offset), -128, 127)`` int8
    (msModelSlim's ``kv_cache_scale`` s and ``kv_cache_offset`` o with ``inv_scale = 1 / s``: the quantiser
    multiplies by the reciprocal, as vllm-ascend ``_quantize_kv_to_int8`` does; ``round`` is half to even).
    The cache reads back ``(q - o) * s``.

    x: [..., C] float; inv_scale, offset: float32 [C] (offset integral, None = symmetric). Returns int8 [..., C].
    """
    return resolve("kv_quant", x)(x, inv_scale, offset)


def moe_permute(x: torch.Tensor, ids: torch.Tensor,
                num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the routed (token, slot) rows by expert: ``order = stable_argsort(ids.flatten())`` (flat index
    ``t * k + j``), returns ``(x[order // k], ids.flatten()[order], order)``.

    x: [T, d]; ids: [T, k] integer expert ids in [0, num_experts). Outputs: [T * k, d] in x.dtype, int64
    [T * k] ascending, int64 [T * k].
    """
    return resolve("moe_permute", x)(x, ids, num_experts)


def moe_unpermute(y: torch.Tensor, order: torch.Tensor, num_tokens: int, skip: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum the expert rows back per token: ``out[order[i] // k] += y[i]`` with ``k = len(order) / num_tokens``
    (the inverse of :func:`moe_permute`'s grouping; routing weights are applied by the caller), then
    ``out += skip`` (float32, after the rows: the official MoE's ``routed + shared`` order) and one rounding to
    ``out_dtype``. ``skip`` is the shared expert's output, as ``npu_moe_finalize_routing``'s ``skip1``: the MoE's
    sum and its rounding in this op instead of two more kernels.

    y: [T * k, d] float; order: int64 [T * k] from :func:`moe_permute`; skip: [num_tokens, d] float or None.
    Returns [num_tokens, d] in ``out_dtype`` (default float32).
    """
    if skip is not None and tuple(skip.shape) != (num_tokens, y.shape[-1]):
        raise ValueError(f"moe_unpermute: skip {tuple(skip.shape)} must be [num_tokens, d] = "
                         f"{(num_tokens, y.shape[-1])} (one row per token, the rows' width)")
    return resolve("moe_unpermute", y)(y, order, num_tokens, skip, out_dtype)
