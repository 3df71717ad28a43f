"""Write a random-weight DeepSeek-V4 checkpoint in the exact real format (for tests and benchmarks).

Every tensor of :func:`ascend_dsv4.sizing.tensor_inventory` is generated from its own seeded generator (so the
``official`` and ``hf`` layouts of one seed hold the same values), quantised to its checkpoint format with the
codecs of :mod:`quant` (FP8 e4m3 + E8M0 per 128x128 block, packed FP4 + E8M0 per 32 inputs), and written
shard by shard with a ``model.safetensors.index.json``.

- ``official``: official names, E8M0 scales as ``.scale`` (F8_E8M0), ``config.json`` in the inference format.
- ``hf``: transformers' module names, FP8 scales as float32 ``weight_scale_inv``, routed experts under DeepSeek's
  HF names ``model.layers.i.mlp.experts.e.{gate,up,down}_proj``, MTP under ``mtp.*``; HF ``config.json``.
"""

from __future__ import annotations

import json
import math
import os
import zlib

import torch

from quant.fp8_block import quant_fp8_block

from ..config import ModelConfig
from ..sizing import tensor_inventory
from .names import hf_writer_name

FORMATS = ("official", "hf")


def reduced_config(cfg: ModelConfig, n_layers: int | None) -> ModelConfig:
    """``cfg`` cut to its first ``n_layers`` backbone layers (MTP kept), hash layers clipped."""
    if n_layers is None or n_layers == cfg.n_layers:
        return cfg
    ratios = cfg.compress_ratios[:n_layers] + cfg.compress_ratios[cfg.n_layers:]
    return cfg.replace(n_layers=n_layers, compress_ratios=ratios, n_hash_layers=min(cfg.n_hash_layers, n_layers),
                       name=f"{cfg.name}-{n_layers}l")


def _gen(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _value(name: str, shape: tuple[int, ...], cfg: ModelConfig, g: torch.Generator) -> torch.Tensor:
    """Logical float32 (or int64) value of one official tensor (scales as init_random_ uses them)."""
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("tid2eid"):
        return torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=g).argsort(-1)[:, : shape[1]]
    if name == "embed.weight":
        return torch.randn(shape, generator=g)
    if len(shape) == 2 and (leaf == "weight" or leaf.endswith("_fn")):
        return torch.randn(shape, generator=g) * shape[-1] ** -0.5
    if leaf == "weight":  # norms
        return 1 + 0.1 * torch.randn(shape, generator=g)
    if leaf.endswith("_scale"):
        return 1 + 0.2 * torch.randn(shape, generator=g)
    return 0.5 * torch.randn(shape, generator=g)  # hc bases, ape, attn_sink, gate.bias


def _random_fp4(shape: tuple[int, ...], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed FP4 codes (uniform over the 16 codes, RMS ~2.93) with E8M0 scales of 2^e or 2^(e+1)
    chosen so that the logical weight has std ~ 1/sqrt(in): drawn directly in the stored format, which
    writes FP4 experts far faster than quantising random floats."""
    o, half = shape
    packed = torch.randint(0, 256, (o, half), generator=g, dtype=torch.uint8).view(torch.int8)
    e = round(math.log2(1.0 / (2.93 * math.sqrt(2 * half))))
    scale = (127 + e + torch.randint(0, 2, (o, 2 * half // 32), generator=g)).to(torch.uint8)
    return packed, scale


def _tensors(cfg: ModelConfig, seed: int):
    """Yield (official name, tensor in checkpoint dtype) for every tensor of the checkpoint."""
    for spec in tensor_inventory(cfg):
        if spec.scale:
            continue  # produced with their weight
        names = [spec.name.format(e=e) for e in range(spec.count)] if "{e}" in spec.name else [spec.name]
        for name in names:
            g = _gen(seed, name)
            if spec.packed_fp4:
                packed, scale = _random_fp4(spec.shape, g)
                yield name, packed
                yield name[: -len(".weight")] + ".scale", scale.view(torch.float8_e8m0fnu)
            elif spec.dtype == "F8_E4M3":
                w, scale = quant_fp8_block(_value(name, spec.shape, cfg, g), scale_fmt="ue8m0")
                yield name, w
                yield name[: -len(".weight")] + ".scale", scale.view(torch.float8_e8m0fnu)
            elif spec.dtype == "I64":
                yield name, _value(name, spec.shape, cfg, g).to(torch.int64)
            else:
                dt = {"BF16": torch.bfloat16, "F32": torch.float32}[spec.dtype]
                yield name, _value(name, spec.shape, cfg, g).to(dt)


def official_config_dict(cfg: ModelConfig) -> dict:
    d = {k: v for k, v in cfg.to_dict().items() if k not in ("name",)}
    return d


def hf_config_dict(cfg: ModelConfig) -> dict:
    d = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "moe_intermediate_size": cfg.moe_inter_dim, "num_hidden_layers": cfg.n_layers,
        "num_nextn_predict_layers": cfg.n_mtp_layers, "num_hash_layers": cfg.n_hash_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": 1, "head_dim": cfg.head_dim,
        "qk_rope_head_dim": cfg.rope_head_dim, "q_lora_rank": cfg.q_lora_rank, "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank, "sliding_window": cfg.window_size, "compress_ratios": list(cfg.compress_ratios),
        "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk,
        "n_routed_experts": cfg.n_routed_experts, "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.n_activated_experts, "scoring_func": cfg.score_func, "norm_topk_prob": True,
        "routed_scaling_factor": cfg.route_scale, "swiglu_limit": cfg.swiglu_limit, "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "compress_rope_theta": cfg.compress_rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id, "tie_word_embeddings": False,
        "rope_scaling": {"type": "yarn", "factor": cfg.rope_factor, "original_max_position_embeddings": cfg.original_seq_len,
                         "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow},
    }
    if cfg.dtype == "fp8":
        d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128], "scale_fmt": cfg.scale_fmt or "ue8m0"}
        if cfg.expert_dtype:
            d["quantization_config"]["expert_dtype"] = cfg.expert_dtype
    return d


def make_readable(path: str) -> None:
    """Give ``path`` the mode a plain ``open(path, "w")`` would (0666 less the umask, i.e. 0644 usually):
    ``safetensors.save_file`` creates its files 0600, unreadable to the other users of a shared model folder."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


class ShardWriter:
    """Accumulates tensors and writes ``model-XXXXX-of-YYYYY.safetensors`` shards of at most ``shard_bytes``
    (one shard's tensors in memory at a time), then ``model.safetensors.index.json``."""

    def __init__(self, out_dir: str, shard_bytes: int = 1 << 30):
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.shard_bytes = out_dir, shard_bytes
        self.shards: list[str] = []
        self.weight_map: dict[str, str] = {}
        self.buf: dict[str, torch.Tensor] = {}
        self.size = self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.size and self.size + nbytes > self.shard_bytes:
            self._flush()
        self.buf[name] = t.contiguous()
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self.buf:
            return
        path = os.path.join(self.out_dir, f"model-{len(self.shards) + 1:05d}.safetensors")
        save_file(self.buf, path, metadata={"format": "pt"})
        make_readable(path)
        self.shards.append(path)
        for k in self.buf:
            self.weight_map[k] = os.path.basename(path)
        self.buf, self.size = {}, 0

    def close(self, config: dict | None = None) -> list[str]:
        self._flush()
        n = len(self.shards)
        final = []
        for i, p in enumerate(self.shards):  # the shard count is known only now
            q = os.path.join(self.out_dir, f"model-{i + 1:05d}-of-{n:05d}.safetensors")
            os.replace(p, q)
            final.append(q)
        rename = {os.path.basename(a): os.path.basename(b) for a, b in zip(self.shards, final)}
        index = {"metadata": {"total_size": self.total}, "weight_map": {k: rename[v] for k, v in self.weight_map.items()}}
        with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=1)
        if config is not None:
            with open(os.path.join(self.out_dir, "config.json"), "w") as f:
                json.dump(config, f, indent=1)
        self.shards = final
        return final


def write_checkpoint(cfg: ModelConfig, out_dir: str, fmt: str = "official", seed: int = 0,
                     shard_bytes: int = 1 << 30, progress: bool = True) -> list[str]:
    """Write the checkpoint; returns the shard paths. ``shard_bytes`` bounds each shard (and peak memory)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    writer = ShardWriter(out_dir, shard_bytes)
    bar = None
    if progress:
        from tqdm import tqdm

        total = sum(s.nbytes for s in tensor_inventory(cfg))
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {os.path.basename(out_dir) or out_dir}")
    for name, t in _tensors(cfg, seed):
        if fmt == "hf":
            if name.endswith(".scale") and ".ffn.experts." not in name and t.dtype == torch.float8_e8m0fnu:
                t = t.float()  # HF FP8 scales are float32 weight_scale_inv
            name = hf_writer_name(name)
        writer.add(name, t)
        if bar is not None:
            bar.update(t.numel() * t.element_size())
    if bar is not None:
        bar.close()
    return writer.close(official_config_dict(cfg) if fmt == "official" else hf_config_dict(cfg))


def write_checkpoint_v3(cfg, out_dir: str, seed: int = 0, shard_bytes: int = 1 << 30, progress: bool = True) -> list[str]:
    """A random DeepSeek-V3 checkpoint in DeepSeek's HF format: ``model.layers.N...`` names, FP8 e4m3 linears with
    float32 ``weight_scale_inv`` per 128x128 block (unaligned edge blocks padded as the seed describes), the MTP
    module at layer ``num_hidden_layers`` with its stored copies of the embedding and head, HF ``config.json``
    with ``quantization_config`` (``cfg.dtype == "bf16"`` writes plain BF16 weights instead)."""
    from ..sizing_v3 import tensor_inventory_v3

    writer = ShardWriter(out_dir, shard_bytes)
    specs = tensor_inventory_v3(cfg)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(s.nbytes for s in specs), unit="B", unit_scale=True, desc="writing")
    for spec in specs:
        if spec.scale:
            continue
        names = [spec.name.format(e=e) for e in range(spec.count)] if "{e}" in spec.name else [spec.name]
        for name in names:
            # the MTP layer stores copies of the embedding and head: same values as the originals
            src = name
            if spec.copy:
                src = "model.embed_tokens.weight" if name.endswith("embed_tokens.weight") else "lm_head.weight"
            v = _value("embed.weight" if src == "model.embed_tokens.weight" else src, spec.shape, cfg, _gen(seed, src))
            if spec.dtype == "F8_E4M3":
                w, s = quant_fp8_block(v, scale_fmt=None)
                writer.add(name, w)
                writer.add(name[: -len("weight")] + "weight_scale_inv", s.float())
            else:
                writer.add(name, v.to({"BF16": torch.bfloat16, "F32": torch.float32}[spec.dtype]))
            if bar is not None:
                bar.update(v.numel() * (1 if spec.dtype == "F8_E4M3" else 2))
    if bar is not None:
        bar.close()
    return writer.close(cfg.to_hf_dict())
