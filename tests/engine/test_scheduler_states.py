"""Scheduler invariants under random arrivals, aborts and preemptions (hypothesis state machine), on a tiny
real model with pools small enough to force preemption."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ascend_dsv4.models import preset
from ascend_dsv4.engine.engine import LLMEngine
from ascend_dsv4.kv import PoolSizes
from ascend_dsv4.engine.model_runner import ModelRunner
from ascend_dsv4.engine.sampling import SamplingParams
from ascend_dsv4.engine.tokenizer import ByteTokenizer
from ascend_dsv4.models.deepseek_v4.model import DeepseekV4Model
from ascend_dsv4.weights.random_init import init_random_

CFG = preset("toy-v4").replace(vocab_size=300, dim=128, n_layers=2, compress_ratios=(4, 128, 0), n_hash_layers=1,
                               n_heads=2, o_groups=2, index_n_heads=2, n_routed_experts=4, window_size=8,
                               q_lora_rank=128, o_lora_rank=64, index_topk=8)
MODEL = init_random_(DeepseekV4Model(CFG, torch.float32), 0).eval()
# 10 token pages of 8 tokens: two or three long requests exhaust them -> preemption by recompute
SIZES = PoolSizes(block_size=8, c4_block_size=4, c128_block_size=1, num_blocks=10, num_c4_blocks=40,
                  num_c128_blocks=8)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.engine = LLMEngine(ModelRunner(MODEL, SIZES), ByteTokenizer(CFG.vocab_size), max_model_len=120,
                                max_num_seqs=3, max_num_batched_tokens=24)
        self.live: set[str] = set()
        self.done: dict[str, str] = {}
        self.n = 0

    @rule(plen=st.integers(1, 40), max_tokens=st.integers(1, 12))
    def arrive(self, plen, max_tokens):
        rid = self.engine.add_request([3 + (i * 7 + self.n) % 250 for i in range(plen)],
                                      SamplingParams(max_tokens=max_tokens, temperature=0))
        self.n += 1
        self.live.add(rid)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.engine.abort_request(rid)
        self.live.discard(rid)
        self.done[rid] = "abort"

    @rule(k=st.integers(1, 4))
    def step(self, k):
        for _ in range(k):
            for o in self.engine.step():
                if o.finished:
                    assert o.request_id in self.live
                    self.live.discard(o.request_id)
                    self.done[o.request_id] = o.finish_reason

    @invariant()
    def pages_are_accounted_for(self):
        pools = self.engine.runner.pools
        for alloc, attr in ((pools.token_alloc, "token"), (pools.c4_alloc, "c4"), (pools.c128_alloc, "c128")):
            held = [p for r in self.engine.requests.values() for p in getattr(r.seq, attr) if p >= 0]
            assert len(held) == len(set(held)), "a page is owned twice"
            assert set(held) == set(alloc._used), "leaked or double-freed pages"
            assert alloc.num_free + len(alloc._used) == alloc.num_blocks

    def teardown(self):
        for _ in range(400):
            if not self.engine.has_unfinished():
                break
            for o in self.engine.step():
                if o.finished:
                    self.live.discard(o.request_id)
        assert not self.live, f"requests never finished: {self.live}"
        pools = self.engine.runner.pools
        assert pools.token_alloc.num_free == pools.token_alloc.num_blocks


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=12, stateful_step_count=12, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])


def test_preemption_happens_and_outputs_match_unpreempted():
    """Greedy outputs are the same whether or not a request was preempted and recomputed."""
    def run(sizes):
        e = LLMEngine(ModelRunner(MODEL, sizes), ByteTokenizer(CFG.vocab_size), max_model_len=120, max_num_seqs=3,
                      max_num_batched_tokens=24)
        ids = [e.add_request([5 + (i * 3 + j) % 200 for i in range(30 + 5 * j)], SamplingParams(max_tokens=10, temperature=0))
               for j in range(3)]
        outs = {}
        while e.has_unfinished():
            for o in e.step():
                if o.finished:
                    outs[o.request_id] = o.token_ids
        return [outs[i] for i in ids], e.scheduler.num_preemptions

    tight, n_pre = run(SIZES)
    roomy, n0 = run(PoolSizes(block_size=8, c4_block_size=4, c128_block_size=1, num_blocks=64, num_c4_blocks=64,
                              num_c128_blocks=8))
    assert n_pre > 0 and n0 == 0
    assert tight == roomy
