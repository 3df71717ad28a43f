"""DeepSeek-V3 (MLA) against transformers' DeepseekV3ForCausalLM; absorbed decode vs decompressed prefill."""

from __future__ import annotations

import pytest
import torch

from ascend_dsv4 import LLM
from ascend_dsv4.models import preset
from ascend_dsv4.kv import PoolSizes
from ascend_dsv4.engine.model_runner import ModelRunner
from ascend_dsv4.models.deepseek_v3.model import DeepseekV3Model
from ascend_dsv4.weights.random_init import init_random_
from v3_oracle import random_hf_v3

pytest.importorskip("transformers")

POOLS = PoolSizes(block_size=16, num_blocks=128)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


CASES = {
    # dense-first layers, group-limited routing, YaRN with mscale (toy-v3 as is)
    "toy": dict(),
    # no q compression (V2-Lite style q_proj), no YaRN, ungrouped routing, 2 dense layers
    "q-proj": dict(q_lora_rank=0, rope_factor=1.0, n_expert_groups=1, n_limited_groups=1, n_dense_layers=2,
                   n_layers=3, norm_topk_prob=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    cfg = preset("toy-v3").replace(**CASES[case])
    hf = random_hf_v3(cfg, seed=2)
    hf.save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", progress=False, max_num_batched_tokens=1024)
    ids = torch.randint(0, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None], use_cache=False).logits[0]
    assert rel(llm.logits(ids.tolist()), ref) < 1e-4  # decompressed prefill
    assert rel(llm.logits(ids.tolist(), prefill_len=10), ref) < 1e-4  # then absorbed decode


@pytest.fixture(scope="module")
def runner():
    cfg = preset("toy-v3")
    return ModelRunner(init_random_(DeepseekV3Model(cfg, torch.float32), 3).eval(), POOLS)


def _run(runner, ids, chunks):
    seq, rows, pos = runner.new_sequence(), [], 0
    for n in chunks:
        rows.append(runner.step([seq], [ids[pos:pos + n]], logits="all"))
        pos += n
    runner.release(seq)
    return torch.cat(rows)


def test_absorbed_decode_equals_decompressed_prefill(runner):
    ids = torch.randint(0, 1024, (90,), generator=torch.Generator().manual_seed(4)).tolist()
    full = _run(runner, ids, [90])
    assert rel(_run(runner, ids, [1] * 90), full) < 1e-5  # every token absorbed
    assert rel(_run(runner, ids, [30, 1, 1, 58]), full) < 1e-5


def test_ragged_batch_invariance(runner):
    g = torch.Generator().manual_seed(6)
    a, b = (torch.randint(0, 1024, (n,), generator=g).tolist() for n in (60, 40))
    alone = _run(runner, a, [40, 1, 1, 1, 1, 16])
    sa, sb = runner.new_sequence(), runner.new_sequence()
    runner.step([sb], [b[:39]])
    out = [runner.step([sa, sb], [a[:40], b[39:40]], logits="all")[:40]]
    for i in range(40, 44):
        out.append(runner.step([sb, sa], [[b[i - 40]], [a[i]]], logits="all")[1:])
    out.append(runner.step([sa], [a[44:]], logits="all"))
    runner.release(sa)
    runner.release(sb)
    assert rel(torch.cat(out), alone) < 1e-5


def test_latent_pool_holds_only_the_compressed_latent(runner):
    cfg = runner.model.cfg
    assert runner.pools.latent.shape[-1] == cfg.kv_lora_rank + cfg.qk_rope_head_dim
    v3 = preset("deepseek-v3")
    assert (v3.kv_lora_rank + v3.qk_rope_head_dim) * 2 == 1152  # bytes per token per layer in BF16


def test_mtp_prefill_equals_decode(runner):
    model = runner.model
    ids = torch.randint(0, 1024, (41,), generator=torch.Generator().manual_seed(9)).tolist()

    def mtp(chunks):
        seq, rows, pos = runner.new_sequence(), [], 0
        for n in chunks:
            _, h, ctx, _ = runner.step([seq], [ids[pos:pos + n]], logits="all", return_streams=True)
            with torch.inference_mode():
                rows.append(model.mtp_logits(h, torch.tensor(ids[pos + 1:pos + n + 1]), ctx))
            pos += n
        runner.release(seq)
        return torch.cat(rows)

    full = mtp([40])
    assert rel(mtp([20] + [1] * 20), full) < 1e-5


def test_generate_toy_v3():
    llm = LLM(model="toy-v3", device="cpu")
    outs = llm.generate(["Hello", "MLA on Ascend"], __import__("ascend_dsv4").SamplingParams(max_tokens=6, temperature=0))
    assert all(len(o.token_ids) == 6 for o in outs)


def test_fp8_hf_checkpoint_with_mtp_loads(tmp_path):
    """DeepSeek's HF V3 format: FP8 e4m3 + float32 weight_scale_inv (unaligned blocks), MTP at layer n_layers."""
    from ascend_dsv4.entrypoints.cli import main

    assert main(["make-random-checkpoint", "--preset", "toy-v3", "--format", "hf", "--out", str(tmp_path / "c")]) == 0
    kept = LLM(model=str(tmp_path / "c"), device="cpu", progress=False)
    attn = kept.model.layers[0].self_attn
    assert attn.q_a_proj.fmt == "fp8_block" and attn.kv_b_proj.fmt == "dense"  # kv_b split for absorption
    assert attn.kv_a_proj_with_mqa.weight.shape == (160, 256)  # 160 rows: a padded 128x128 scale block
    assert kept.model.layers[1].mlp.experts.fmt == "fp8_block"
    assert kept.model.mtp[0].eh_proj.weight.abs().sum() > 0  # MTP weights were loaded, not zeroed
    deq = LLM(model=str(tmp_path / "c"), device="cpu", progress=False, dequantize=True)
    ids = list(range(5, 60))
    assert torch.equal(kept.logits(ids), deq.logits(ids))
