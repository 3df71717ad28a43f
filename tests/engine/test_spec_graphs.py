"""MTP speculation on the graph path (engine/cuda_graphs.py: verification steps a row a token, drafts from graphs of
their own), through the engine: greedy outputs equal the eager engine without speculation. On the CPU the decoder runs
the static-buffer path without capture (the code CUDA captures); tests/v4/test_cuda_graphs.py captures it on a GPU."""

from __future__ import annotations

from ascend_dsv4 import LLM, SamplingParams
from ascend_dsv4.engine.cuda_graphs import CudaGraphDecoder
from ascend_dsv4.engine.engine import LLMEngine

OVER = dict(window_size=16, index_topk=64)  # short window: decode crosses window and ratio-4 / 128 boundaries
PROMPTS = [[11, 12, 13], list(range(100, 140)), list(range(300, 429)), [7] * 17]


def _llm(spec: int, graphs: bool) -> LLM:
    llm = LLM("toy-v4", device="cpu", dtype="float32", max_num_seqs=4, max_model_len=320, max_num_batched_tokens=256,
              config_overrides=OVER, progress=False, num_speculative_tokens=spec)
    if graphs:
        r = llm.runner
        r.graphs = CudaGraphDecoder(r.model, r.pools, max_batch=4)  # CPU: the graph path, uncaptured
        r.graphs.allow_rows(8)  # what the engine does when it is built with graphs (checked below)
    return llm


def test_speculative_graph_steps_give_the_eager_greedy_outputs():
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (24, 9, 30, 16)]
    want = [o.token_ids for o in _llm(0, False).generate(PROMPTS, params, use_tqdm=False)]
    llm = _llm(1, True)
    got = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    keys = list(llm.runner.graphs.graphs)
    assert any(k[0] == "mtp" for k in keys), keys  # drafts replayed graphs
    assert any(k[0] != "mtp" and k[0] > 4 for k in keys), keys  # verification steps of > max_num_seqs rows did
    stats = llm.engine.stats
    assert stats.mtp_proposed > 0


def test_engine_lets_verification_steps_replay():
    llm = _llm(0, True)
    r = llm.runner
    r.graphs = CudaGraphDecoder(r.model, r.pools, max_batch=4)
    assert r.graphs.buckets[-1] == 4
    LLMEngine(r, llm.tokenizer, 320, max_num_seqs=4, num_speculative_tokens=0)
    assert r.graphs.buckets[-1] == 4
    LLMEngine(r, llm.tokenizer, 320, max_num_seqs=4, num_speculative_tokens=1)
    assert r.graphs.buckets[-1] == 8
