"""The ``mp`` executor behind LLM: greedy outputs under TP 2 (with chunked prefill, prefix caching, MTP
speculation) and TP 2 + EP equal world size 1; a killed worker turns into a clean, bounded error and leaves no
process behind; a bad layout fails before any worker starts."""

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


def _outputs(llm):
    # the first request alone, then all together: later ones hit the prefix cache
    first = llm.generate(PROMPTS[:1], GREEDY)
    rest = llm.generate(PROMPTS, GREEDY)
    return [o.token_ids for o in first + rest]


@pytest.fixture(autouse=True)
def _bounded(monkeypatch):
    monkeypatch.setenv("ASCEND_DSV4_MP_TIMEOUT", "60")


def test_tp2_greedy_prefix_cache_mtp_chunked_preemption_equals_one_device(monkeypatch):
    from ascend_dsv4.kv.blocks import PoolSizes

    # 6 token pages of 16: three requests together exhaust them -> preemption by recompute
    from ascend_dsv4.engine import model_runner

    monkeypatch.setattr(model_runner, "plan_pool_sizes", lambda cfg, B, *a: PoolSizes(B, 4, 1, 6, 64, 8))
    kw = dict(max_model_len=256, max_num_batched_tokens=24, enable_prefix_caching=True, num_speculative_tokens=1)
    one = LLM("toy-v4", **kw)
    want = _outputs(one)
    assert one.engine.scheduler.num_preemptions > 0
    llm = LLM("toy-v4", tensor_parallel_size=2, distributed_executor_backend="mp", **kw)
    try:
        assert llm.engine.stats.steps == 0
        got = _outputs(llm)
        assert got == want
        assert llm.engine.stats.mtp_proposed > 0 and llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.stats.prefix_hit_tokens > 0
        # a worker that raises (here: a row index past the end) reports its error, the call fails cleanly
        import torch

        bad = (torch.zeros(1, llm.cfg.hc_mult, llm.cfg.dim), torch.tensor([5]))
        with pytest.raises(ExecutorError, match=r"worker rank 1 failed during logits: IndexError"):
            llm.executor.run("logits", lambda *a: None, bad)
        with pytest.raises(ExecutorError, match="the mp executor is down"):
            llm.generate(PROMPTS[:1], GREEDY)
    finally:
        llm.shutdown()
    assert not any(p.is_alive() for p in llm.executor.procs)


def test_v3_tp2_ep_greedy_and_killed_worker():
    want = _outputs(LLM("toy-v3", max_model_len=256))
    llm = LLM("toy-v3", max_model_len=256, tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        assert _outputs(llm) == want
        pid = llm.executor.worker_pids[0]
        os.kill(pid, signal.SIGKILL)
        t = time.monotonic()
        with pytest.raises(ExecutorError, match=r"worker rank 1 (died|closed)"):
            llm.generate(PROMPTS[:1], GREEDY)
        assert time.monotonic() - t < 30
        with pytest.raises(ExecutorError, match="the mp executor is down"):
            llm.generate(PROMPTS[:1], GREEDY)
    finally:
        llm.shutdown()
    assert not any(p.is_alive() for p in llm.executor.procs)


def test_bad_layout_fails_before_workers_start():
    with pytest.raises(ConfigError, match=r"o_groups = 2 is not divisible by tensor_parallel_size 4"):
        LLM("toy-v4", tensor_parallel_size=4)
    with pytest.raises(ConfigError, match="distributed_executor_backend must be 'mp'"):
        LLM("toy-v4", tensor_parallel_size=2, distributed_executor_backend="ray")


def test_cli_generate_tp2_matches_one_device(capsys):
    from ascend_dsv4.entrypoints.cli import main

    args = ["generate", "--model", "toy-v4", "--prompt", "hello there", "--max-tokens", "4", "--device", "cpu"]
    assert main(args) == 0
    want = capsys.readouterr().out
    assert main(args + ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]) == 0
    assert capsys.readouterr().out == want
