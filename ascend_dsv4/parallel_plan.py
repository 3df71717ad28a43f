"""Tensor / expert-parallel layouts of the two families: what each rank holds, up-front validation, sizing.

What a rank holds (``tp`` ranks; ``ep = tp`` with ``enable_expert_parallel`` else 1):

=====================  ==========================================================  ==========================
part                   DeepSeek-V4                                                 DeepSeek-V3 / R1
=====================  ==========================================================  ==========================
embedding, head        vocabulary split (vocab-parallel embedding, LM head +        same (``embed_tokens``,
                       all-gather)                                                 ``lm_head``)
query / output         ``wq_b`` + ``attn_sink``: heads split; ``wo_a``: output      ``q_b_proj`` / ``q_proj``,
                       groups split; ``wo_b``: row-parallel (all-reduce)            ``kv_b_proj``: heads split;
                                                                                   ``o_proj`` row-parallel
KV                     ``wq_a``, ``wkv`` (the single MQA KV head), compressor,     ``q_a_proj``,
                       indexer: replicated, every rank computes the same KV and    ``kv_a_proj_with_mqa``:
                       top-k as one device                                         replicated; latent cache
                                                                                   replicated
norms, hc, router      replicated                                                  replicated
shared expert, dense   column (w1, w3) / row (w2) parallel                         column / row parallel
routed experts (TP)    every expert's w1/w3 split on N, w2 on K (MoE column/row)   same
routed experts (EP)    ``E / ep`` whole experts per rank; tokens travel by          same
                       all-to-all (or the all-reduce fallback)
=====================  ==========================================================  ==========================

Why the indexer and the KV projection are replicated rather than split: the KV head is single (MQA), so a split
has nothing to divide; the indexer could split its heads and all-reduce the scores before the top-k, but the sum
order would then depend on the layout and a near-tie could select different entries than one device does.
Replicated, every rank reads and selects exactly the single-device entries at the cost of the indexer's weights
(``index_n_heads * index_head_dim * q_lora_rank`` + ``index_n_heads * dim`` per CSA layer, ~2% of the attention
weights of Flash) on each rank.
"""

from __future__ import annotations

import math
import re

from .errors import ConfigError
from .models import family_of
from .models.layout_checks import divisible as _divisible

_EXPERT = re.compile(r"\.experts\.(\{e\}|\d+)\.")

GiB = 1 << 30
DEFAULT_MEMORY_UTILIZATION = 0.9  # vLLM's gpu_memory_utilization default: the share of device memory we plan for


def ep_size(tp: int, enable_expert_parallel: bool) -> int:
    return tp if enable_expert_parallel else 1


def split_rule(name: str, cfg) -> tuple[str, int]:
    """('expert', -1) | ('split', dim) | ('replicate', -1) for a checkpoint tensor name of ``cfg``'s family
    (scales follow weights)."""
    if _EXPERT.search(name):
        return "expert", -1
    fam = family_of(cfg)
    d0, d1 = fam.tp_split_dim0, fam.tp_split_dim1
    if d1.search(name):
        return "split", 1
    if d0.search(name):
        return "split", 0
    return "replicate", -1


def validate_layout(cfg, tensor_parallel_size: int, enable_expert_parallel: bool = False,
                    visible_devices: int | None = None, device: str = "", device_memory: int | None = None,
                    quantized_checkpoint: bool = True, numerics: str = "exact") -> None:
    """Raise :class:`ConfigError` naming the field and the rule when the layout cannot work (before any weight is
    read). ``visible_devices``: devices of this node the ranks would use (None = not limited, e.g. CPU ranks);
    ``device_memory``: bytes per device when known (checked against :func:`rank_weight_bytes`);
    ``quantized_checkpoint=False`` (random-weight presets) skips the FP8 / FP4 scale-block rules;
    ``numerics="reference"`` (V4) adds the rule that a split input of an activation-rounded linear keeps whole
    128-wide rounding blocks on every rank (``wo_b``, w2 of the shared and of TP-split routed experts)."""
    tp = tensor_parallel_size
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    ep = ep_size(tp, enable_expert_parallel)
    if visible_devices is not None and tp > visible_devices:
        raise ConfigError(f"tensor_parallel_size = {tp} needs {tp} {device or 'devices'} on this node, but "
                          f"{visible_devices} are visible (check ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES)")
    fam = family_of(cfg)
    _divisible("n_heads", cfg.n_heads, tp, "tensor_parallel_size")
    _divisible("vocab_size", cfg.vocab_size, tp, "tensor_parallel_size")
    _divisible("n_routed_experts", cfg.n_routed_experts, ep, "the expert-parallel size (= tensor_parallel_size)")
    if ep == 1:
        _divisible("moe_inter_dim", cfg.moe_inter_dim, tp, "tensor_parallel_size (experts split inside)")
    if cfg.n_shared_experts:
        _divisible("moe_inter_dim (shared experts)", fam.shared_expert_inter(cfg), tp, "tensor_parallel_size")
    fam.validate_tp(cfg, tp, ep, quantized_checkpoint, numerics)
    if device_memory is not None:
        need = rank_weight_bytes(cfg, tp, enable_expert_parallel)
        usable = int(device_memory * DEFAULT_MEMORY_UTILIZATION)
        if need > usable:
            raise ConfigError(f"device memory: each of the {tp} ranks needs {need / GiB:.2f} GiB of weights, more than "
                              f"{DEFAULT_MEMORY_UTILIZATION:.0%} of the {device_memory / GiB:.2f} GiB of one device; "
                              f"use a larger --tensor-parallel-size (with --enable-expert-parallel) or a quantised "
                              f"checkpoint")


def rank_weight_bytes(cfg, tensor_parallel_size: int, enable_expert_parallel: bool = False,
                      data_parallel_size: int = 1) -> int:
    """Checkpoint-format weight bytes one rank holds (every rank holds the same amount; scales included);
    under data parallelism the routed experts are EP over all ``data_parallel_size x tensor_parallel_size``
    ranks."""
    ep_on = enable_expert_parallel or data_parallel_size > 1
    tp, ep = tensor_parallel_size, ep_size(tensor_parallel_size, ep_on) * data_parallel_size
    total = 0
    for t in family_of(cfg).tensor_inventory(cfg):
        if getattr(t, "copy", False):  # a stored duplicate (V3's MTP copies of embed / head) is not loaded twice
            continue
        rule, _ = split_rule(t.name, cfg)
        if rule == "replicate":
            total += t.nbytes
        elif rule == "split":
            total += t.nbytes // tp
        elif ep > 1:  # whole experts per rank
            total += t.nbytes // ep
        else:  # every expert split on N (w1, w3) or K (w2)
            total += t.nbytes // tp
    return total


def kv_bytes_per_token_rank(cfg, dtype_bytes: int = 2) -> float:
    """KV bytes one more token of context adds on EACH rank: the KV is replicated (single MQA head in V4, MLA
    latent in V3), so this is the single-device figure of our pools."""
    return family_of(cfg).kv_pool_bytes_per_token(cfg, dtype_bytes)


def parse_bytes(text: str) -> int:
    """'64GiB' / '64G' / '65536MiB' / '68719476736' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ConfigError(f"--device-memory {text!r}: expected a size such as 64GiB, 32G or 65536MiB")
    mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * mult)


def format_layout_info(cfg, tensor_parallel_size: int, enable_expert_parallel: bool = False,
                       device_memory: int | None = None, dtype_bytes: int = 2, data_parallel_size: int = 1) -> str:
    tp, dp = tensor_parallel_size, data_parallel_size
    validate_dp_layout(cfg, dp, tp, enable_expert_parallel)
    enable_expert_parallel = enable_expert_parallel or dp > 1
    ep = ep_size(tp, enable_expert_parallel) * dp
    validate_layout(cfg, tp, enable_expert_parallel)
    w = rank_weight_bytes(cfg, tp, enable_expert_parallel, dp)
    kv = kv_bytes_per_token_rank(cfg, dtype_bytes)
    lines = [f"parallel layout: tensor_parallel_size={tp}, expert parallel {'on' if ep > 1 else 'off'} "
             f"(ep={ep}): {tp} rank(s)" if dp == 1 else
             f"parallel layout: data_parallel_size={dp} attention replicas x tensor_parallel_size={tp}, routed "
             f"experts expert-parallel over all {ep} ranks ({cfg.n_routed_experts // ep} per rank)",
             f"  weights per rank (checkpoint format): {w / GiB:,.2f} GiB ({w:,} B)",
             f"  KV bytes per token per rank (replicated KV, {dtype_bytes}-byte pools): {kv:,.2f} B"]
    if device_memory is not None:
        free = int(device_memory * DEFAULT_MEMORY_UTILIZATION) - w
        lines.append(f"  device memory {device_memory / GiB:,.2f} GiB x {DEFAULT_MEMORY_UTILIZATION:.0%} - weights = "
                     f"{free / GiB:,.2f} GiB for KV (activations and workspace not counted)")
        if free <= 0:
            lines.append("  tokens of KV that fit per rank: 0 (the weights alone do not fit)")
        else:
            lines.append(f"  tokens of KV that fit per rank: {math.floor(free / kv):,}" if kv else
                         "  tokens of KV that fit per rank: unlimited (no per-token KV)")
    return "\n".join(lines)


def validate_dp_layout(cfg, data_parallel_size, tensor_parallel_size: int, enable_expert_parallel: bool,
                       executor: str | None = None, visible_devices: int | None = None, device: str = "") -> None:
    """Rules of data-parallel attention (``D`` replicas of ``T`` ranks, experts EP over all ``D x T`` ranks whether
    or not ``enable_expert_parallel`` is set: the only MoE layout across replicas);
    raises :class:`ConfigError` naming the field. The per-replica TP rules are :func:`validate_layout`'s."""
    dp = data_parallel_size
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ConfigError(f"data_parallel_size must be a positive integer, got {dp!r}")
    if dp == 1:
        return
    world = dp * tensor_parallel_size  # the routed experts are EP over all of them (enable_expert_parallel implied)
    if executor not in (None, "mp", "ray"):
        raise ConfigError(f"distributed_executor_backend must be 'mp' or 'ray', got {executor!r}")
    import os

    if os.environ.get("ASCEND_DSV4_EP_COMM", "alltoall") != "alltoall":
        raise ConfigError(f"data_parallel_size = {dp} needs ASCEND_DSV4_EP_COMM=alltoall (the replicas hold different "
                          f"tokens; the all-reduce fallback would mix them), got "
                          f"{os.environ['ASCEND_DSV4_EP_COMM']!r}")
    if visible_devices is not None and world > visible_devices:
        raise ConfigError(f"data_parallel_size x tensor_parallel_size = {world} needs {world} {device or 'devices'} on "
                          f"this node, but {visible_devices} are visible")
    _divisible("n_routed_experts", cfg.n_routed_experts, world,
               "data_parallel_size x tensor_parallel_size (the expert-parallel size)")
