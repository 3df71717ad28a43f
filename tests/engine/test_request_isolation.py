"""Issue 10 item 1: no request can kill the engine.

Penalties and temperatures are validated to finite-arithmetic ranges; non-finite logits of one row end that
request with an error (never token 0); an exception while sampling / detokenising one request ends only that
request; the engine, its pools and the other requests go on."""

from __future__ import annotations

import math

import pytest
import torch

from ascend_dsv4 import LLM, SamplingParams
from ascend_dsv4.engine.sampling import Sampler, make_generator
from ascend_dsv4.engine.sampling_guard import bad_logit_rows, check_distribution
from ascend_dsv4.errors import RequestError, RequestFailed


@pytest.mark.parametrize("field,value", [
    ("repetition_penalty", 1e-300), ("repetition_penalty", 1e-39), ("repetition_penalty", 0.0),
    ("repetition_penalty", 1e300), ("repetition_penalty", float("nan")),
    ("temperature", 1e300), ("temperature", 1e5), ("temperature", -1e-9),
])
def test_penalty_and_temperature_ranges(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})


def test_range_edges_are_accepted():
    SamplingParams(repetition_penalty=0.01)
    SamplingParams(repetition_penalty=100.0)
    SamplingParams(temperature=1e4)


def test_bad_logit_rows():
    x = torch.zeros(5, 8)
    x[1, 3] = math.nan
    x[2, 0] = math.inf
    x[3, :] = -math.inf
    x[4, :4] = -math.inf  # a mask: fine
    assert bad_logit_rows(x) == [1, 2, 3]
    assert bad_logit_rows(torch.empty(0, 8)) == []


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_refuses_nan_row_instead_of_token_0(temperature):
    x = torch.randn(2, 16)
    x[1, 5] = math.nan
    with pytest.raises(RequestFailed, match="non-finite logits"):
        Sampler().sample(x, [SamplingParams(temperature=temperature)] * 2, [None, None])


def test_overflow_after_temperature_is_a_request_failure():
    x = torch.full((1, 16), -1.0)
    x[0, :2] = 3e38  # finite logits, inf after / temperature
    with pytest.raises(RequestFailed, match="not a distribution"):
        Sampler().sample(x, [SamplingParams(temperature=1e-4)], [make_generator(0)])
    with pytest.raises(RequestFailed):
        check_distribution(torch.tensor([0.0, 0.0]))
    check_distribution(torch.tensor([0.0, 1.0]))


@pytest.fixture(scope="module")
def llm():
    return LLM(model="toy-v4", device="cpu", max_num_seqs=4)


def _pools_free(llm):
    p = llm.runner.pools
    return (p.token_alloc.num_free, p.c4_alloc.num_free, p.c128_alloc.num_free) == \
        (p.token_alloc.num_blocks, p.c4_alloc.num_blocks, p.c128_alloc.num_blocks)


def test_nan_logits_end_one_request_only(llm, monkeypatch):
    greedy = SamplingParams(max_tokens=6, temperature=0)
    want = llm.generate(["good prompt"], greedy)[0].token_ids
    eng = llm.engine
    real = llm.runner.model.logits
    poisoned = {}

    def logits(streams, rows):
        out = real(streams, rows).clone()
        # the row of the request registered as poisoned gets a NaN
        for j, r in enumerate(poisoned.get("rows", [])):
            out[r, 7] = math.nan
        return out

    real_step = eng.step

    def step():
        reqs = [r for r in eng.scheduler.running + list(eng.scheduler.waiting)]
        bad = [r for r in reqs if r.prompt == "bad prompt"]
        poisoned["rows"] = []
        if bad and eng.stats.generation_tokens >= 2:  # after a couple of tokens: a mid-stream failure
            poisoned["rows"] = [0] if reqs[0] is bad[0] else [1]
        return real_step()

    monkeypatch.setattr(llm.runner.model, "logits", logits)
    monkeypatch.setattr(eng, "step", step)
    outs = llm.generate(["bad prompt", "good prompt"], greedy)
    monkeypatch.undo()
    bad, good = outs
    assert bad.finished and bad.finish_reason == "abort" and "non-finite logits" in bad.error
    assert len(bad.token_ids) < greedy.max_tokens  # it ended early, nothing sampled from the NaN row
    assert good.error is None and good.token_ids == want
    assert _pools_free(llm)
    # the engine goes on serving
    assert llm.generate(["good prompt"], greedy)[0].token_ids == want


def test_detokenizer_exception_ends_one_request_only(llm, monkeypatch):
    greedy = SamplingParams(max_tokens=5, temperature=0)
    want = llm.generate(["other"], greedy)[0].token_ids
    eng = llm.engine
    real_make = eng.make_request

    def make_request(prompt, params=None, request_id=None):
        req = real_make(prompt, params, request_id)
        if prompt == "boom":
            def push(tok):
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            req.detok.push = push
        return req

    monkeypatch.setattr(eng, "make_request", make_request)
    boom, other = llm.generate(["boom", "other"], greedy)
    monkeypatch.undo()
    assert boom.finish_reason == "abort" and "UnicodeDecodeError" in boom.error
    assert other.error is None and other.token_ids == want
    assert _pools_free(llm)


def test_stop_string_exception_ends_one_request_only(llm, monkeypatch):
    greedy = SamplingParams(max_tokens=4, temperature=0)
    eng = llm.engine
    real_push = type(eng)._push_text

    def push_text(self, r, piece, final=False):
        if r.prompt == "stop-boom":
            raise RuntimeError("injected stop-string failure")
        return real_push(self, r, piece, final)

    monkeypatch.setattr(type(eng), "_push_text", push_text)
    a, b = llm.generate(["stop-boom", "fine"], greedy)
    monkeypatch.undo()
    assert a.finish_reason == "abort" and "injected" in a.error
    assert b.error is None and len(b.token_ids) == 4
    assert _pools_free(llm)
