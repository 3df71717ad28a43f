"""The offline API: LLM.generate / LLM.logits on the embedded toy model and on a model folder."""

from __future__ import annotations

import json

import pytest
import torch

from ascend_dsv4 import LLM, SamplingParams
from ascend_dsv4.errors import ConfigError, RequestError


@pytest.fixture(scope="module")
def llm():
    return LLM(model="toy-v4", device="cpu", max_num_batched_tokens=64, max_num_seqs=4)


def test_greedy_is_deterministic_and_batch_independent(llm):
    prompts = ["Hello, Ascend!", "DeepSeek-V4 on 910B", "x" * 150]
    sp = SamplingParams(max_tokens=12, temperature=0)
    alone = [llm.generate(p, sp)[0] for p in prompts]
    together = llm.generate(prompts, sp)
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 12
        assert a.finish_reason == "length"
    # the greedy token equals the argmax of the logits API
    first = llm.logits(alone[0].prompt_token_ids)[-1].argmax().item()
    assert alone[0].token_ids[0] == first


def test_seeded_sampling_is_reproducible(llm):
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    a = llm.generate("seeded", sp)[0].token_ids
    b = llm.generate(["other prompt", "seeded"], [SamplingParams(max_tokens=3, seed=1), sp])[1].token_ids
    assert a == b
    assert llm.generate("seeded", SamplingParams(max_tokens=10, temperature=1.0, seed=8))[0].token_ids != a


def test_stop_tokens_and_max_model_len():
    llm = LLM(model="toy-v4", device="cpu", max_model_len=40)
    out = llm.generate("abc", SamplingParams(max_tokens=5, temperature=0))[0]
    stop = out.token_ids[2]
    out2 = llm.generate("abc", SamplingParams(max_tokens=5, temperature=0, stop_token_ids=[stop]))[0]
    assert out2.finish_reason == "stop" and out2.token_ids == out.token_ids[: out.token_ids.index(stop) + 1]
    long = llm.generate([5] * 35, SamplingParams(max_tokens=100, temperature=0))[0]
    assert long.finish_reason == "length" and len(long.token_ids) == 5  # capped by max_model_len
    with pytest.raises(RequestError, match="max_model_len"):
        llm.generate([5] * 40, SamplingParams(max_tokens=1))


def test_no_pages_leak_after_generation(llm):
    pools = llm.runner.pools
    before = (pools.token_alloc.num_free, pools.c4_alloc.num_free, pools.c128_alloc.num_free)
    llm.generate(["a" * 140, "b", "c" * 20], SamplingParams(max_tokens=4, temperature=0))
    assert (pools.token_alloc.num_free, pools.c4_alloc.num_free, pools.c128_alloc.num_free) == before


@pytest.mark.parametrize("bad, field", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
])
def test_invalid_sampling_params(bad, field):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**bad)


def test_bad_requests(llm):
    with pytest.raises(RequestError, match="token id"):
        llm.generate([[1, 2, 99999]])
    with pytest.raises(RequestError, match="empty"):
        llm.generate([""] if not llm.tokenizer.encode("") else [[]])
    with pytest.raises(RequestError, match="prefill_len"):
        llm.logits([1, 2, 3], prefill_len=0)
    with pytest.raises(RequestError, match="top_k"):
        llm.generate("x", SamplingParams(top_k=5000))  # larger than the vocabulary


def test_bad_models(tmp_path):
    with pytest.raises(ConfigError, match="unknown model"):
        LLM(model="toy-v5")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        LLM(model=str(tmp_path))
    with pytest.raises(ConfigError, match="numerics"):
        LLM(numerics="fast")


def test_model_folder_with_hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    from ascend_dsv4.models import preset

    cfg = preset("toy-v4").replace(vocab_size=300)
    vocab = {"<s>": 0, "</s>": 1}
    for i, w in enumerate(["hello", "world", "ascend", "deepseek"]):
        vocab[w] = 2 + i
    vocab["[UNK]"] = 6
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    # a checkpoint of the toy model in official names, written with safetensors
    from safetensors.torch import save_file

    ref = LLM(model="toy-v4", device="cpu", config_overrides=dict(vocab_size=300))
    state = {}
    for name, p in list(ref.model.named_parameters()) + list(ref.model.named_buffers()):
        if name.endswith("inv_freq"):
            continue
        if name.endswith(("experts.w1", "experts.w2", "experts.w3")):
            for e in range(p.shape[0]):
                base, w = name.rsplit(".", 1)
                state[f"{base}.{e}.{w}.weight"] = p[e].contiguous()
        else:
            state[name] = p.contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    official = {k: v for k, v in cfg.to_dict().items() if k not in ("name", "model_type")}
    (tmp_path / "config.json").write_text(json.dumps(official))
    llm = LLM(model=str(tmp_path), device="cpu")
    assert type(llm.tokenizer).__name__ == "HFTokenizer"
    assert llm.tokenizer.encode("hello world") == [0, 2, 3]
    ids = llm.tokenizer.encode("hello ascend deepseek")
    assert torch.allclose(llm.logits(ids), ref.logits(ids), atol=1e-5)
