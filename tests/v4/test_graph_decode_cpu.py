"""The graph path of a decode step (static buffers -> context derived on the device -> model), run without capture on
the CPU, against the eager path: same logits, for a ragged batch through window and ratio boundaries, a shrinking
batch (padded rows, reused buckets), MTP verification steps and drafts (a row a token), and steps that must stay
eager (prefill, steps without every token's logits)."""

from __future__ import annotations

import torch

from ascend_dsv4.engine.cuda_graphs import CudaGraphDecoder
from ascend_dsv4.engine.model_runner import ModelRunner
from ascend_dsv4.kv.blocks import SeqBlocks
from ascend_dsv4.models.deepseek_v4.model import DeepseekV4Model
from ascend_dsv4.weights.random_init import init_random_
from v4_helpers import SMALL_POOLS, rel_err, toy_cfg


def _runners(device: str = "cpu"):
    """(cfg, eager runner, graph runner) of one float32 toy model: on the CPU the graph runner's decoder runs the
    static-buffer path without capture; on CUDA it captures."""
    cfg = toy_cfg(index_topk=128)  # >= number of compressed entries: selection cannot differ by ties
    model = init_random_(DeepseekV4Model(cfg, torch.float32, "exact"), 0).eval().to(device)
    eager = ModelRunner(model, SMALL_POOLS, device)
    graph = ModelRunner(model, SMALL_POOLS, device, cuda_graphs=True, max_graph_batch=8)
    if graph.graphs is None:
        graph.graphs = CudaGraphDecoder(model, graph.pools, max_batch=8)
    return cfg, eager, graph


def test_graph_path_decode_equals_eager_decode(device: str = "cpu"):
    """(also run on CUDA, with capture, by tests/v4/test_cuda_graphs.py)"""
    cfg, eager, graph = _runners(device)
    g = torch.Generator().manual_seed(0)
    lens = [124, 30, 5, 250, 1, 62]  # decode crosses 128 / 256 (ratio-128 entries) and the window (32)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    se = [eager.new_sequence() for _ in lens]
    sg = [graph.new_sequence() for _ in lens]
    for a, b, p in zip(se, sg, prompts):  # prefill: eager, but for the one-token prompt (a decode step by shape)
        assert rel_err(graph.step([b], [p]), eager.step([a], [p])) < 1e-5
    assert graph.graphs.replays == 1
    live = list(range(len(lens)))
    steps = 1
    for i in range(40):
        if i in (15, 28):  # requests finish: the batch shrinks (fewer real rows in a bucket, then a smaller bucket)
            live = live[1::2] if i == 15 else live[:1]
        toks = [[int(x)] for x in torch.randint(0, cfg.vocab_size, (len(live),), generator=g)]
        want = eager.step([se[j] for j in live], toks)
        got = graph.step([sg[j] for j in live], toks)
        steps += 1
        assert got.shape == want.shape
        assert rel_err(got, want) < 1e-5, i
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert graph.last_prepare_s > 0
    assert graph.graphs.replays == steps
    assert {k[0] for k in graph.graphs.graphs} == {8, 4, 1}  # buckets of 6, 3 and 1 rows
    for a, b in zip(se, sg):
        assert a.num_tokens == b.num_tokens


def test_graph_path_execute_hidden_and_eager_fallbacks():
    cfg, eager, graph = _runners()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (40, 127)]
    se, sg = [eager.new_sequence() for _ in prompts], [graph.new_sequence() for _ in prompts]
    eager.step(se, prompts)
    graph.step(sg, prompts)
    toks = [[3], [4]]
    # execute (the engine's call): logits and the hidden states of every row; sequences not advanced
    le, he = eager.execute(se, toks, [0, 1])
    lg, hg = graph.execute(sg, toks, [0, 1])
    assert graph.graphs.replays == 1 and sg[0].num_tokens == 40
    assert rel_err(lg, le) < 1e-5 and rel_err(hg.float(), he.float()) < 1e-5
    # a verification step (2 tokens for one sequence, every token's logits) replays a graph: a row a token
    le, he = eager.execute(se, [[3, 5], [4]], [0, 1, 2])
    lg, hg = graph.execute(sg, [[3, 5], [4]], [0, 1, 2])
    assert graph.graphs.replays == 2 and hg.shape[0] == 3
    assert rel_err(lg, le) < 1e-5 and rel_err(hg.float(), he.float()) < 1e-5
    # a step without every row's logits, or without them in token order, runs eagerly
    graph.execute(sg, toks, [1])
    graph.execute(sg, [[3, 5], [4]], [1, 2])
    graph.execute(sg, [[3, 5], [4]], [1, 0, 2])
    assert graph.graphs.replays == 2


def test_graph_path_verification_and_draft_equal_eager(device: str = "cpu"):
    """MTP speculation on the graph path (also run on CUDA, with capture, by tests/v4/test_cuda_graphs.py): steps
    where some sequences verify a draft ([x, d]: two rows, the second reading the KV, compressor state and entry
    the first writes in the same step), then accept it (2 positions committed) or not (1), then the MTP draft over
    the committed positions (a row each, the main hidden states as input). Logits, hidden states and draft logits
    equal the eager runner's through window, page and ratio-4 / 128 boundaries."""
    cfg, eager, graph = _runners(device)
    graph.graphs.allow_rows(16)
    g = torch.Generator().manual_seed(5)
    lens = [124, 30, 5, 253, 62, 14]  # 253 + 3k: every position mod 4 and the 256 boundary are crossed
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    se = [eager.new_sequence() for _ in lens]
    sg = [graph.new_sequence() for _ in lens]
    eager.step(se, prompts)
    graph.step(sg, prompts)
    rand = lambda n: torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    replays, verified, drafted = graph.graphs.replays, 0, 0
    for i in range(24):
        live = list(range(len(lens))) if i < 16 else [0, 3]  # the batch shrinks: padded rows in a bucket
        spec = [(i + j) % 3 != 0 for j in live]  # which sequences verify a draft this step
        toks = [rand(2 if sp else 1) for sp in spec]
        rows = list(range(sum(len(t) for t in toks)))
        le, he = eager.execute([se[j] for j in live], toks, rows)
        lg, hg = graph.execute([sg[j] for j in live], toks, rows)
        assert rel_err(lg, le) < 1e-5 and rel_err(hg.float(), he.float()) < 1e-5, i
        verified += 1
        # commit: a draft accepted on every other step, rejected otherwise (rollback to one position)
        counts = [2 if sp and (i + j) % 2 else 1 for j, sp in zip(live, spec)]
        starts = [se[j].num_tokens for j in live]
        offs = [sum(len(t) for t in toks[:k]) for k in range(len(live))]
        hrows = torch.cat([torch.arange(o, o + n) for o, n in zip(offs, counts)])
        nxt = rand(sum(counts))
        de = eager.draft([SeqBlocks(se[j].token, se[j].c4, se[j].c128, s) for j, s in zip(live, starts)], counts,
                         nxt, he, hrows)
        dg = graph.draft([SeqBlocks(sg[j].token, sg[j].c4, sg[j].c128, s) for j, s in zip(live, starts)], counts,
                         nxt, hg, hrows)
        assert dg.shape == de.shape == (len(live), cfg.vocab_size)
        assert rel_err(dg, de) < 1e-5, i
        assert torch.equal(dg.argmax(-1), de.argmax(-1))
        drafted += 1
        for j, s, n in zip(live, starts, counts):
            for r, seq in ((eager, se[j]), (graph, sg[j])):
                seq.num_tokens = s + n
                r.pools.trim(seq)
    assert graph.graphs.replays == replays + verified + drafted
    keys = list(graph.graphs.graphs)
    assert any(k[0] == "mtp" for k in keys) and any(k[0] > 8 for k in keys if k[0] != "mtp")  # > 8 rows: allow_rows
