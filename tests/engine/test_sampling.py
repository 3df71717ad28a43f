import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dsv4.engine.sampling import Sampler, SamplingParams, TokenLogprobs, make_generator
from ascend_dsv4.errors import RequestError

V = 64


@pytest.fixture(autouse=True)
def _global_seed():
    torch.manual_seed(1234)  # unseeded rows draw from the global RNG: keep statistical tests deterministic


def _logits(b=4, v=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * 3


def _sample(logits, params, seeds=None):
    seeds = seeds if seeds is not None else [None] * len(params)
    return Sampler().sample(logits, params, [make_generator(s) for s in seeds])


def test_greedy_is_argmax():
    x = _logits(8)
    out = _sample(x, [SamplingParams(temperature=0.0)] * 8)
    assert out.dtype == torch.int64 and out.shape == (8,)
    assert torch.equal(out, x.argmax(-1))


def test_greedy_ties_lowest_index():
    x = torch.zeros(2, 10)
    x[0, [3, 7]] = 5.0
    x[1] = 1.0
    out = _sample(x, [SamplingParams(temperature=0)] * 2, [1, 2])
    assert out.tolist() == [3, 0]


def test_seed_reproducible_and_batch_independent():
    x = _logits(4)
    p = SamplingParams(temperature=1.0)
    a = [_sample(x, [p] * 4, [11, 22, 33, 44]).tolist() for _ in range(3)]
    assert a[0] == a[1] == a[2]
    # row 2 alone, and inside a different batch with other rows / other params: same token
    alone = _sample(x[2:3], [p], [33]).tolist()[0]
    assert alone == a[0][2]
    other = torch.cat([_logits(3, seed=9), x[2:3]])
    mixed = _sample(other, [SamplingParams(temperature=0), SamplingParams(top_k=5), p, p],
                    [None, 7, None, 33])
    assert mixed[3].item() == a[0][2]


def test_seed_sequence_reproducible_across_steps():
    x = _logits(1)
    p = SamplingParams(temperature=1.5)
    runs = []
    for _ in range(2):
        g = make_generator(123)
        runs.append([Sampler().sample(x, [p], [g]).item() for _ in range(20)])
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1  # the generator advances between steps


def test_make_generator_none():
    assert make_generator(None) is None


def test_top_k_1_is_greedy():
    x = _logits(6)
    out = _sample(x, [SamplingParams(temperature=2.0, top_k=1)] * 6, list(range(6)))
    assert torch.equal(out, x.argmax(-1))


def test_tiny_top_p_is_greedy():
    x = _logits(6)
    out = _sample(x, [SamplingParams(temperature=1.0, top_p=1e-6)] * 6, list(range(6)))
    assert torch.equal(out, x.argmax(-1))


def test_top_k_restricts_support():
    x = _logits(1).expand(2000, V).contiguous()
    k = 5
    out = _sample(x, [SamplingParams(temperature=5.0, top_k=k)] * 2000)
    allowed = set(x[0].topk(k).indices.tolist())
    seen = set(out.tolist())
    assert seen <= allowed
    assert len(seen) == k  # at temperature 5 all five show up in 2000 draws


def test_top_p_keeps_nucleus():
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps {0, 1} (0.5 < 0.7 <= 0.8)
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    x = probs.log().expand(3000, 4).contiguous()
    out = _sample(x, [SamplingParams(top_p=0.7)] * 3000)
    assert set(out.tolist()) == {0, 1}
    frac0 = (out == 0).float().mean().item()
    assert abs(frac0 - 0.5 / 0.8) < 0.05


def test_min_p():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.06, 0.04]])
    x = probs.log().expand(3000, 5).contiguous()
    # min_p=0.4 -> threshold 0.16: keep {0, 1, 2}
    out = _sample(x, [SamplingParams(min_p=0.4)] * 3000)
    assert set(out.tolist()) == {0, 1, 2}
    out = _sample(x[:100], [SamplingParams(min_p=1.0)] * 100)
    assert set(out.tolist()) == {0}


def test_combined_filters_order():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.06, 0.04]])
    x = probs.log().expand(2000, 5).contiguous()
    # top_k=4 -> renormalised [0.417, 0.3125, 0.208, 0.0625]; top_p=0.7 keeps {0,1}; min_p 0.5 keeps {0,1}
    out = _sample(x, [SamplingParams(top_k=4, top_p=0.7, min_p=0.5)] * 2000)
    assert set(out.tolist()) == {0, 1}


def test_temperature_sharpens():
    x = torch.tensor([[1.0, 0.0]]).expand(2000, 2).contiguous()
    hot = _sample(x, [SamplingParams(temperature=1.0)] * 2000).float().mean().item()
    cold = _sample(x, [SamplingParams(temperature=0.2)] * 2000).float().mean().item()
    assert abs(hot - 1 / (1 + math.e)) < 0.05
    assert cold < 0.03


def test_mixed_batch():
    x = _logits(4)
    ps = [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(temperature=0.5),
          SamplingParams(temperature=0)]
    out = _sample(x, ps, [None, None, 5, None])
    am = x.argmax(-1)
    assert out[0] == am[0] and out[1] == am[1] and out[3] == am[3]


def test_sample_shape_errors():
    with pytest.raises(ValueError):
        Sampler().sample(_logits(2), [SamplingParams()], [None])
    assert Sampler().sample(torch.zeros(0, V), [], []).shape == (0,)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 1.5), ("max_tokens", True), ("max_tokens", "4"),
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", True), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", float("nan")), ("top_p", False),
    ("top_k", -2), ("top_k", 2.0), ("top_k", True),
    ("min_p", -0.01), ("min_p", 1.5), ("min_p", float("nan")), ("min_p", True),
    ("seed", 1.0), ("seed", "7"), ("seed", True), ("seed", -1), ("seed", 2**64),
    ("stop_token_ids", [1, -1]), ("stop_token_ids", [1.0]), ("stop_token_ids", [True]), ("stop_token_ids", 5),
    ("ignore_eos", 1), ("ignore_eos", "yes"),
    ("logprobs", -1), ("logprobs", 1.0), ("logprobs", True),
])
def test_invalid_field_raises(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field,value", [
    ("top_k", V + 1), ("stop_token_ids", [0, V]), ("logprobs", V + 1),
])
def test_invalid_with_vocab(field, value):
    p = SamplingParams(**{field: value})  # fine without a vocabulary size
    with pytest.raises(RequestError, match=field) as ei:
        p.validate(vocab_size=V)
    assert str(V) in str(ei.value)


def test_valid_params():
    p = SamplingParams(max_tokens=1, temperature=0, top_p=1, top_k=0, min_p=1, seed=0,
                       stop_token_ids=(1, 2), ignore_eos=True, logprobs=0)
    p.validate(vocab_size=V)
    assert p.stop_token_ids == [1, 2] and isinstance(p.temperature, float)
    SamplingParams(top_k=V, logprobs=V, stop_token_ids=[V - 1]).validate(V)


def test_message_names_range():
    with pytest.raises(RequestError, match=r"top_p.*\(0, 1\]"):
        SamplingParams(top_p=2)


def test_logprobs_match_log_softmax():
    x = _logits(3)
    tokens = torch.tensor([5, 0, 63])
    res = Sampler.logprobs_of(x, tokens, 4)
    ref = torch.log_softmax(x, -1)
    assert len(res) == 3 and all(isinstance(r, TokenLogprobs) for r in res)
    for r in range(3):
        assert res[r].token == tokens[r].item()
        assert res[r].logprob == pytest.approx(ref[r, tokens[r]].item(), abs=1e-5)
        vals, idx = ref[r].topk(4)
        assert [t for t, _ in res[r].top] == idx.tolist()
        assert [v for _, v in res[r].top] == pytest.approx(vals.tolist(), abs=1e-5)
    assert Sampler.logprobs_of(x, [1, 2, 3], 0)[0].top == []
    per_row = Sampler.logprobs_of(x, [1, 2, 3], [None, 2, V + 10])
    assert [len(r.top) for r in per_row] == [0, 2, V]


def test_logprobs_ties_lowest_id_first():
    x = torch.zeros(1, 6)
    res = Sampler.logprobs_of(x, [2], 3)[0]
    assert [t for t, _ in res.top] == [0, 1, 2]
    assert res.logprob == pytest.approx(-math.log(6))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(2, 40), st.integers(0, 2**31 - 1),
       st.floats(0.05, 3.0), st.integers(-1, 50), st.floats(0.01, 1.0), st.floats(0.0, 1.0))
def test_property_sample_in_support(b, v, seed, temp, top_k, top_p, min_p):
    x = _logits(b, v, seed % 1000)
    p = SamplingParams(temperature=temp, top_k=min(top_k, v), top_p=top_p, min_p=min_p)
    out = _sample(x, [p] * b, [seed + i for i in range(b)])
    assert out.shape == (b,) and ((out >= 0) & (out < v)).all()
    k = p.top_k if p.top_k > 0 else v
    topk = x.topk(k, dim=-1).indices
    for r in range(b):
        assert out[r].item() in topk[r].tolist()
    again = _sample(x, [p] * b, [seed + i for i in range(b)])
    assert torch.equal(out, again)


def test_engine_batched_greedy_picks_what_the_sampler_picks():
    """The engine's batched argmax for plain greedy requests (LLMEngine._plain_greedy) gives the token the
    per-request path (penalties, Sampler.sample) gives, ties included; requests with penalties, logprobs, a
    sampled temperature, a draft or a bad row stay on the per-request path."""
    from types import SimpleNamespace

    from ascend_dsv4.engine.engine import LLMEngine
    from ascend_dsv4.engine.sampling import apply_penalties

    g = torch.Generator().manual_seed(5)
    logits = torch.randint(0, 4, (7, 50), generator=g).float()  # many ties
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.0, repetition_penalty=1.2), SamplingParams(temperature=0.7),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)]
    reqs = [SimpleNamespace(params=p) for p in params]
    drafts = [[], [], [], [], [3], [], []]
    by_req = {i: [i] for i in range(7)}
    got = LLMEngine._plain_greedy(reqs, drafts, by_req, {5}, logits)
    assert sorted(got) == [0, 6]
    for i, tok in got.items():
        row = apply_penalties(logits[i:i + 1], [params[i]], [[1, 2]], [[]])
        assert tok == int(Sampler().sample(row, [params[i]], [None])[0])


def test_execute_rows_matches_execute_and_keeps_bad_rows(monkeypatch):
    """ModelRunner.execute_rows: every row's argmax and badness from the device, full logits only for the asked
    rows and the bad ones, equal to execute's rows."""
    from ascend_dsv4 import LLM

    runner = LLM("toy-v4", max_model_len=128).runner
    seqs = [runner.new_sequence() for _ in range(3)]
    toks = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    rows = [2, 4, 8]
    want, _ = runner.execute(seqs, toks, rows)
    out = runner.execute_rows(seqs, toks, rows, [1])
    assert out.kept == [1] and out.bad_rows == [] and torch.equal(out.logits, want[[1]])
    assert out.row_argmax == torch.argmax(want, -1).tolist()
    logits_fn = runner.model.logits

    def poisoned(*a):  # row 2 gets a NaN: it travels in full although not asked for
        y = logits_fn(*a).clone()
        y[2, 3] = float("nan")
        return y

    monkeypatch.setattr(runner.model, "logits", poisoned)
    out = runner.execute_rows(seqs, toks, rows, [0])
    assert out.kept == [0, 2] and out.bad_rows == [2] and torch.isnan(out.logits[1, 3])


def test_compact_logits_indices_survive_the_single_host_copy():
    """compact_logits moves the row maxima and argmaxes in one float32 copy: indices up to V4's 129280-token
    vocabulary come back exact (first maximal index on ties), bad rows in full, NaN / +inf / all -inf rows bad."""
    from ascend_dsv4.engine.model_runner import compact_logits

    x = torch.full((6, 129280), -3.0)
    x[0, 129279] = x[1, 65537] = x[2, 0] = 1.0
    x[3, 16777] = x[3, 100001] = 2.0  # a tie: the first index
    x[4, 5] = float("nan")
    x[5] = float("-inf")
    host, kept, arg, bad = compact_logits(x, [2])
    assert arg[:4] == [129279, 65537, 0, 16777] and bad == [4, 5] and kept == [2, 4, 5]
    assert torch.equal(host[0], x[2]) and torch.isnan(host[1, 5]) and host.dtype == torch.float32
