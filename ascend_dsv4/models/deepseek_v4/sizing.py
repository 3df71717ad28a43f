"""Sizes of a DeepSeek-V4 model: parameters, checkpoint bytes, KV bytes per token, memory plans.

Everything here is a pure function of a :class:`~ascend_dsv4.config.DeepseekV4Config` (no torch).

**Tensor inventory** (README.md §3.1). :func:`tensor_inventory` lists every tensor of the published checkpoint with
its official name, shape, safetensors dtype and a group. With ``dtype="fp8"`` and ``expert_dtype="fp4"`` it
reproduces the published files exactly: Flash 69,187 tensors / 159,609,485,896 B, Pro 145,116 tensors /
864,704,792,696 B (same dtype histograms as README.md §3.1). Per layer ``i`` (``d`` = dim, ``H`` = n_heads,
``D`` = head_dim, ``q`` = q_lora_rank, ``G`` = o_groups, ``o`` = o_lora_rank, ``N`` = hc_mult, ``E`` experts of
width ``I``, ``Di``/``Hi`` = index_head_dim/index_n_heads, ``k`` = 2 for ratio 4 else 1)::

    attn_norm, ffn_norm [d]; hc_{attn,ffn}_fn [(2+N)N, Nd], _base [(2+N)N], _scale [3]
    attn.wq_a [q,d]  q_norm [q]  wq_b [HD,q]  wkv [D,d]  kv_norm [D]  wo_a [Go, HD/G]  wo_b [d, Go]  attn_sink [H]
    ratio>0: compressor.wkv, .wgate [kD, d]; compressor.ape [r, kD]; compressor.norm [D]
    ratio 4: indexer.wq_b [Hi*Di, q]; indexer.weights_proj [Hi, d]; indexer.compressor.wkv/.wgate [2Di, d];
             indexer.compressor.ape [4, 2Di]; indexer.compressor.norm [Di]
    ffn.gate.weight [E,d]; hash layers: ffn.gate.tid2eid [vocab, n_activated] (I64), else ffn.gate.bias [E]
    ffn.experts.e.w1/w3 [I,d], w2 [d,I] for e < E; ffn.shared_experts.w1/w3 [I,d], w2 [d,I]
    top level: embed, head [vocab,d]; norm [d]; hc_head_fn [N, Nd], hc_head_base [N], hc_head_scale [1]
    mtp.j: one ratio-0 layer (never hash-routed: gate has bias) + e_proj, h_proj [d,d]; enorm, hnorm, norm [d];
           hc_head_fn/base/scale (embedding and head are shared with the main model: no mtp copies)

Formats: FP8 linears (wq_a, wq_b, wkv, wo_a, wo_b, indexer.wq_b, shared experts, e_proj/h_proj) are F8_E4M3 with an
F8_E8M0 scale ``[ceil(out/128), ceil(in/128)]`` when ``cfg.dtype == "fp8"``, else BF16 without scale. Routed
experts follow ``cfg.expert_dtype`` (``None`` = like ``cfg.dtype``): FP4 = I8 ``[out, in/2]`` (two e2m1 codes per
byte) + E8M0 scale ``[out, in/32]``; FP8 as above; BF16. Norm weights, gate.weight, compressor / indexer-compressor
wkv/wgate, indexer.weights_proj, embed and head are BF16; hc_*, ape, attn_sink and gate.bias are F32.

**Parameter-count convention** (reproduces README.md §1.3 "logical params incl. MTP" for both Flash,
290,942,289,362, and Pro, 1,598,837,347,742, exactly): every tensor of the inventory counts its logical number of
elements (a packed-FP4 ``[out, in/2]`` tensor counts ``out*in``), *including* hc_* fn/base/scale, ``ape``,
``attn_sink``, ``gate.bias`` and all norm weights, and *excluding* the quantisation ``scale`` tensors and the
``tid2eid`` hash-routing tables (int64 lookup tables, not parameters). MTP has no embedding/head of its own.
"""

from __future__ import annotations

import math

from ...errors import RequestError
from ..sizing import TensorSpec, fmt_bytes as _gib, fmt_ids as _ids, fmt_params as _params
from .config import DeepseekV4Config

KINDS = ("swa", "csa", "hca", "mtp")

def layer_counts(cfg: DeepseekV4Config) -> dict[str, int]:
    """Number of layers of each kind: backbone 'swa' / 'csa' / 'hca' and the 'mtp' layers (all SWA-only)."""
    out = {k: len(cfg.layers_of_kind(k)) for k in ("swa", "csa", "hca")}
    out["mtp"] = cfg.n_mtp_layers
    return out


def _expert_format(cfg: DeepseekV4Config) -> str:
    return cfg.expert_dtype or cfg.dtype


def tensor_inventory(cfg: DeepseekV4Config, include_mtp: bool = True) -> list[TensorSpec]:
    """Every tensor of the checkpoint described by ``cfg`` (see the module docstring for names and formats)."""
    d, H, D, N = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.hc_mult
    mix = (2 + N) * N
    out: list[TensorSpec] = []

    def add(name, shape, dtype, group, **kw):
        out.append(TensorSpec(name, tuple(shape), dtype, group, **kw))

    def linear(name, o, i, group, fmt, count=1):
        """A linear weight [o, i] in checkpoint format ``fmt`` ('fp8' | 'fp4' | 'bf16') plus its scale."""
        if fmt == "fp8":
            add(name + ".weight", (o, i), "F8_E4M3", group, count=count)
            add(name + ".scale", (-(-o // 128), -(-i // 128)), "F8_E8M0", group, count=count, scale=True)
        elif fmt == "fp4":
            add(name + ".weight", (o, i // 2), "I8", group, count=count, packed_fp4=True)
            add(name + ".scale", (o, i // 32), "F8_E8M0", group, count=count, scale=True)
        else:
            add(name + ".weight", (o, i), "BF16", group, count=count)

    def block(p: str, lid: int, mtp: bool) -> None:
        g = (lambda name: "mtp") if mtp else (lambda name: name)
        r = cfg.compress_ratios[lid]
        add(p + "attn_norm.weight", (d,), "BF16", g("norms"))
        add(p + "ffn_norm.weight", (d,), "BF16", g("norms"))
        for f in ("attn", "ffn"):
            add(p + f"hc_{f}_fn", (mix, N * d), "F32", g("hc"))
            add(p + f"hc_{f}_base", (mix,), "F32", g("hc"))
            add(p + f"hc_{f}_scale", (3,), "F32", g("hc"))
        a = p + "attn."
        linear(a + "wq_a", cfg.q_lora_rank, d, g("attention"), cfg.dtype)
        add(a + "q_norm.weight", (cfg.q_lora_rank,), "BF16", g("attention"))
        linear(a + "wq_b", H * D, cfg.q_lora_rank, g("attention"), cfg.dtype)
        linear(a + "wkv", D, d, g("attention"), cfg.dtype)
        add(a + "kv_norm.weight", (D,), "BF16", g("attention"))
        linear(a + "wo_a", cfg.o_groups * cfg.o_lora_rank, H * D // cfg.o_groups, g("attention"), cfg.dtype)
        linear(a + "wo_b", d, cfg.o_groups * cfg.o_lora_rank, g("attention"), cfg.dtype)
        add(a + "attn_sink", (H,), "F32", g("attention"))
        if r:
            k = 2 if r == 4 else 1
            c = a + "compressor."
            add(c + "wkv.weight", (k * D, d), "BF16", g("compressor"))
            add(c + "wgate.weight", (k * D, d), "BF16", g("compressor"))
            add(c + "ape", (r, k * D), "F32", g("compressor"))
            add(c + "norm.weight", (D,), "BF16", g("compressor"))
        if r == 4:
            Di, Hi = cfg.index_head_dim, cfg.index_n_heads
            ix = a + "indexer."
            linear(ix + "wq_b", Hi * Di, cfg.q_lora_rank, g("indexer"), cfg.dtype)
            add(ix + "weights_proj.weight", (Hi, d), "BF16", g("indexer"))
            add(ix + "compressor.wkv.weight", (2 * Di, d), "BF16", g("indexer"))
            add(ix + "compressor.wgate.weight", (2 * Di, d), "BF16", g("indexer"))
            add(ix + "compressor.ape", (4, 2 * Di), "F32", g("indexer"))
            add(ix + "compressor.norm.weight", (Di,), "BF16", g("indexer"))
        E, I = cfg.n_routed_experts, cfg.moe_inter_dim
        add(p + "ffn.gate.weight", (E, d), "BF16", g("router"))
        if not mtp and cfg.is_hash_layer(lid):
            add(p + "ffn.gate.tid2eid", (cfg.vocab_size, cfg.n_activated_experts), "I64", g("router"), table=True)
        else:
            add(p + "ffn.gate.bias", (E,), "F32", g("router"))
        ef = _expert_format(cfg)
        for w, (o, i) in (("w1", (I, d)), ("w3", (I, d)), ("w2", (d, I))):
            linear(p + f"ffn.experts.{{e}}.{w}", o, i, g("experts"), ef, count=E)
        for _ in range(cfg.n_shared_experts):
            for w, (o, i) in (("w1", (I, d)), ("w3", (I, d)), ("w2", (d, I))):
                linear(p + f"ffn.shared_experts.{w}", o, i, g("shared_experts"), cfg.dtype)

    add("embed.weight", (cfg.vocab_size, d), "BF16", "embed")
    add("head.weight", (cfg.vocab_size, d), "BF16", "head")
    add("norm.weight", (d,), "BF16", "norms")
    add("hc_head_fn", (N, N * d), "F32", "hc")
    add("hc_head_base", (N,), "F32", "hc")
    add("hc_head_scale", (1,), "F32", "hc")
    for i in range(cfg.n_layers):
        block(f"layers.{i}.", i, mtp=False)
    if include_mtp:
        for j in range(cfg.n_mtp_layers):
            p = f"mtp.{j}."
            block(p, cfg.n_layers + j, mtp=True)
            linear(p + "e_proj", d, d, "mtp", cfg.dtype)
            linear(p + "h_proj", d, d, "mtp", cfg.dtype)
            for n in ("enorm", "hnorm", "norm"):
                add(p + n + ".weight", (d,), "BF16", "mtp")
            add(p + "hc_head_fn", (N, N * d), "F32", "mtp")
            add(p + "hc_head_base", (N,), "F32", "mtp")
            add(p + "hc_head_scale", (1,), "F32", "mtp")
    return out


def param_count(cfg: DeepseekV4Config, include_mtp: bool = True) -> int:
    """Logical parameter count: Σ logical elements of every inventory tensor except scales and tid2eid
    (packed FP4 experts count as their logical ``[out, in]``). Convention in the module docstring; it gives
    README.md §1.3's Flash 290,942,289,362 and Pro 1,598,837,347,742 (MTP included)."""
    return sum(t.logical_numel for t in tensor_inventory(cfg, include_mtp) if t.is_param)


def param_breakdown(cfg: DeepseekV4Config) -> dict[str, int]:
    """Logical parameters per bucket; the values sum to ``param_count(cfg)``.

    Buckets: 'embed', 'head', 'attention' (wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, attn_sink),
    'compressor' (main compressor of CSA/HCA layers), 'indexer' (CSA indexer incl. its compressor),
    'router' (gate weight and bias), 'experts' (routed), 'shared_experts', 'hc' (mHC fn/base/scale of every
    layer and of the head), 'norms' (attn_norm, ffn_norm, final norm), 'mtp' (the whole MTP module(s)).
    """
    out = {k: 0 for k in ("embed", "head", "attention", "compressor", "indexer", "router", "experts",
                          "shared_experts", "hc", "norms", "mtp")}
    for t in tensor_inventory(cfg):
        if t.is_param:
            out[t.group] += t.logical_numel
    return out


def active_param_count(cfg: DeepseekV4Config, include_mtp: bool = False) -> int:
    """Parameters touched per token: all of :func:`param_count` except the routed experts, of which
    ``n_activated_experts / n_routed_experts`` (embedding included, MTP excluded by default)."""
    inv = [t for t in tensor_inventory(cfg, include_mtp) if t.is_param]
    experts = sum(t.logical_numel for t in inv if ".experts." in t.name)
    rest = sum(t.logical_numel for t in inv) - experts
    return rest + experts * cfg.n_activated_experts // cfg.n_routed_experts


def checkpoint_bytes(cfg: DeepseekV4Config, include_mtp: bool = True) -> int:
    """Bytes of the checkpoint tensors in the formats of ``cfg`` (weights, scales and tid2eid tables)."""
    return sum(t.nbytes for t in tensor_inventory(cfg, include_mtp))


# ---- KV cache ----------------------------------------------------------------------------------------

def production_entry_bytes(cfg: DeepseekV4Config) -> int:
    """Bytes of one head_dim-wide KV entry in the FlashMLA-style production layout (README.md §4.2):
    ``(head_dim - rope_head_dim)`` FP8 nope bytes + ``2 * rope_head_dim`` BF16 rope bytes + one E8M0 scale per
    64 nope channels, the scale bytes padded to a multiple of 8 (448 + 128 + 7 + 1 pad = 584 B for D=512)."""
    nope = cfg.head_dim - cfg.rope_head_dim
    scales = -(-nope // 64)
    return nope + 2 * cfg.rope_head_dim + 8 * -(-scales // 8)


def production_indexer_entry_bytes(cfg: DeepseekV4Config, indexer_fp8: bool = False) -> int:
    """Bytes of one indexer key: FP4 = ``index_head_dim/2`` + one E8M0 scale per 32 (64 + 4 = 68 B),
    FP8 = ``index_head_dim`` + one FP32 scale (128 + 4 = 132 B)."""
    Di = cfg.index_head_dim
    return Di + 4 if indexer_fp8 else Di // 2 + Di // 32


def kv_bytes_per_token(cfg: DeepseekV4Config, layout: str = "production", dtype_bytes: int = 2,
                       indexer_fp8: bool = False) -> dict[str, float]:
    """KV bytes that one more token of context adds, per ONE layer of each kind, and the model total.

    Keys 'swa', 'csa', 'hca', 'mtp' hold the bytes per token of a single layer of that kind; 'total' is
    ``Σ_kind layer_counts(cfg)[kind] * value[kind]``. The window (SWA rows) and the compressor state are a fixed
    per-sequence cost (:func:`fixed_bytes_per_sequence`), so SWA-only and MTP layers add 0 per token.

    * ``layout="production"`` (README.md §4.2, SGLang / FlashMLA): CSA = E/4 + Ei/4, HCA = E/128 with
      E = :func:`production_entry_bytes` (584 B) and Ei = :func:`production_indexer_entry_bytes` (68 B FP4,
      132 B with ``indexer_fp8``): CSA 163 B (179 B), HCA 4.5625 B; Flash 3,514.25 B/token (3,850.25),
      Pro 5,031.44 (5,511.44). ``dtype_bytes`` is ignored.
    * ``layout="pool"`` (our :class:`~ascend_dsv4.engine.kv_pools.V4KVPools`): CSA = (head_dim + index_head_dim)
      * dtype_bytes / 4 (``c4`` + ``c4_idx``), HCA = head_dim * dtype_bytes / 128 (``c128``). At BF16 this equals
      README.md §4.2's "reference BF16 buffers" column: CSA 320 B, HCA 8 B, Flash 6,880 B/token, Pro 9,848.
    """
    if layout == "production":
        e, ei = production_entry_bytes(cfg), production_indexer_entry_bytes(cfg, indexer_fp8)
        per = {"swa": 0.0, "csa": (e + ei) / 4, "hca": e / 128, "mtp": 0.0}
    elif layout == "pool":
        if dtype_bytes <= 0:
            raise ValueError(f"dtype_bytes must be positive, got {dtype_bytes!r}")
        per = {"swa": 0.0, "csa": (cfg.head_dim + cfg.index_head_dim) * dtype_bytes / 4,
               "hca": cfg.head_dim * dtype_bytes / 128, "mtp": 0.0}
    else:
        raise ValueError(f"layout must be 'production' or 'pool', got {layout!r}")
    n = layer_counts(cfg)
    per["total"] = sum(n[k] * per[k] for k in KINDS)
    return per


def token_row_bytes(cfg: DeepseekV4Config, dtype_bytes: int = 2) -> int:
    """Bytes of one token position in the token pages of our pools, summed over all layers:
    SWA row ``head_dim * dtype_bytes`` for each of the n_layers + n_mtp_layers layers; per CSA layer the float32
    compressor state ``(2D kv + 2D score) + (2Di kv + 2Di score)`` (main + indexer); per HCA layer ``D kv + D score``
    float32 (D = head_dim, Di = index_head_dim)."""
    n = layer_counts(cfg)
    D, Di = cfg.head_dim, cfg.index_head_dim
    swa = (cfg.n_layers + cfg.n_mtp_layers) * D * dtype_bytes
    return swa + n["csa"] * (4 * D + 4 * Di) * 4 + n["hca"] * 2 * D * 4


def live_token_span(cfg: DeepseekV4Config) -> int:
    """Most token positions a sequence keeps in the token pages during a decode step:
    ``L = max(window_size, 8 if the model has CSA layers, 128 if it has HCA layers)`` (the window including
    the new token; CSA's previous + open 4-blocks; HCA's open 128-block), from ``V4KVPools.keep_from``."""
    n = layer_counts(cfg)
    return max(cfg.window_size, 8 if n["csa"] else 0, 128 if n["hca"] else 0)


def _keep_from(cfg: DeepseekV4Config, num_tokens: int, has_csa: bool, has_hca: bool) -> int:
    # same rule as V4KVPools.keep_from (kept torch-free here; tests check the two agree)
    keep = num_tokens - cfg.window_size + 1
    if has_csa:
        keep = min(keep, 4 * (num_tokens // 4) - 4)
    if has_hca:
        keep = min(keep, 128 * (num_tokens // 128))
    return max(keep, 0)


def fixed_token_pages(cfg: DeepseekV4Config, block_size: int = 64) -> int:
    """Most token pages one decoding sequence holds: while the token at position ``n`` is written, pages
    ``keep_from(n) // B .. n // B`` are live, where ``keep_from`` is ``V4KVPools.keep_from``
    (``max(0, min(n - window + 1, 4*(n//4) - 4 [CSA], 128*(n//128) [HCA]))``). The maximum over ``n`` is taken
    over one full period ``lcm(B, 128)`` of positions past the warm-up; it is at most
    ``ceil((L - 1) / B) + 1`` for L = :func:`live_token_span`, and equal to it when the window sets L
    (Flash / Pro with B = 64: 3 pages)."""
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    n = layer_counts(cfg)
    has_csa, has_hca = n["csa"] > 0, n["hca"] > 0
    period = math.lcm(block_size, 128)
    start = period * (-(-(cfg.window_size + 256) // period))
    return max(p // block_size - _keep_from(cfg, p, has_csa, has_hca) // block_size + 1
               for p in range(start, start + period))


def fixed_bytes_per_sequence(cfg: DeepseekV4Config, dtype_bytes: int = 2, block_size: int = 64) -> int:
    """Fixed (context-independent) KV bytes our pools keep per decoding sequence:

        fixed_token_pages(cfg, block_size) * block_size * token_row_bytes(cfg, dtype_bytes)
        <= (ceil((L - 1) / B) + 1) * B * [ (n_layers + n_mtp) * D * dtype_bytes
                                           + n_csa * 4 (D + Di) * 4 + n_hca * 2 D * 4 ]

    with L = max(window_size, 8 for CSA, 128 for HCA) (equality when the window sets L, as in Flash / Pro;
    with HCA's 128-aligned blocks setting L the page count can be one less). D = head_dim,
    Di = index_head_dim. Flash at BF16, B=64: 3 pages * 64 * 342,016 B
    = 65,667,072 B. The token pages are trimmed to this span after every step (``V4KVPools.trim``); a prefill
    chunk of c tokens holds about ceil(c / B) more pages while it runs.
    """
    return fixed_token_pages(cfg, block_size) * block_size * token_row_bytes(cfg, dtype_bytes)


def pool_bytes_per_sequence(cfg: DeepseekV4Config, context_len: int, dtype_bytes: int = 2, block_size: int = 64,
                            c4_block_size: int = 16, c128_block_size: int = 2) -> int:
    """All pool bytes of one sequence of ``context_len`` tokens: the token pages
    (``min(ceil(n / B), fixed_token_pages)`` pages) plus the whole entry pages of its ``n // 4`` CSA entries
    (``c4`` + ``c4_idx``, (D + Di) * dtype_bytes per entry per CSA layer) and ``n // 128`` HCA entries
    (``c128``, D * dtype_bytes per entry per HCA layer)."""
    n = layer_counts(cfg)
    D, Di = cfg.head_dim, cfg.index_head_dim
    tok_pages = min(-(-context_len // block_size), fixed_token_pages(cfg, block_size))
    tok = tok_pages * block_size * token_row_bytes(cfg, dtype_bytes)
    c4 = -(-(context_len // 4) // c4_block_size) * c4_block_size * (D + Di) * dtype_bytes * n["csa"] if n["csa"] else 0
    c128 = (-(-(context_len // 128) // c128_block_size) * c128_block_size * D * dtype_bytes * n["hca"]
            if n["hca"] else 0)
    return tok + c4 + c128


# ---- weights and memory plans ------------------------------------------------------------------------

_FP32_AT_RUNTIME = ("norm", "hc_", "ape", "attn_sink", "gate.bias", "compressor.wkv", "compressor.wgate", "head.")


def weights_bytes(cfg: DeepseekV4Config) -> int:
    """Weight bytes in the checkpoint formats of ``cfg`` (= :func:`checkpoint_bytes`): FP8 linears 1 B/param
    + one E8M0 byte per 128x128 block, FP4 experts 0.5 B/param + one byte per 32, BF16 2 B, F32 4 B, tid2eid
    8 B per entry. Exact for the published Flash/Pro files. The official model additionally up-casts norms,
    compressor wkv/wgate and head to FP32 and dequantises wo_a to BF16 at load (README.md §3.3): not counted."""
    return checkpoint_bytes(cfg)


def dequantized_weights_bytes(cfg: DeepseekV4Config, dtype_bytes: int = 2) -> int:
    """Weight bytes when every FP8/FP4/BF16 weight is held dequantised at ``dtype_bytes`` (what the reference
    engine of this package does), the FP32-held tensors (norms, hc_*, ape, attn_sink, gate.bias, compressor
    wkv/wgate, head) at 4 B and tid2eid at 8 B."""
    total = 0
    for t in tensor_inventory(cfg):
        if t.scale:
            continue
        if t.table:
            total += t.nbytes
        elif t.dtype == "F32" or any(s in t.name for s in _FP32_AT_RUNTIME):
            total += 4 * t.logical_numel
        else:
            total += dtype_bytes * t.logical_numel
    return total


def memory_plan(cfg: DeepseekV4Config, context_len: int, batch: int, dtype_bytes: int = 2, block_size: int = 64,
                c4_block_size: int = 16, c128_block_size: int = 2) -> dict[str, int]:
    """Memory for ``batch`` sequences of ``context_len`` tokens each (bytes, all ints):

    * ``weights_bytes``: :func:`weights_bytes` (checkpoint formats: FP8 1 B, FP4 experts 0.5 B, BF16 / F32
      where the spec says so, scales included); ``weights_dequantized_bytes``: :func:`dequantized_weights_bytes`
      at ``dtype_bytes`` (for an engine that dequantises at load, as ours does today).
    * ``kv_fixed_per_seq``: token pages held (window rows + compressor state, see
      :func:`fixed_bytes_per_sequence`, capped by the context); ``kv_growth_per_seq``: the c4/c4_idx/c128 entry
      pages (rounded up to whole pages); ``kv_per_seq`` = their sum = :func:`pool_bytes_per_sequence`;
      ``kv_bytes`` = batch * kv_per_seq.
    * ``kv_production_bytes``: for comparison, the production layout of README.md §4.2 for the same batch:
      batch * (context_len * production bytes/token + one window of ``window_size`` 584-B entries per layer,
      MTP included); compressor rings not counted.
    * ``total_bytes`` = weights_bytes + kv_bytes (activations and workspace not included).
    """
    for name, v, lo in (("context_len", context_len, 0), ("batch", batch, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise RequestError(f"{name} must be an integer >= {lo}, got {v!r}")
    if context_len > cfg.max_position_embeddings:
        raise RequestError(f"context_len {context_len} exceeds the model's max_position_embeddings "
                           f"{cfg.max_position_embeddings}")
    per_seq = pool_bytes_per_sequence(cfg, context_len, dtype_bytes, block_size, c4_block_size, c128_block_size)
    tok_pages = min(-(-context_len // block_size), fixed_token_pages(cfg, block_size))
    fixed = tok_pages * block_size * token_row_bytes(cfg, dtype_bytes)
    prod_tok = kv_bytes_per_token(cfg, "production")["total"]
    prod_window = (cfg.n_layers + cfg.n_mtp_layers) * min(cfg.window_size, context_len) * production_entry_bytes(cfg)
    w = weights_bytes(cfg)
    return {
        "context_len": context_len,
        "batch": batch,
        "weights_bytes": w,
        "weights_dequantized_bytes": dequantized_weights_bytes(cfg, dtype_bytes),
        "kv_fixed_per_seq": fixed,
        "kv_growth_per_seq": per_seq - fixed,
        "kv_per_seq": per_seq,
        "kv_bytes": batch * per_seq,
        "kv_production_bytes": batch * (math.ceil(context_len * prod_tok) + prod_window),
        "total_bytes": w + batch * per_seq,
    }


# ---- report ------------------------------------------------------------------------------------------

def format_info(cfg: DeepseekV4Config, context_len: int, batch: int) -> str:
    """Human-readable report printed by ``ascend-dsv4 info``: config summary, parameters, KV bytes per
    token per layer kind (production and pool layouts) and the memory plan for ``batch`` x ``context_len``."""
    n = layer_counts(cfg)
    L = []
    a = L.append
    a(f"model        {cfg.name or '(unnamed)'}  [{cfg.model_type}]")
    a(f"layers       {cfg.n_layers} + {cfg.n_mtp_layers} MTP:  SWA {n['swa']} [{_ids(cfg.layers_of_kind('swa'))}]"
      f"  CSA {n['csa']} [{_ids(cfg.layers_of_kind('csa'))}]  HCA {n['hca']} [{_ids(cfg.layers_of_kind('hca'))}]"
      f"  hash-routed [{_ids(list(range(cfg.n_hash_layers)))}]")
    a(f"hidden       dim {cfg.dim}, vocab {cfg.vocab_size}, hc_mult {cfg.hc_mult}, "
      f"max positions {cfg.max_position_embeddings:,}")
    a(f"attention    {cfg.n_heads} heads x {cfg.head_dim} (rope {cfg.rope_head_dim}), 1 shared K=V head, "
      f"q_lora {cfg.q_lora_rank}, o {cfg.o_groups} groups x {cfg.o_lora_rank}, window {cfg.window_size}")
    a(f"indexer      {cfg.index_n_heads} heads x {cfg.index_head_dim}, top-k {cfg.index_topk}")
    a(f"moe          {cfg.n_routed_experts} routed + {cfg.n_shared_experts} shared experts, "
      f"{cfg.n_activated_experts} active, inter {cfg.moe_inter_dim}, route_scale {cfg.route_scale}")
    a(f"checkpoint   dtype {cfg.dtype}, experts {_expert_format(cfg)}, scales {cfg.scale_fmt}")
    bd = param_breakdown(cfg)
    total = sum(bd.values())
    a(f"parameters   {_params(total)} ({total:,}) incl. MTP; "
      f"{_params(active_param_count(cfg))} active per token (MTP excluded)")
    a("  " + ", ".join(f"{k} {_params(v)}" for k, v in bd.items() if v))
    a(f"weights      {_gib(weights_bytes(cfg))} in checkpoint formats; "
      f"{_gib(dequantized_weights_bytes(cfg, 2))} dequantised to BF16")
    prod, prod8, pool = (kv_bytes_per_token(cfg, "production"), kv_bytes_per_token(cfg, "production",
                         indexer_fp8=True), kv_bytes_per_token(cfg, "pool", 2))
    a("KV bytes per token of context (per layer; total over layers):")
    a(f"  {'kind':<5} {'layers':>6} {'production':>11} {'(FP8 idx)':>10} {'pool bf16':>10}")
    for k in KINDS:
        a(f"  {k:<5} {n[k]:>6} {prod[k]:>11g} {prod8[k]:>10g} {pool[k]:>10g}")
    a(f"  {'total':<5} {sum(n.values()):>6} {prod['total']:>11,.2f} {prod8['total']:>10,.2f} {pool['total']:>10,.2f}")
    a(f"  fixed per sequence (pool, bf16, 64-token pages): {_gib(fixed_bytes_per_sequence(cfg))} "
      f"({fixed_token_pages(cfg)} pages x 64 tokens x {token_row_bytes(cfg):,} B: window + compressor state)")
    p = memory_plan(cfg, context_len, batch)
    a(f"memory for {batch} x {context_len:,} tokens (bf16 KV):")
    a(f"  weights {_gib(p['weights_bytes'])}  +  KV {_gib(p['kv_bytes'])} "
      f"({_gib(p['kv_per_seq'])} per sequence: {_gib(p['kv_fixed_per_seq'])} fixed + "
      f"{_gib(p['kv_growth_per_seq'])} compressed entries)  =  {_gib(p['total_bytes'])}")
    a(f"  (production-layout KV for comparison: {_gib(p['kv_production_bytes'])}; activations not included)")
    return "\n".join(L)
