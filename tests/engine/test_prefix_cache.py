"""Prefix caching on the paged pools: identical logits with and without hits, short prompts hit, V3, eviction."""

from __future__ import annotations

import pytest

from ascend_dsv4 import LLM, SamplingParams
from ascend_dsv4.kv import PoolSizes

BASE = "The quick brown fox jumps over the lazy dog. " * 6  # 270 bytes: longer than toy-v4's 128-token radix window
PROMPTS = [BASE + "Alpha", BASE + "Beta gamma", BASE[:40] + "zz", BASE + "Alpha", "short", "sho"]
SP = SamplingParams(max_tokens=8, temperature=0, logprobs=3)


def _run(llm, prompts):
    return [llm.generate(p, SP)[0] for p in prompts]


@pytest.mark.parametrize("model", ["toy-v4", "toy-v3"])
def test_logits_with_prefix_hits_equal_logits_without(model):
    plain = _run(LLM(model=model, device="cpu", max_num_batched_tokens=64), PROMPTS)
    llm = LLM(model=model, device="cpu", max_num_batched_tokens=64, enable_prefix_caching=True)
    cached = _run(llm, PROMPTS)
    assert [o.num_cached_tokens for o in cached[:4]] == [0, 271, 41, 275]  # short shared prefixes hit too
    assert cached[5].num_cached_tokens == 3  # "sho" reuses the first tokens of "short" (bos + 's' 'h')
    for a, b in zip(plain, cached):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert abs(la.logprob - lb.logprob) < 1e-4
            assert [t for t, _ in la.top] == [t for t, _ in lb.top]
    llm.engine.prefix_cache.radix.check_invariants()
    st = llm.engine.stats
    assert st.prefix_hit_tokens == sum(o.num_cached_tokens for o in cached)


def test_concurrent_requests_share_a_prompt_being_prefilled():
    llm = LLM(model="toy-v4", device="cpu", max_num_batched_tokens=32, enable_prefix_caching=True)
    ref = LLM(model="toy-v4", device="cpu", max_num_batched_tokens=32)
    prompts = [BASE + str(i) for i in range(4)]
    sp = SamplingParams(max_tokens=6, temperature=0)
    a = llm.generate(prompts, sp)
    b = ref.generate(prompts, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_prefix_cache_with_mtp_and_eviction_under_pressure():
    """Small pools: the cache must give pages back (LRU eviction) instead of refusing work, and pages are
    all accounted for at the end."""
    llm = LLM(model="toy-v4", device="cpu", max_num_batched_tokens=32, max_num_seqs=2, enable_prefix_caching=True,
              num_speculative_tokens=1)
    ref = LLM(model="toy-v4", device="cpu", max_num_batched_tokens=32, max_num_seqs=2)
    prompts = [BASE[:200] + str(i) for i in range(5)] + [BASE[:100], BASE[:230] + "x"]
    sp = SamplingParams(max_tokens=5, temperature=0)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == [o.token_ids for o in ref.generate(prompts, sp)]
    cache = llm.engine.prefix_cache
    cache.radix.check_invariants()
    pools = llm.runner.pools
    used_before = pools.token_alloc.num_blocks - pools.token_alloc.num_free
    assert used_before > 0  # cached pages are held by the cache
    cache.radix.reset()
    for alloc in (pools.token_alloc, pools.c4_alloc, pools.c128_alloc):
        assert alloc.num_free == alloc.num_blocks  # every page came back: no leak, no double free


def test_eviction_makes_room(monkeypatch):
    llm = LLM(model="toy-v3", device="cpu", max_num_batched_tokens=64, max_num_seqs=1, enable_prefix_caching=True,
              max_model_len=300)
    pools = llm.runner.pools
    outs = llm.generate([BASE[:250] + str(i) for i in range(6)], SamplingParams(max_tokens=4, temperature=0))
    assert all(len(o.token_ids) == 4 for o in outs)
    # the pool holds ~2 sequences of 300 tokens: caching 6 distinct 250-token prompts needed evictions
    assert llm.engine.prefix_cache.radix.full_size() <= pools.token_alloc.num_blocks * pools.sizes.block_size
