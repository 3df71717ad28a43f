"""The engine's per-step RequestOutput: token_ids / logprobs are snapshots of what the request had at that step,
though an output holds the request's own lists and copies them only when read (engine/request.py)."""

from __future__ import annotations

import torch

from ascend_dsv4.engine.engine import LLMEngine
from ascend_dsv4.engine.model_runner import ModelRunner
from ascend_dsv4.engine.sampling import SamplingParams
from ascend_dsv4.engine.tokenizer import ByteTokenizer
from ascend_dsv4.kv import PoolSizes
from ascend_dsv4.models import preset
from ascend_dsv4.models.deepseek_v4.model import DeepseekV4Model
from ascend_dsv4.weights.random_init import init_random_

CFG = preset("toy-v4").replace(vocab_size=300, dim=128, n_layers=2, compress_ratios=(4, 128, 0), n_hash_layers=1,
                               n_heads=2, o_groups=2, index_n_heads=2, n_routed_experts=4, window_size=8,
                               q_lora_rank=128, o_lora_rank=64, index_topk=8)


def test_outputs_are_snapshots_taken_when_read():
    model = init_random_(DeepseekV4Model(CFG, torch.float32), 0).eval()
    engine = LLMEngine(ModelRunner(model, PoolSizes(block_size=8, num_blocks=64, c4_block_size=4, num_c4_blocks=64,
                                                    c128_block_size=1, num_c128_blocks=16)),
                       ByteTokenizer(CFG.vocab_size), max_model_len=120, max_num_seqs=2, max_num_batched_tokens=64)
    rid = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2))
    steps = []
    while engine.has_unfinished():
        steps += [o for o in engine.step() if o.request_id == rid]
    assert len(steps) == 6 and steps[-1].finished
    final = steps[-1]
    assert len(final.token_ids) == 6 and len(final.logprobs) == 6
    for k, o in enumerate(steps, 1):  # read after the request finished: each still shows its own step
        assert o.token_ids == final.token_ids[:k] and o.delta_token_ids == [final.token_ids[k - 1]]
        assert len(o.logprobs) == k and o.logprobs == final.logprobs[:k]
        assert o.outputs[0].token_ids == o.token_ids
    assert steps[2].token_ids is steps[2].token_ids  # one snapshot per output, made once
    assert steps[2].token_ids is not final.token_ids
