"""Async scheduling (engine/overlap.py): the same tokens, texts and finish reasons as the synchronous engine.

On the CPU the runner's graph decoder runs the static-buffer path without capture (the code CUDA captures), so the
device-fed input ids, the launch-ahead and the dropped rows of requests that finished in flight are all exercised
here; tests/engine/test_engine_cuda.py-style runs on the GPU use the same engine code with capture."""

from __future__ import annotations

import pytest
import torch

from ascend_dsv4 import LLM, SamplingParams
from ascend_dsv4.engine.cuda_graphs import CudaGraphDecoder
from ascend_dsv4.errors import RequestError

OVER = dict(window_size=16, index_topk=64)  # short window: decode crosses window and ratio-4 / 128 boundaries


def _llm(async_scheduling: bool, max_num_seqs: int = 4, **kw) -> LLM:
    llm = LLM("toy-v4", device="cpu", dtype="float32", max_num_seqs=max_num_seqs, max_model_len=kw.pop("max_model_len", 320),
              max_num_batched_tokens=256, config_overrides=OVER, progress=False, async_scheduling=async_scheduling,
              **kw)
    r = llm.runner
    r.graphs = CudaGraphDecoder(r.model, r.pools, max_batch=max_num_seqs)  # CPU: the graph path, uncaptured
    return llm


def _count_launches(llm: LLM) -> dict:
    calls = {"first": 0, "ahead": 0}
    orig = llm.runner.launch_greedy

    def launch(seqs, tokens=None, after=None, after_rows=None):
        p = orig(seqs, tokens, after, after_rows)
        if p is not None:
            calls["ahead" if after is not None else "first"] += 1
        return p

    llm.runner.launch_greedy = launch
    return calls


def _run(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.token_ids, o.text, o.finish_reason) for o in outs]


def _prompts(n: int, lens=(5, 40, 129, 17, 70, 3)):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(10, 1000, (lens[i % len(lens)],), generator=g).tolist() for i in range(n)]


def test_greedy_outputs_equal_sync_with_stops_and_lengths():
    prompts = _prompts(4)
    sync = _llm(False)
    base = _run(sync, prompts, [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (30, 9, 21, 2)])
    # stop tokens / strings taken from the synchronous run, so that requests stop while a step is in flight
    stops = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[base[0][0][6]]),
             SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=21, temperature=0, ignore_eos=True, stop=[base[2][1][4:7]] if len(base[2][1]) > 7 else None),
             SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)]
    want = _run(sync, prompts, stops)
    fast = _llm(True)
    calls = _count_launches(fast)
    got = _run(fast, prompts, stops)
    assert got == want
    assert [w[2] for w in want].count("stop") >= 1
    assert calls["first"] == 1 and calls["ahead"] >= 5  # the overlap ran, and went on through the requests' stops
    assert _run(fast, prompts, [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (30, 9, 21, 2)]) == base
    assert calls["first"] == 2 and calls["ahead"] >= 25


def test_admission_sampling_and_prefix_cache_fall_back_and_agree():
    """More requests than max_num_seqs (admission between decode steps), a sampled request in the batch (no
    overlap while it runs) and prefix caching: the async engine gives the synchronous engine's outputs."""
    prompts = _prompts(7)
    prompts[5] = prompts[1][:30] + [7, 8, 9]  # shares a prefix with prompt 1
    params = [SamplingParams(max_tokens=12 + 3 * i, temperature=0, ignore_eos=True) for i in range(7)]
    params[3] = SamplingParams(max_tokens=10, temperature=0.8, seed=11, ignore_eos=True)
    want = _run(_llm(False, max_num_seqs=3, enable_prefix_caching=True), prompts, params)
    fast = _llm(True, max_num_seqs=3, enable_prefix_caching=True)
    calls = _count_launches(fast)
    assert _run(fast, prompts, params) == want
    assert calls["ahead"] > 0


def test_length_limit_of_the_model():
    """Requests that end at max_model_len while steps run ahead."""
    prompts = [_prompts(1, (90,))[0], _prompts(1, (60,))[0]]
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    want = _run(_llm(False, max_model_len=100), prompts, params)
    assert [w[2] for w in want] == ["length", "length"]
    assert _run(_llm(True, max_model_len=100), prompts, params) == want


def test_abort_while_in_flight():
    fast = _llm(True)
    calls = _count_launches(fast)
    e = fast.engine
    free0 = e.runner.pools.token_alloc.num_free
    prompts = _prompts(3)
    p = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ids = [e.add_request(x, p) for x in prompts]
    seen: dict[str, list[int]] = {i: [] for i in ids}
    steps = 0
    while e.has_unfinished():
        for o in e.step():
            seen[o.request_id] = o.token_ids
        steps += 1
        if steps == 6:
            assert e.overlap.inflight is not None
            assert e.abort_request(ids[1])
    assert calls["ahead"] > 0
    want = _run(_llm(False), [prompts[0], prompts[2]], p)
    assert seen[ids[0]] == want[0][0] and seen[ids[2]] == want[1][0]
    assert len(seen[ids[1]]) < 20
    e.step()  # drops a step still in flight
    assert e.runner.pools.token_alloc.num_free == free0


def test_pages_all_returned():
    fast = _llm(True)
    free0 = fast.runner.pools.token_alloc.num_free
    _run(fast, _prompts(4), SamplingParams(max_tokens=15, temperature=0, ignore_eos=True))
    assert fast.engine.overlap.inflight is None or all(r.finished for r in fast.engine.overlap.inflight.reqs)
    fast.engine.step()  # processes (drops) a step still in flight
    assert fast.engine.overlap.inflight is None
    assert fast.runner.pools.token_alloc.num_free == free0


def test_speculative_decoding_is_refused():
    with pytest.raises(RequestError, match="async_scheduling"):
        LLM("toy-v4", device="cpu", dtype="float32", max_model_len=64, progress=False, num_speculative_tokens=1,
            async_scheduling=True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_async_equals_sync(dtype):
    """On the GPU: captured graphs, ids fed on the device from the previous step's argmax, stops in flight."""
    def llm(a):
        return LLM("toy-v4", device="cuda", dtype=dtype, max_num_seqs=4, max_model_len=320, max_num_batched_tokens=256,
                   config_overrides=OVER, progress=False, async_scheduling=a)

    prompts = _prompts(6)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (40, 9, 25, 2, 33, 17)]
    sync = llm(False)
    want = _run(sync, prompts, params)
    params[0] = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[want[0][0][11]])
    want = _run(sync, prompts, params)
    fast = llm(True)
    calls = _count_launches(fast)
    assert _run(fast, prompts, params) == want
    assert calls["ahead"] >= 20
    assert fast.runner.graphs is not None and fast.runner.graphs.replays > 0


def test_nan_logits_end_one_request_only_in_flight(monkeypatch):
    """A request whose logits row turns non-finite while steps run ahead ends with the error; the other's tokens are
    those of the synchronous engine and every page comes back."""
    import math

    prompts = _prompts(2)
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = _run(_llm(False), [prompts[1]], p)[0]
    fast = _llm(True)
    calls = _count_launches(fast)
    eng, model = fast.engine, fast.runner.model
    free0 = fast.runner.pools.token_alloc.num_free
    real = model.logits
    ids = [eng.add_request(x, p) for x in prompts]
    bad_req = eng.requests[ids[0]]

    def logits(streams, rows):
        out = real(streams, rows).clone()
        # row 0 is the first request while it runs (it arrived first); poison it after a few tokens
        if bad_req.status.name == "RUNNING" and len(bad_req.output_ids) >= 3 and out.shape[0] == 2:
            out[0, 7] = math.nan
        return out

    monkeypatch.setattr(model, "logits", logits)
    last = {}
    while eng.has_unfinished():
        for o in eng.step():
            last[o.request_id] = o
    eng.step()  # drops a step still in flight
    bad, good = last[ids[0]], last[ids[1]]
    assert bad.finish_reason == "abort" and "non-finite logits" in bad.error and len(bad.token_ids) < 12
    assert good.error is None and (good.token_ids, good.text, good.finish_reason) == want
    assert calls["ahead"] > 0
    assert fast.runner.pools.token_alloc.num_free == free0
