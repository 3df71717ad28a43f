"""Loading real-format checkpoints: layouts, formats, conversions, per-rank slices, and every corruption case."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ascend_dsv4 import LLM
from ascend_dsv4.models import preset
from ascend_dsv4.errors import CheckpointError
from ascend_dsv4.weights.convert import convert_checkpoint
from ascend_dsv4.weights.rank_slices import RankLayout, rank_tensors, slice_rule
from ascend_dsv4.weights.random_checkpoint import write_checkpoint

IDS = list(range(3, 140))


def _cfg(**over):
    base = dict(index_topk=128, vocab_size=512, n_routed_experts=8)
    base.update(over)
    return preset("toy-v4").replace(**base)


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    d = tmp_path_factory.mktemp("official")
    write_checkpoint(_cfg(), str(d), "official", seed=5, shard_bytes=2 << 20, progress=False)
    return str(d)


@pytest.fixture(scope="module")
def ref_logits(official):
    return LLM(model=official, device="cpu", progress=False).logits(IDS)


def _load(folder, **kw):
    return LLM(model=folder, device="cpu", progress=False, **kw)


def test_official_checkpoint_keeps_quantised_formats(official):
    llm = _load(official)
    layer = llm.model.layers[2]
    assert layer.attn.wq_a.fmt == "fp8_block" and layer.attn.wq_a.weight.dtype == torch.float8_e4m3fn
    assert layer.ffn.experts.fmt == "fp4" and layer.ffn.experts.w1.dtype == torch.int8
    assert layer.attn.wo_a.fmt == "dense"  # dequantised at load (ascend_dsv4/models/deepseek_v4/README.md §3.3)
    assert layer.attn.compressor.wkv.weight.dtype == torch.float32
    assert layer.ffn.gate.tid2eid.dtype == torch.long


def test_official_and_hf_layouts_give_identical_logits(official, ref_logits, tmp_path):
    write_checkpoint(_cfg(), str(tmp_path), "hf", seed=5, shard_bytes=3 << 20, progress=False)
    assert torch.equal(_load(str(tmp_path)).logits(IDS), ref_logits)


def test_dequantised_load_equals_kept_formats(official, ref_logits):
    llm = _load(official, dequantize=True)
    assert llm.model.layers[2].ffn.experts.fmt == "dense"
    assert torch.equal(llm.logits(IDS), ref_logits)


@pytest.mark.parametrize("kw", [dict(layout="hf"), dict(layout="official", experts_fp8=True),
                                dict(layout="official", dequantize=True)])
def test_conversions_are_lossless(official, ref_logits, tmp_path, kw):
    convert_checkpoint(official, str(tmp_path), progress=False, shard_bytes=1 << 20, **kw)
    llm = _load(str(tmp_path))
    if kw.get("experts_fp8"):
        assert llm.model.layers[2].ffn.experts.fmt == "fp8_block"
    assert torch.equal(llm.logits(IDS), ref_logits)


# ---- per-rank slices --------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp, ep", [(2, 2), (4, 4), (2, 1)])
def test_rank_slices_union_is_the_full_checkpoint(tmp_path, tp, ep):
    cfg = _cfg(o_groups=4)  # 4 output groups so that tp=4 divides them
    write_checkpoint(cfg, str(tmp_path), "official", seed=1, shard_bytes=2 << 20, progress=False)
    full = rank_tensors(str(tmp_path), cfg, RankLayout())
    ranks = [rank_tensors(str(tmp_path), cfg, RankLayout(tp, r % tp, ep, r % ep)) for r in range(max(tp, ep))]
    seen_experts = set()
    split_names = 0
    for name, t in full.items():
        rule, arg = slice_rule(name)
        if rule == "expert":
            owners = [r for r in ranks if name in r]
            assert len(owners) >= 1 and all(torch.equal(o[name].view(torch.uint8), t.view(torch.uint8)) for o in owners)
            seen_experts.add(name)
        elif rule == "split":
            split_names += 1
            parts = [ranks[r][name] for r in range(tp)]
            assert parts[0].shape[arg] == t.shape[arg] // tp  # really a slice
            assert torch.equal(torch.cat(parts, dim=arg).view(torch.uint8), t.view(torch.uint8)), name
        else:
            assert all(torch.equal(r[name].view(torch.uint8), t.view(torch.uint8)) for r in ranks)
    assert split_names > 0 and len(seen_experts) == sum(1 for n in full if slice_rule(n)[0] == "expert")
    # each expert-parallel rank holds exactly its E/ep experts
    n_expert_tensors = [sum(1 for n in r if slice_rule(n)[0] == "expert") for r in ranks[:ep]]
    assert sum(n_expert_tensors) == len(seen_experts)


def test_rank_layout_must_divide_the_model(official):
    from ascend_dsv4.errors import ConfigError

    with pytest.raises(ConfigError, match="o_groups"):
        rank_tensors(official, _cfg(), RankLayout(tp_size=4, tp_rank=0))


# ---- corruption --------------------------------------------------------------------------------------------
def _copy(src, dst):
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return str(dst)


def _edit(folder, fn):
    """Apply fn(name -> tensor dict) to the shard holding each tensor; rewrite the index."""
    index_path = os.path.join(folder, "model.safetensors.index.json")
    index = json.load(open(index_path))
    shards = sorted(set(index["weight_map"].values()))
    for s in shards:
        p = os.path.join(folder, s)
        d = load_file(p)
        fn(s, d)
        save_file(d, p)
        for k in list(index["weight_map"]):
            if index["weight_map"][k] == s and k not in d:
                del index["weight_map"][k]
        for k in d:
            index["weight_map"][k] = s
    json.dump(index, open(index_path, "w"))


def _expect(folder, *needles):
    with pytest.raises(CheckpointError) as e:
        _load(folder)
    msg = str(e.value)
    for n in needles:
        assert n in msg, msg
    return msg


def test_missing_unexpected_shape_dtype_and_grid_are_reported_together(official, tmp_path):
    d = _copy(official, tmp_path)

    def fn(shard, t):
        t.pop("layers.1.attn.wkv.weight", None)
        if "layers.0.attn.wq_a.weight" in t:
            t["layers.0.attn.wq_a.weight"] = t["layers.0.attn.wq_a.weight"][:, :128].contiguous()
        if "layers.0.attn.wq_b.scale" in t:
            t["layers.0.attn.wq_b.scale"] = t["layers.0.attn.wq_b.scale"][:1].contiguous()
        if "layers.3.attn.attn_sink" in t:
            t["layers.3.attn.attn_sink"] = t["layers.3.attn.attn_sink"].to(torch.int32)
        if shard.startswith("model-00001"):
            t["layers.0.attn.bogus.weight"] = torch.zeros(2)

    _edit(d, fn)
    msg = _expect(d, "layers.1.attn.wkv.weight: missing", "layers.0.attn.wq_a.weight: shape [128, 128]",
                  "expected [128, 256]", "layers.0.attn.wq_b.scale: scale grid [1, 1]", "layers.3.attn.attn_sink",
                  "layers.0.attn.bogus.weight: unexpected tensor")
    assert "5 problem(s)" in msg and ".safetensors: " in msg  # every problem at once, naming the shard


def test_nan_scale_and_tid2eid_out_of_range(official, tmp_path):
    d = _copy(official, tmp_path)

    def fn(shard, t):
        if "layers.2.attn.wq_a.scale" in t:
            s = t["layers.2.attn.wq_a.scale"].view(torch.uint8).clone()
            s.view(-1)[0] = 255
            t["layers.2.attn.wq_a.scale"] = s.view(torch.float8_e8m0fnu)
        if "layers.0.ffn.gate.tid2eid" in t:
            t["layers.0.ffn.gate.tid2eid"] = t["layers.0.ffn.gate.tid2eid"].clone()
            t["layers.0.ffn.gate.tid2eid"][5, 0] = 99

    _edit(d, fn)
    _expect(d, "layers.2.attn.wq_a.scale: 1 E8M0 scale(s) are 255 (NaN)", "layers.0.ffn.gate.tid2eid",
            "expert ids must be in [0, 8), found [0, 99]")


def test_quantised_weight_without_scale_and_mixed_expert_formats(official, tmp_path):
    d = _copy(official, tmp_path)

    def fn(shard, t):
        t.pop("layers.1.attn.wq_a.scale", None)
        if "layers.2.ffn.experts.3.w1.weight" in t:
            t["layers.2.ffn.experts.3.w1.weight"] = torch.zeros(128, 256, dtype=torch.bfloat16)
            t.pop("layers.2.ffn.experts.3.w1.scale", None)
        if "layers.2.ffn.experts.3.w1.scale" in t:
            t.pop("layers.2.ffn.experts.3.w1.scale")

    _edit(d, fn)
    _expect(d, "layers.1.attn.wq_a.weight: F8_E4M3 weight without its scale tensor",
            "layers.2.ffn.experts.w1: routed experts mix formats")


def test_config_disagreeing_with_checkpoint(official, tmp_path):
    d = _copy(official, tmp_path)
    conf = json.load(open(os.path.join(d, "config.json")))
    conf["vocab_size"] = 1024
    json.dump(conf, open(os.path.join(d, "config.json"), "w"))
    _expect(d, "embed.weight", "expected [1024, 256]")


def test_truncated_shard_corrupt_header_and_missing_shards(official, tmp_path):
    d = _copy(official, tmp_path / "trunc")
    shard = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[-1]
    p = os.path.join(d, shard)
    size = os.path.getsize(p)
    with open(p, "r+b") as f:
        f.truncate(size - 100)
    _expect(d, "truncated", shard)

    d = _copy(official, tmp_path / "header")
    with open(os.path.join(d, shard), "r+b") as f:
        f.seek(8)
        f.write(b"\x00garbage{")
    _expect(d, shard, "header")

    d = _copy(official, tmp_path / "gone")
    os.remove(os.path.join(d, shard))
    _expect(d, "do not exist", shard)

    d = _copy(official, tmp_path / "noindex")
    os.remove(os.path.join(d, "model.safetensors.index.json"))
    assert torch.equal(_load(d).logits(IDS[:20]), _load(official).logits(IDS[:20]))  # a complete set loads
    os.remove(os.path.join(d, shard))
    _expect(d, "model.safetensors.index.json is missing", "incomplete")
