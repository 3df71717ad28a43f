"""Data-parallel attention + expert-parallel MoE (``--data-parallel-size``) on the mp executor, CPU / gloo:
greedy outputs of DP 2 x TP 1 (V4) and DP 2 x TP 2 (V3) equal world size 1; an idle replica runs dummy steps
that meet the other replica's all-to-alls; the front end balances by outstanding tokens and follows a cached
prefix; bad layouts fail before any worker starts."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ascend_dsv4 import LLM, SamplingParams
from ascend_dsv4.engine.executor import ExecutorError
from ascend_dsv4.errors import ConfigError

pytestmark = pytest.mark.distributed

SHARED = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]
PROMPTS = [SHARED + [(5 * i + j) % 1000 + 3 for j in range(13 + 9 * i)] for i in range(3)]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
KW = dict(max_model_len=256, max_num_batched_tokens=24)


@pytest.fixture(autouse=True)
def _bounded(monkeypatch):
    monkeypatch.setenv("ASCEND_DSV4_MP_TIMEOUT", "60")


def _ids(outs):
    return [o.token_ids for o in outs]


def test_dp2_tp1_ep_v4_equals_one_device_idle_replica_and_affinity():
    one = LLM("toy-v4", enable_prefix_caching=True, **KW)
    want = _ids(one.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm = LLM("toy-v4", data_parallel_size=2, enable_expert_parallel=True, enable_prefix_caching=True, **KW)
    try:
        eng = llm.engine
        assert len(eng.engines) == 2 and llm.executor.world == 2
        assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
        # least outstanding tokens: the three requests were spread over both replicas
        assert all(e.stats.prompt_tokens > 0 for e in eng.engines)
        # one request alone: the other replica is idle and sends a dummy step for every step of the busy one
        calls = [e.runner.calls for e in eng.engines]
        steps = [e.stats.steps for e in eng.engines]
        alone = [1, 2, 3, 4, 5] + [600 + j for j in range(30)]  # no shared prefix with PROMPTS
        got = _ids(llm.generate([alone], GREEDY, use_tqdm=False))
        assert got == _ids(one.generate([alone], GREEDY, use_tqdm=False))
        busy = [e.stats.steps - s for e, s in zip(eng.engines, steps)]
        assert sorted(busy)[0] == 0 and sorted(busy)[1] > 1
        idle = busy.index(0)
        assert eng.engines[idle].runner.calls - calls[idle] == max(busy)  # one dummy per step of the other
        # prefix affinity: a prompt sharing a cached prefix goes to the replica that caches it even when the
        # other replica has fewer outstanding tokens
        holder = [d for d, e in enumerate(eng.engines) if e.prefix_cache.radix.match_prefix(PROMPTS[2][:-1]).length]
        assert holder
        req = eng.make_request(PROMPTS[2] + [41, 42], GREEDY)
        lighter = [eng.outstanding(e) for e in eng.engines]
        eng.engines[holder[0]].add_request([900 + j for j in range(60)], GREEDY)  # the holder is now busier
        assert eng.outstanding(eng.engines[holder[0]]) > eng.outstanding(eng.engines[1 - holder[0]]) >= min(lighter)
        assert eng.pick(req) == holder[0]
        eng.engines[holder[0]].abort_request(next(iter(eng.engines[holder[0]].requests)))
        eng.engines[holder[0]].step()  # drops the aborted request (no forward: nothing scheduled)
        outs = llm.generate([PROMPTS[2] + [41, 42]], GREEDY, use_tqdm=False)
        assert outs[0].num_cached_tokens > 0
        assert _ids(outs) == _ids(one.generate([PROMPTS[2] + [41, 42]], GREEDY, use_tqdm=False))
    finally:
        llm.shutdown()


def test_dp2_tp2_ep_v3_equals_one_device_and_killed_worker():
    one = LLM("toy-v3", **KW)
    want = _ids(one.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm = LLM("toy-v3", data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True, **KW)
    try:
        assert llm.executor.world == 4
        assert [i["replica"] for i in llm.executor.ready_info] == [0, 0, 1, 1]
        assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
        assert all(e.stats.prompt_tokens > 0 for e in llm.engine.engines)
        # a rank of replica 1 dies: the step fails with an error naming a rank, bounded; then the executor is down
        os.kill(llm.executor.worker_pids[3], signal.SIGKILL)
        t = time.monotonic()
        with pytest.raises(ExecutorError, match=r"worker rank \d (died|closed|failed)"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - t < 30
        with pytest.raises(ExecutorError, match="the dp executor is down"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert not any(p.is_alive() for p in llm.executor.procs)


def test_dp2_compact_answers_sampled_and_logprob_requests_equal_one_device():
    """The replicas' rank 0 sends back every row's argmax and only the rows the engine needs in full (a request
    sampled with a seed, one asking logprobs; any non-finite row): outputs, logprobs and seeded samples equal one
    device, and a greedy-only step moves no logits row through the pipe."""
    params = [SamplingParams(max_tokens=6, temperature=0.0),
              SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=1234),
              SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)]
    want = LLM("toy-v4", **KW).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM("toy-v4", data_parallel_size=2, enable_expert_parallel=True, **KW)
    try:
        answers = []
        call = llm.executor.call

        def spy(replica, op, args):
            out = call(replica, op, args)
            if op == "execute":
                answers.append((len(args[2]), args[4], out))
            return out

        llm.executor.call = spy
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        assert _ids(got) == _ids(want)
        assert len(got[2].logprobs) == len(want[2].logprobs) == 6
        for g, w in zip(got[2].logprobs, want[2].logprobs):
            assert g.token == w.token and [t for t, _ in g.top] == [t for t, _ in w.top]
            assert abs(g.logprob - w.logprob) < 1e-5 and all(abs(a[1] - b[1]) < 1e-5 for a, b in zip(g.top, w.top))
        assert answers and all(isinstance(a, tuple) and len(a) == 4 for *_, a in answers)
        for rows, full, (logits, kept, argmax, bad) in answers:
            assert kept == sorted(set(full) | set(bad)) and logits.shape[0] == len(kept) and len(argmax) == rows
        assert sum(len(full) for _, full, _ in answers) < sum(rows for rows, _, _ in answers)
        answers.clear()
        llm.generate(PROMPTS, [params[0]] * 3, use_tqdm=False)
        assert answers and all(a[2][0].shape[0] == 0 for a in answers)
    finally:
        llm.shutdown()


def test_cli_generate_and_info_with_dp(capsys):
    from ascend_dsv4.entrypoints.cli import main

    args = ["generate", "--model", "toy-v4", "--prompt", "hello there", "--max-tokens", "4", "--device", "cpu"]
    assert main(args) == 0
    want = capsys.readouterr().out
    assert main(args + ["--data-parallel-size", "2"]) == 0  # EP implied
    assert capsys.readouterr().out == want
    assert main(["info", "--model", "toy-v4", "-dp", "4"]) == 0
    out = capsys.readouterr().out
    assert "data_parallel_size=4 attention replicas x tensor_parallel_size=1" in out
    assert "expert-parallel over all 4 ranks (4 per rank)" in out


@pytest.mark.parametrize("kw, match", [
    (dict(data_parallel_size=0, enable_expert_parallel=True), "data_parallel_size must be a positive integer"),
    (dict(data_parallel_size="2", enable_expert_parallel=True), "data_parallel_size must be a positive integer"),
    (dict(data_parallel_size=3, enable_expert_parallel=True), "n_routed_experts = 16 is not divisible"),
    (dict(data_parallel_size=2, enable_expert_parallel=True, distributed_executor_backend="spark"),
     "must be .mp. or .ray."),
    (dict(data_parallel_size=2, enable_expert_parallel=True, num_speculative_tokens=2), "0 or 1"),
    (dict(data_parallel_size=2, async_scheduling=True, num_speculative_tokens=1), "does not work with speculative"),
])
def test_bad_dp_layout_fails_before_workers_start(kw, match):
    with pytest.raises(ConfigError, match=match):
        LLM("toy-v4", **KW, **kw)


def test_dp_refuses_the_allreduce_ep_fallback(monkeypatch):
    monkeypatch.setenv("ASCEND_DSV4_EP_COMM", "allreduce")
    with pytest.raises(ConfigError, match="needs ASCEND_DSV4_EP_COMM=alltoall"):
        LLM("toy-v4", data_parallel_size=2, enable_expert_parallel=True, **KW)


def test_serve_over_dp2_concurrent_completions_equal_one_device():
    import concurrent.futures

    import httpx

    from ascend_dsv4.engine.async_engine import AsyncEngine
    from ascend_dsv4.entrypoints.server import ServerThread, create_app
    from ascend_dsv4.errors import RequestError

    one = LLM("toy-v4", **KW)
    want = _ids(one.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm = LLM("toy-v4", data_parallel_size=2, enable_expert_parallel=True, **KW)
    with pytest.raises(RequestError, match="not available with data_parallel_size > 1"):
        llm.logits(PROMPTS[0])
    eng = AsyncEngine(llm.engine, max_queue=64, ops_context=llm._ops)
    server = ServerThread(create_app(eng, ["toy-v4"])).start()
    try:
        def complete(p):
            r = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"model": "toy-v4", "prompt": p, "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            texts = list(pool.map(complete, PROMPTS))
        assert texts == [one.tokenizer.decode(w) for w in want]
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/metrics").status_code == 200
    finally:
        server.stop()
        eng.shutdown()
        llm.shutdown()


def test_dp2_preemption_inside_a_replica_equals_one_device(monkeypatch):
    from ascend_dsv4.engine import model_runner
    from ascend_dsv4.kv.blocks import PoolSizes

    # 6 token pages of 16 per replica: three requests on a replica exhaust them -> preemption by recompute
    monkeypatch.setattr(model_runner, "plan_pool_sizes", lambda cfg, B, *a: PoolSizes(B, 4, 1, 6, 64, 8))
    prompts = PROMPTS + [p + [77, 78] for p in PROMPTS]
    one = LLM("toy-v4", enable_prefix_caching=True, **KW)
    want = _ids(one.generate(prompts, GREEDY, use_tqdm=False))
    assert one.engine.scheduler.num_preemptions > 0
    llm = LLM("toy-v4", data_parallel_size=2, enable_expert_parallel=True, enable_prefix_caching=True, **KW)
    try:
        assert _ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
        assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()


MSM_FIX = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "msmodelslim")


@pytest.mark.parametrize("case, tp", [("dsv3_w8a8_dynamic_v0", 1), ("dsv3_mix_w8a8_w4a8_v1", 1),
                                      ("dsv3_w8a8_dynamic_v0", 2)])
def test_dp2_msmodelslim_equals_one_device_with_an_idle_replica(case, tp):
    """msModelSlim checkpoints (the real tool's tiny DeepSeek-V3 fixtures: W8A8_DYNAMIC, mixed W8A8 / W4A8) under
    DP 2 x TP 1 and TP 2 with EP: the quantised routed experts take rows by all-to-all dispatch / combine (under
    TP 2 a replica's tokens split over its two ranks first; its linears split as under TP), and an idle
    replica's dummy steps run them on zero tokens. Greedy outputs equal world size 1, also for a request alone
    (the other replica idle for every step)."""
    from ascend_dsv4.layers.experts import dummy_moe_step  # noqa: F401 - the path the idle replica takes

    folder = os.path.join(MSM_FIX, case)
    kw = dict(device="cpu", dtype="float32", allow_float_mtp=True, progress=False, max_model_len=64)
    prompts = [[(11 * i + 5) % 120 + 3 for i in range(12)], [(7 * i + 1) % 120 + 3 for i in range(9)],
               [(5 * i + 2) % 120 + 3 for i in range(7)]]
    sp = SamplingParams(max_tokens=5, temperature=0.0)
    one = LLM(folder, **kw)
    want = _ids(one.generate(prompts, sp, use_tqdm=False))
    alone = [[(13 * i + 4) % 120 + 3 for i in range(10)]]
    want_alone = _ids(one.generate(alone, sp, use_tqdm=False))
    llm = LLM(folder, data_parallel_size=2, tensor_parallel_size=tp, enable_expert_parallel=True, **kw)
    try:
        eng = llm.engine
        assert llm.executor.world == 2 * tp
        assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == want
        assert all(e.stats.prompt_tokens > 0 for e in eng.engines)
        calls = [e.runner.calls for e in eng.engines]
        steps = [e.stats.steps for e in eng.engines]
        assert _ids(llm.generate(alone, sp, use_tqdm=False)) == want_alone
        busy = [e.stats.steps - s for e, s in zip(eng.engines, steps)]
        idle = busy.index(0)
        assert eng.engines[idle].runner.calls - calls[idle] == max(busy) > 1  # a dummy step per busy step
    finally:
        llm.shutdown()


@pytest.mark.parametrize("model", ["toy-v4", "toy-v3"])
def test_dp2_mtp_speculation_equals_one_device_with_an_idle_replica(model, monkeypatch):
    """MTP speculative decoding under DP 2 x TP 1 with EP: every step of every replica sends one main and one MTP
    forward (real or a dummy on zero tokens: the MTP module's experts are EP too). The MTP forwards run on the
    replicas' ranks over the hidden states kept there; their drafts are then replaced two times out of three by
    the true next token (the toys' random MTP modules never guess it), so that accepted drafts skip steps and
    rejected ones roll back. Greedy outputs equal world size 1 without speculation; a request alone leaves the
    other replica idle, which sends a dummy main and a dummy MTP step for every step of the busy one."""
    from ascend_dsv4.engine import spec_decode

    one = LLM(model, **KW)
    want = _ids(one.generate(PROMPTS, GREEDY, use_tqdm=False))
    alone = [[1, 2, 3, 4, 5] + [600 + j for j in range(30)]]
    want_alone = _ids(one.generate(alone, GREEDY, use_tqdm=False))
    ref = {tuple(p): w for p, w in zip(PROMPTS + alone, want + want_alone)}
    real, calls, drafts = spec_decode.MTPDrafter.catch_up, [0], {}

    def oracle(self, items, streams):
        res = real(self, items, streams)  # the MTP module ran (on the replica's ranks under DP)
        out = []
        for (r, *_), x in zip(items, res):
            if x is not None:
                key = (tuple(r.prompt_ids), len(r.output_ids))
                if key[1]:  # a draft that is kept (after a prompt's last chunk; one after an earlier chunk
                    drafts.setdefault(calls[-1], {})[key] = x[0]  # depends on where the chunk ended)
                calls[0] += 1
                truth = ref[key[0]]
                tok = truth[key[1]] if key[1] < len(truth) else x[0]
                x = (tok if calls[0] % 3 else (tok + 1) % 1000, x[1])
            out.append(x)
        return out

    monkeypatch.setattr(spec_decode.MTPDrafter, "catch_up", oracle)
    calls.append("one")  # drafts[run] = {(prompt, outputs so far): the MTP draft}
    LLM(model, num_speculative_tokens=1, **KW).generate(PROMPTS, GREEDY, use_tqdm=False)
    calls[-1] = "dp"
    llm = LLM(model, data_parallel_size=2, enable_expert_parallel=True, num_speculative_tokens=1, **KW)
    try:
        eng = llm.engine
        assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
        st = eng.stats
        assert 0 < st.mtp_accepted < st.mtp_proposed
        # the MTP forwards on the replicas' ranks draft what one device drafts at the same point
        common = drafts["one"].keys() & drafts["dp"].keys()
        assert len(common) >= 6 and all(drafts["one"][k] == drafts["dp"][k] for k in common)
        assert all(e.runner.draft_calls == e.runner.calls for e in eng.engines)  # one of each per step
        counts = [(e.runner.calls, e.runner.draft_calls) for e in eng.engines]
        steps = [e.stats.steps for e in eng.engines]
        assert _ids(llm.generate(alone, GREEDY, use_tqdm=False)) == want_alone
        busy = [e.stats.steps - s for e, s in zip(eng.engines, steps)]
        idle = busy.index(0)
        r = eng.engines[idle].runner
        assert r.calls - counts[idle][0] == r.draft_calls - counts[idle][1] == max(busy) > 1
    finally:
        llm.shutdown()
