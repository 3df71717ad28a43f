"""Shared helpers for the DeepSeek-V4 model tests: tiny random models and a step driver."""

from __future__ import annotations

import torch

from ascend_dsv4.models import preset
from ascend_dsv4.kv import PoolSizes
from ascend_dsv4.engine.model_runner import ModelRunner
from ascend_dsv4.models.deepseek_v4.model import DeepseekV4Model
from ascend_dsv4.weights.random_init import init_random_

SMALL_POOLS = PoolSizes(block_size=16, c4_block_size=4, c128_block_size=1, num_blocks=160, num_c4_blocks=160,
                        num_c128_blocks=24)


def toy_cfg(**over):
    base = dict(vocab_size=512, n_routed_experts=8)
    base.update(over)
    return preset("toy-v4").replace(**base)


def make_runner(cfg, dtype=torch.float32, numerics="exact", seed=0, pools=SMALL_POOLS):
    model = init_random_(DeepseekV4Model(cfg, dtype, numerics), seed).eval()
    return ModelRunner(model, pools)


def run_chunks(runner, ids, chunks):
    """Logits at every position of one sequence run as consecutive chunks of the given sizes."""
    seq = runner.new_sequence()
    rows, pos = [], 0
    for n in chunks:
        rows.append(runner.step([seq], [ids[pos:pos + n]], logits="all"))
        pos += n
    assert pos == len(ids)
    runner.release(seq)
    return torch.cat(rows)


def two_sequence_logits(model, device="cpu", backend=None):
    """Logits of a fresh runner over ``model``: two prompts (37 and 9 tokens) prefilled one by one, then one decode
    step of both; rows concatenated on the CPU."""
    runner = ModelRunner(model, SMALL_POOLS, device, backend=backend)
    g = torch.Generator().manual_seed(0)
    seqs = [runner.new_sequence() for _ in range(2)]
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (37, 9)]
    out = [runner.step([s], [p]) for s, p in zip(seqs, prompts)]  # prefill
    out.append(runner.step(seqs, [[5], [11]]))  # one decode step of both
    return torch.cat([o.reshape(-1, o.shape[-1]) for o in out]).cpu()


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()
