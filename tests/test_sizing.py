"""sizing: parameter counts (ascend_dsv4/models/deepseek_v4/README.md §1.3), checkpoint inventory (§3.1), KV bytes
per token (§4.2), pool sizes."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from ascend_dsv4.models.deepseek_v4 import sizing
from ascend_dsv4.models import preset
from ascend_dsv4.kv import PoolSizes, SeqBlocks, V4KVPools
from ascend_dsv4.errors import RequestError

FLASH, PRO, TOY = preset("deepseek-v4-flash"), preset("deepseek-v4-pro"), preset("toy-v4")


# ---- parameters and checkpoint inventory -------------------------------------------------------------

def test_param_count_matches_spec_1_3():
    assert sizing.param_count(FLASH) == 290_942_289_362
    assert sizing.param_count(PRO) == 1_598_837_347_742


def test_param_count_convention():
    """Scales and tid2eid excluded; hc params, ape, sinks, gate bias and norms included; FP4 counted unpacked."""
    for cfg, expect in ((FLASH, 290_942_289_362), (PRO, 1_598_837_347_742)):
        inv = sizing.tensor_inventory(cfg)
        tid2eid = sum(t.logical_numel for t in inv if t.table)
        assert tid2eid == 3 * cfg.vocab_size * cfg.n_activated_experts  # hash layers 0-2, int64 tables
        non_scale = sum(t.logical_numel for t in inv if not t.scale)
        assert non_scale - tid2eid == expect
        assert non_scale != expect  # counting tid2eid as parameters would not reproduce the spec
        for part in ("hc_attn_fn", "ape", "attn_sink", "gate.bias"):  # all needed for the exact total
            assert sum(t.logical_numel for t in inv if part in t.name) > 0
        fp4 = [t for t in inv if t.packed_fp4]
        assert fp4 and all(t.dtype == "I8" and t.logical_numel == 2 * t.count * t.numel for t in fp4)
        # MTP has no embedding / head copy
        assert not [t for t in inv if t.name.startswith("mtp.") and ("embed" in t.name or "head.weight" in t.name)]


def test_param_breakdown_sums_to_total():
    for cfg in (TOY, FLASH, PRO):
        bd = sizing.param_breakdown(cfg)
        assert sum(bd.values()) == sizing.param_count(cfg)
        assert bd["mtp"] == sizing.param_count(cfg) - sizing.param_count(cfg, include_mtp=False)
        assert bd["embed"] == bd["head"] == cfg.vocab_size * cfg.dim
        assert bd["experts"] == cfg.n_layers * cfg.n_routed_experts * 3 * cfg.dim * cfg.moe_inter_dim
        assert bd["shared_experts"] == cfg.n_layers * 3 * cfg.dim * cfg.moe_inter_dim
        assert all(v > 0 for v in bd.values())
    # Flash: 256 experts x 3 x 4096 x 2048 x 43 layers
    assert sizing.param_breakdown(FLASH)["experts"] == 277_025_390_592


def test_param_count_does_not_depend_on_checkpoint_format():
    n = sizing.param_count(TOY)
    for changes in (dict(dtype="bf16", scale_fmt=None, expert_dtype=None), dict(expert_dtype="fp8"),
                    dict(expert_dtype=None)):
        assert sizing.param_count(TOY.replace(**changes)) == n


def test_inventory_reproduces_published_checkpoints():
    """Spec §0 / §3.1: tensor counts, dtype histograms and total bytes of the HF files."""
    for cfg, n_tensors, nbytes, hist, mtp_tensors in (
        (FLASH, 69_187, 159_609_485_896,
         dict(BF16=433, F32=417, F8_E4M3=375, F8_E8M0=34_167, I64=3, I8=33_792), 1_575),
        (PRO, 145_116, 864_704_792_696,
         dict(BF16=619, F32=590, F8_E4M3=528, F8_E8M0=71_952, I64=3, I8=71_424), None),
    ):
        inv = sizing.tensor_inventory(cfg)
        assert sum(t.count for t in inv) == n_tensors
        got = Counter()
        for t in inv:
            got[t.dtype] += t.count
        assert dict(got) == hist
        assert sizing.checkpoint_bytes(cfg) == nbytes == sizing.weights_bytes(cfg)
        if mtp_tensors:
            assert sum(t.count for t in inv if t.name.startswith("mtp.")) == mtp_tensors


def test_inventory_shapes_spec_3_1():
    inv = {t.name: t for t in sizing.tensor_inventory(FLASH)}
    assert inv["layers.0.attn.wo_a.weight"].shape == (8192, 4096)
    assert inv["layers.0.attn.wo_a.scale"].shape == (64, 32)
    assert inv["layers.2.attn.compressor.ape"].shape == (4, 1024)
    assert inv["layers.3.attn.compressor.ape"].shape == (128, 512)
    assert inv["layers.2.attn.indexer.wq_b.scale"].shape == (64, 8)
    assert inv["layers.5.ffn.experts.{e}.w1.weight"].shape == (2048, 2048)
    assert inv["layers.5.ffn.experts.{e}.w1.scale"].shape == (2048, 128)
    assert inv["layers.5.ffn.experts.{e}.w2.weight"].shape == (4096, 1024)
    assert inv["layers.5.ffn.experts.{e}.w2.weight"].count == 256
    assert inv["layers.1.ffn.gate.tid2eid"].shape == (129280, 6)
    assert "layers.3.ffn.gate.tid2eid" not in inv and "layers.3.ffn.gate.bias" in inv
    assert "mtp.0.ffn.gate.bias" in inv and "mtp.0.attn.compressor.ape" not in inv
    assert "layers.0.attn.compressor.wkv.weight" not in inv  # SWA-only
    assert "layers.3.attn.indexer.wq_b.weight" not in inv  # HCA has no indexer
    pro = {t.name: t for t in sizing.tensor_inventory(PRO)}
    assert pro["layers.0.attn.wo_b.scale"].shape == (56, 128)
    assert pro["layers.0.ffn.experts.{e}.w1.weight"].shape == (3072, 3584)
    assert pro["layers.0.ffn.experts.{e}.w1.scale"].shape == (3072, 224)
    assert pro["layers.0.attn.compressor.ape"].shape == (128, 512)


def test_bf16_checkpoint_has_no_scales():
    cfg = TOY.replace(dtype="bf16", scale_fmt=None, expert_dtype=None)
    inv = sizing.tensor_inventory(cfg)
    assert not [t for t in inv if t.scale]
    assert {t.dtype for t in inv} == {"BF16", "F32", "I64"}


def test_active_params():
    # README: Flash 13B, Pro 49B active (rounded; depends on what is counted)
    assert 13e9 < sizing.active_param_count(FLASH) < 14e9
    assert 49e9 < sizing.active_param_count(PRO) < 50e9


# ---- KV bytes per token --------------------------------------------------------------------------------

def test_production_entry_bytes():
    assert sizing.production_entry_bytes(FLASH) == 584
    assert sizing.production_indexer_entry_bytes(FLASH) == 68
    assert sizing.production_indexer_entry_bytes(FLASH, indexer_fp8=True) == 132


def test_production_bytes_per_token_spec_4_2():
    f = sizing.kv_bytes_per_token(FLASH, "production")
    assert (f["swa"], f["csa"], f["hca"], f["mtp"]) == (0, 163, 4.5625, 0)
    assert f["total"] == 21 * 163 + 20 * 4.5625 == 3514.25 and round(f["total"]) == 3514
    f8 = sizing.kv_bytes_per_token(FLASH, "production", indexer_fp8=True)
    assert f8["csa"] == 179 and round(f8["total"]) == 3850
    p = sizing.kv_bytes_per_token(PRO, "production")
    assert p["total"] == 30 * 163 + 31 * 4.5625 and int(p["total"]) == 5031
    assert int(sizing.kv_bytes_per_token(PRO, "production", indexer_fp8=True)["total"]) == 5511
    # dtype_bytes only affects the pool layout
    assert sizing.kv_bytes_per_token(FLASH, "production", dtype_bytes=4) == f


def test_pool_bytes_per_token_equal_reference_bf16_column():
    f = sizing.kv_bytes_per_token(FLASH, "pool", dtype_bytes=2)
    assert (f["swa"], f["csa"], f["hca"], f["mtp"], f["total"]) == (0, 320, 8, 0, 6880)
    p = sizing.kv_bytes_per_token(PRO, "pool", dtype_bytes=2)
    assert (p["csa"], p["hca"], p["total"]) == (320, 8, 9848)
    assert sizing.kv_bytes_per_token(FLASH, "pool", dtype_bytes=4)["total"] == 2 * 6880


def test_kv_layout_errors():
    with pytest.raises(ValueError, match="layout"):
        sizing.kv_bytes_per_token(FLASH, "paged")
    with pytest.raises(ValueError, match="dtype_bytes"):
        sizing.kv_bytes_per_token(FLASH, "pool", dtype_bytes=0)


def _pools(cfg, block_size=64, dtype=torch.bfloat16, **kw):
    sizes = PoolSizes(block_size=block_size, c4_block_size=16, c128_block_size=2,
                      num_blocks=kw.get("nb", 16), num_c4_blocks=kw.get("nb4", 16), num_c128_blocks=kw.get("nb128", 8))
    return V4KVPools(cfg, sizes, dtype)


def test_pool_formulas_match_the_pool_tensors():
    pools = _pools(TOY)
    s = pools.sizes
    per = sizing.kv_bytes_per_token(TOY, "pool", dtype_bytes=2)
    ncsa, nhca = len(TOY.layers_of_kind("csa")), len(TOY.layers_of_kind("hca"))
    nb = lambda t: t.numel() * t.element_size()  # noqa: E731
    # entries: c4 + c4_idx hold one entry per 4 tokens, c128 one per 128 tokens
    assert (nb(pools.c4) + nb(pools.c4_idx)) / (s.num_c4_blocks * s.c4_block_size * 4) == per["csa"] * ncsa
    assert nb(pools.c128) / (s.num_c128_blocks * s.c128_block_size * 128) == per["hca"] * nhca
    # token pages: one row per position holds every layer's SWA row and compressor state
    token = sum(nb(t) for t in (pools.swa, pools.csa_state_kv, pools.csa_state_score, pools.idx_state_kv,
                                pools.idx_state_score, pools.hca_state_kv, pools.hca_state_score))
    assert token == s.num_blocks * s.block_size * sizing.token_row_bytes(TOY, 2)
    assert nb(pools.swa) + token - nb(pools.swa) + nb(pools.c4) + nb(pools.c4_idx) + nb(pools.c128) == pools.nbytes()


def test_flash_fixed_bytes_per_sequence():
    # 44 SWA rows x 512 x 2 B + 21 CSA x (4*512 + 4*128) x 4 B + 20 HCA x 2*512 x 4 B
    assert sizing.token_row_bytes(FLASH, 2) == 44 * 1024 + 21 * 2560 * 4 + 20 * 1024 * 4 == 342_016
    assert sizing.live_token_span(FLASH) == 128
    assert sizing.fixed_token_pages(FLASH, 64) == 3
    assert sizing.fixed_bytes_per_sequence(FLASH) == 3 * 64 * 342_016 == 65_667_072
    assert sizing.fixed_bytes_per_sequence(PRO) == 3 * 64 * (62 * 1024 + 30 * 2560 * 4 + 31 * 1024 * 4)


def _variants():
    yield TOY
    yield TOY.replace(window_size=200)
    yield TOY.replace(window_size=5)
    yield TOY.replace(compress_ratios=(0, 0, 4, 0, 4, 0, 4, 0))  # CSA only: span set by the window
    yield TOY.replace(compress_ratios=(0, 0, 4, 0, 4, 0, 4, 0), window_size=3)  # span set by CSA (8)
    yield TOY.replace(compress_ratios=(0, 128, 0, 128, 0, 0, 0, 0), window_size=8)  # HCA only


@pytest.mark.parametrize("block_size", [16, 48, 64, 128])
def test_fixed_token_pages_is_the_peak_of_a_decoding_sequence(block_size):
    """Decode token by token through the real pools (ensure, write, trim) and record the pages held."""
    for cfg in _variants():
        pools = _pools(cfg, block_size, torch.float32, nb=64, nb4=64, nb128=64)
        seq, peak = SeqBlocks(), 0
        for n in range(900):
            assert pools.keep_from(n) == sizing._keep_from(cfg, n, bool(pools.csa_layers), bool(pools.hca_layers))
            pools.ensure(seq, n + 1)
            peak = max(peak, sum(p >= 0 for p in seq.token))
            seq.num_tokens = n + 1
            pools.trim(seq)
        pages = sizing.fixed_token_pages(cfg, block_size)
        assert peak == pages, (cfg.window_size, cfg.compress_ratios, block_size)
        L = sizing.live_token_span(cfg)
        assert pages <= -(-(L - 1) // block_size) + 1
        # and the entry pages of this 900-token sequence are what pool_bytes_per_sequence counts
        per_seq = sizing.pool_bytes_per_sequence(cfg, 900, 4, block_size)
        held = sum(p >= 0 for p in seq.token) * block_size * sizing.token_row_bytes(cfg, 4)
        ncsa, nhca = len(pools.csa_layers), len(pools.hca_layers)
        entries = (len(seq.c4) * 16 * (cfg.head_dim + cfg.index_head_dim) * 4 * ncsa
                   + len(seq.c128) * 2 * cfg.head_dim * 4 * nhca)
        assert held + entries <= per_seq
        assert per_seq - entries == pages * block_size * sizing.token_row_bytes(cfg, 4)
        pools.free(seq)


def test_fixed_token_pages_rejects_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        sizing.fixed_token_pages(FLASH, 0)


# ---- memory plan and report ----------------------------------------------------------------------------

def test_memory_plan_flash():
    ctx, batch = 131072, 4
    p = sizing.memory_plan(FLASH, ctx, batch)
    assert p["weights_bytes"] == 159_609_485_896
    assert p["kv_fixed_per_seq"] == sizing.fixed_bytes_per_sequence(FLASH)
    # c4 + c4_idx: 32768 entries = 2048 pages of 16; c128: 1024 entries = 512 pages of 2
    assert p["kv_growth_per_seq"] == ctx // 4 * 640 * 2 * 21 + ctx // 128 * 512 * 2 * 20 == ctx * 6880
    assert p["kv_per_seq"] == p["kv_fixed_per_seq"] + p["kv_growth_per_seq"]
    assert p["kv_bytes"] == batch * p["kv_per_seq"]
    assert p["total_bytes"] == p["weights_bytes"] + p["kv_bytes"]
    assert p["kv_production_bytes"] == batch * (round(ctx * 3514.25) + 44 * 128 * 584)
    assert p["weights_dequantized_bytes"] > 2 * sizing.param_count(FLASH)
    # ascend_dsv4/models/deepseek_v4/README.md §4.2: about 3.4 GiB per 1M-token sequence in the production layout
    p1m = sizing.memory_plan(FLASH, 1 << 20, 1)
    assert 3.3 < p1m["kv_production_bytes"] / 2**30 < 3.5


def test_memory_plan_short_contexts():
    p = sizing.memory_plan(TOY, 0, 1)
    assert p["kv_bytes"] == 0 and p["total_bytes"] == p["weights_bytes"]
    p = sizing.memory_plan(TOY, 3, 2)  # one token page, no compressed entry yet
    assert p["kv_growth_per_seq"] == 0 and p["kv_fixed_per_seq"] == 64 * sizing.token_row_bytes(TOY, 2)
    p = sizing.memory_plan(TOY, 4, 1)  # first CSA entry: a whole c4 page of 16 entries
    assert p["kv_growth_per_seq"] == 16 * (128 + 128) * 2 * 3


@pytest.mark.parametrize("ctx, batch", [(-1, 1), (10, 0), (10, True), (1.5, 1), (TOY.max_position_embeddings + 1, 1)])
def test_memory_plan_rejects_bad_requests(ctx, batch):
    with pytest.raises(RequestError, match="context_len|batch"):
        sizing.memory_plan(TOY, ctx, batch)


def test_format_info_flash():
    text = sizing.format_info(FLASH, 131072, 4)
    for s in ("deepseek-v4-flash", "SWA 2 [0-1]", "CSA 21 [2,4,..,42]", "HCA 20 [3,5,..,41]", "hash-routed [0-2]",
              "64 heads x 512", "window 128", "top-k 512", "256 routed + 1 shared", "6 active",
              "290,942,289,362", "290.94 B", "3,514.25", "3,850.25", "6,880.00", "163", "4.5625", "320",
              "4 x 131,072 tokens", "148.65 GiB"):
        assert s in text, s
    pro = sizing.format_info(PRO, 1 << 20, 1)
    assert "HCA 31 [0-1,3,5,..,59]" in pro and "SWA 0 [-]" in pro and "1,598,837,347,742" in pro
    assert "5,031.44" in pro and "9,848.00" in pro


def test_format_info_toy():
    text = sizing.format_info(TOY, 300, 2)
    assert "toy-v4" in text and "CSA 3 [2,4,6]" in text and "HCA 2 [3,5]" in text
    assert f"{sizing.param_count(TOY):,}" in text
    assert len(text.splitlines()) >= 15
