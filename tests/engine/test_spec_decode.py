"""MTP speculative decoding: identical greedy outputs, accepted drafts, rollback, exact rejection sampling."""

from __future__ import annotations

import pytest
import torch

from ascend_dsv4 import LLM, SamplingParams
from ascend_dsv4.engine import spec_decode
from ascend_dsv4.engine.spec_decode import rejection_accept

PROMPTS = ["Hello " * 10, "x" * 40]
SP = SamplingParams(max_tokens=16, temperature=0)


@pytest.mark.parametrize("model", ["toy-v4", "toy-v3"])
def test_greedy_outputs_identical_with_mtp(model):
    plain = LLM(model=model, device="cpu", max_num_batched_tokens=32).generate(PROMPTS, SP)
    spec = LLM(model=model, device="cpu", max_num_batched_tokens=32, num_speculative_tokens=1)
    out = spec.generate(PROMPTS, SP)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert spec.engine.stats.mtp_proposed > 0
    pools = spec.runner.pools
    assert pools.token_alloc.num_free == pools.token_alloc.num_blocks  # nothing leaked by rollbacks


@pytest.mark.parametrize("model", ["toy-v4", "toy-v3"])
def test_accepted_drafts_and_rollback(model, monkeypatch):
    """A drafter that proposes the true next token two times out of three: accepted drafts skip steps,
    rejected ones roll back, and the output is still exactly the non-speculative one."""
    ref_llm = LLM(model=model, device="cpu")
    ref = {p: o.token_ids for p, o in zip(PROMPTS, ref_llm.generate(PROMPTS, SP))}
    spec = LLM(model=model, device="cpu", num_speculative_tokens=1)
    real = spec_decode.MTPDrafter.catch_up
    calls = [0]

    def oracle(self, items, streams):
        res = real(self, items, streams)
        out = []
        for (r, *_), x in zip(items, res):
            if x is None:
                out.append(None)
                continue
            calls[0] += 1
            truth = ref[r.prompt][len(r.output_ids)] if len(r.output_ids) < len(ref[r.prompt]) else x[0]
            tok = truth if calls[0] % 3 else (truth + 1) % spec.cfg.vocab_size
            out.append((tok, x[1]))
        return out

    monkeypatch.setattr(spec_decode.MTPDrafter, "catch_up", oracle)
    out = spec.generate(PROMPTS, SP)
    assert [o.token_ids for o in out] == [ref[p] for p in PROMPTS]
    st = spec.engine.stats
    assert 0 < st.mtp_accepted < st.mtp_proposed
    assert st.steps < ref_llm.engine.stats.steps


def test_rejection_sampling_preserves_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.1, 0.4, 0.1, 0.3, 0.1])
    counts = torch.zeros(5)
    n = 6000
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=g)[0])
        _, tok = rejection_accept(p, q, d, g)
        counts[tok] += 1
    assert (counts / n - p).abs().max() < 0.025  # ~4 standard errors at n = 6000


def test_seeded_sampling_with_mtp_is_reproducible():
    sp = SamplingParams(max_tokens=12, temperature=0.8, seed=3)
    a = LLM(model="toy-v4", device="cpu", num_speculative_tokens=1).generate("abc", sp)[0].token_ids
    b = LLM(model="toy-v4", device="cpu", num_speculative_tokens=1).generate("abc", sp)[0].token_ids
    assert a == b and len(a) == 12


def test_drafter_takes_compact_draft_logits_and_skips_a_bad_row(monkeypatch):
    """MTPDrafter over runner.draft_rows: greedy requests draft the device argmax, a sampled request draws from
    its row (the only row copied in full), a request whose MTP row is non-finite proposes nothing this step and
    its output is still the non-speculative one."""
    sampled = SamplingParams(max_tokens=8, temperature=0.8, seed=11)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    ref = LLM(model="toy-v4", device="cpu").generate(PROMPTS, greedy)
    spec = LLM(model="toy-v4", device="cpu", num_speculative_tokens=1)
    runner = spec.runner
    seen = []
    real_rows, real_mtp = runner.draft_rows, runner.model.mtp_logits

    def draft_rows(*a, **kw):
        out = real_rows(*a, **kw)
        seen.append((list(a[5]), out))
        return out

    def mtp_logits(*a, **kw):  # the first live row's draft is non-finite in every other MTP forward
        y = real_mtp(*a, **kw).clone()
        if len(seen) % 2:
            y[0, 5] = float("nan")
        return y

    monkeypatch.setattr(runner, "draft_rows", draft_rows)
    monkeypatch.setattr(runner.model, "mtp_logits", mtp_logits)
    out = spec.generate(PROMPTS, greedy)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert any(o.bad_rows == [0] and o.kept == [0] for _, o in seen)  # the bad row came in full, nothing else
    assert all(full == [] for full, _ in seen)
    seen.clear()
    out = spec.generate(PROMPTS, [sampled, greedy])
    assert out[1].token_ids == ref[1].token_ids and len(out[0].token_ids) == 8
    assert any(full == [0] and 0 in o.kept and o.logits.shape[0] == len(o.kept) for full, o in seen)
