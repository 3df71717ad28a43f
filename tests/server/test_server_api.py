"""The OpenAI-compatible server end to end: the official ``openai`` client against uvicorn on 127.0.0.1 (a free
port, in a background thread), plus raw HTTP for error bodies, auth, disconnects, overload and metrics."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from ascend_dsv4 import LLM, SamplingParams
from ascend_dsv4.engine.async_engine import AsyncEngine
from ascend_dsv4.entrypoints.chat import ChatFormatter, encode_deepseek_chat
from ascend_dsv4.entrypoints.server import ServerThread, create_app

KEY = "sk-test-key"
PROMPT = "Hello, Ascend!"
PROMPT2 = "DeepSeek-V4 on 910B"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]


def _free(llm):
    p = llm.runner.pools
    return (p.token_alloc.num_free, p.c4_alloc.num_free, p.c128_alloc.num_free)


def _full(llm):
    p = llm.runner.pools
    return (p.token_alloc.num_blocks, p.c4_alloc.num_blocks, p.c128_alloc.num_blocks)


def _wait_idle(llm, timeout=10.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        e = llm.engine
        if e.num_running == 0 and e.num_waiting == 0 and _free(llm) == _full(llm):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def srv():
    llm = LLM(model="toy-v4", device="cpu")
    # offline references, computed before the engine thread owns llm.engine
    chat_prompt = encode_deepseek_chat(CHAT)
    ref, ref2 = llm.generate([PROMPT, PROMPT2], [SamplingParams(max_tokens=12, temperature=0, logprobs=3),
                                                 SamplingParams(max_tokens=12, temperature=0)])
    # alone, as the server will run it: this ~80-token context is not bit-stable across batch compositions
    ref_chat = llm.generate(chat_prompt, SamplingParams(max_tokens=10, temperature=0))[0]
    # the logprob of each greedy token from the logits API (an independent path)
    logits = llm.logits(ref.prompt_token_ids + ref.token_ids)[len(ref.prompt_token_ids) - 1:-1]
    want_lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ref.token_ids)[:, None])[:, 0].tolist()
    assert _free(llm) == _full(llm)
    eng = AsyncEngine(llm.engine, max_queue=64, ops_context=llm._ops)
    app = create_app(eng, ["toy-v4", "toy"], api_key=KEY)
    server = ServerThread(app).start()
    try:
        yield SimpleNamespace(llm=llm, eng=eng, app=app, url=server.url, ref=ref, ref2=ref2, ref_chat=ref_chat,
                              chat_prompt=chat_prompt, want_lp=want_lp)
    finally:
        server.stop()
        eng.shutdown()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


# ---- happy paths through the openai client ------------------------------------------------------------------
def test_models_and_health(srv, client, http):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["toy-v4", "toy"]
    assert client.models.retrieve("toy").id == "toy"
    r = httpx.get(srv.url + "/health")  # no API key needed
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_completion_greedy_matches_offline_and_is_deterministic(srv, client):
    texts = []
    for _ in range(2):
        r = client.completions.create(model="toy-v4", prompt=PROMPT, max_tokens=12, temperature=0)
        assert r.object == "text_completion" and r.model == "toy-v4" and r.id.startswith("cmpl-")
        (c,) = r.choices
        assert c.index == 0 and c.finish_reason == "length" and c.logprobs is None
        assert r.usage.prompt_tokens == len(srv.ref.prompt_token_ids)
        assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
        texts.append(c.text)
    assert texts[0] == texts[1] == srv.ref.text


def test_completion_stream(srv, client):
    chunks = list(client.completions.create(model="toy", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    body, usage = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in body) == srv.ref.text
    finishes = [c.choices[0].finish_reason for c in body]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert usage.choices == [] and usage.usage.completion_tokens == 12
    assert usage.usage.prompt_tokens == len(srv.ref.prompt_token_ids)
    assert len({c.id for c in chunks}) == 1
    # without include_usage: no usage chunk
    plain = list(client.completions.create(model="toy", prompt=PROMPT, max_tokens=3, temperature=0, stream=True))
    assert all(c.choices for c in plain) and plain[-1].choices[0].finish_reason == "length"


def test_completion_logprobs(srv, client):
    r = client.completions.create(model="toy-v4", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert lp.token_logprobs == pytest.approx([x.logprob for x in srv.ref.logprobs], abs=1e-4)
    assert lp.token_logprobs == pytest.approx(srv.want_lp, abs=1e-3)
    for d, chosen in zip(lp.top_logprobs, lp.token_logprobs):
        assert 1 <= len(d) <= 4 and all(v <= 0 for v in d.values())
        assert max(d.values()) >= chosen - 1e-6  # greedy: the chosen token is the likeliest
    assert lp.text_offset == sorted(lp.text_offset)
    # streamed logprobs cover the same tokens
    chunks = list(client.completions.create(model="toy-v4", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2,
                                            stream=True))
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_chat(srv, client):
    r = client.chat.completions.create(model="toy-v4", messages=CHAT, max_tokens=10, temperature=0)
    (c,) = r.choices
    assert r.object == "chat.completion" and c.message.role == "assistant"
    assert c.message.content == srv.ref_chat.text and c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(srv.ref_chat.prompt_token_ids) == 1 + len(srv.chat_prompt.encode())
    assert r.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model="toy-v4", messages=CHAT, max_completion_tokens=10,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == srv.ref_chat.text
    assert body[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].object == "chat.completion.chunk"


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="toy-v4", messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for t in content:
        assert len(t.top_logprobs) == 2 and t.logprob <= 0 and isinstance(t.bytes, list)
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-6)  # greedy picks the top one


def test_multiple_prompts(srv, client):
    r = client.completions.create(model="toy-v4", prompt=[PROMPT, PROMPT2], max_tokens=12, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [srv.ref.text, srv.ref2.text]
    assert r.usage.completion_tokens == 24
    texts = {0: "", 1: ""}
    for c in client.completions.create(model="toy-v4", prompt=[PROMPT, PROMPT2], max_tokens=12, temperature=0,
                                       stream=True):
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == {0: srv.ref.text, 1: srv.ref2.text}


def test_stop_seed_and_extra_params(srv, client):
    stop = srv.ref.text[5:7]
    r = client.completions.create(model="toy-v4", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == srv.ref.text[:srv.ref.text.find(stop)]
    kw = dict(model="toy-v4", prompt=PROMPT, max_tokens=8, temperature=0.9, top_p=0.95, seed=11,
              extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True})
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b
    r = client.completions.create(model="toy-v4", prompt=[int(t) for t in srv.ref.prompt_token_ids], max_tokens=12,
                                  temperature=0)
    assert r.choices[0].text == srv.ref.text  # token-id prompts


def test_asgi_transport_without_socket(srv, tmp_path):
    """create_app works in-process through httpx.ASGITransport; a model folder's chat template is used."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                                              "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"}))
    app = create_app(srv.eng, "toy-v4", model_dir=str(tmp_path))
    rendered = "<s>[system]You are terse.[user]Say hi.[assistant]"
    assert ChatFormatter.from_folder(str(tmp_path)).format(CHAT) == rendered

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == 1 + len(rendered.encode())
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0})
            assert r.json()["choices"][0]["text"] == srv.ref.text
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "temperature": "hot"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"

    asyncio.run(go())


# ---- errors --------------------------------------------------------------------------------------------------
def test_api_key(srv):
    bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model="toy-v4", prompt="x", max_tokens=1)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    r = httpx.get(srv.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(srv.url + "/metrics").status_code == 200


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"temperature": -1}, "temperature"),
    ("/v1/completions", {"temperature": "hot"}, "temperature"),
    ("/v1/completions", {"top_p": 0}, "top_p"),
    ("/v1/completions", {"top_k": -5}, "top_k"),
    ("/v1/completions", {"top_k": 10**6}, "top_k"),
    ("/v1/completions", {"min_p": 2}, "min_p"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"n": 1000}, "n"),
    ("/v1/completions", {"logprobs": 50}, "logprobs"),
    ("/v1/completions", {"presence_penalty": 5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"seed": -1}, "seed"),
    ("/v1/completions", {"stop": [1, 2]}, "stop"),
    ("/v1/completions", {"prompt": None}, "prompt"),
    ("/v1/completions", {"prompt": [5, 10**9]}, "prompt"),
    ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
    ("/v1/completions", {"stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"n": 0, "stream": True}, "n"),
    ("/v1/chat/completions", {"temperature": -0.5, "stream": True}, "temperature"),
])
def test_invalid_fields_get_400_naming_the_param(http, path, extra, param):
    body = {"model": "toy-v4", "max_tokens": 4}
    body.update({"prompt": PROMPT} if path == "/v1/completions" else {"messages": CHAT})
    body.update(extra)
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and isinstance(err["message"], str)
    assert set(err) == {"message", "type", "param", "code"}


def test_openai_client_sees_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="toy-v4", prompt=PROMPT, temperature=-1)
    assert e.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as e:  # 404, as OpenAI and vLLM answer an unknown model
        client.completions.create(model="nope", prompt=PROMPT)
    assert e.value.param == "model" and e.value.code == "model_not_found"


def test_malformed_json_and_unknown_route(http):
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        r = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_prompt_longer_than_max_model_len(srv, http, client):
    n = srv.llm.max_model_len
    r = http.post("/v1/completions", json={"model": "toy-v4", "prompt": "x" * n, "max_tokens": 1})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded" and str(n) in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="toy-v4", messages=[{"role": "user", "content": "y" * n}], stream=True)
    assert e.value.param == "messages"
    assert srv.llm.engine.num_waiting == 0


# ---- disconnects, overload, dead engine -------------------------------------------------------------------------
def test_client_disconnect_mid_stream_frees_pages(srv, client):
    assert _wait_idle(srv.llm)
    aborted = srv.eng.stats()["aborted"]
    stream = client.completions.create(model="toy-v4", prompt=PROMPT * 4, max_tokens=1000, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].finish_reason is None
    assert srv.llm.engine.num_running == 1
    stream.close()
    assert _wait_idle(srv.llm), (srv.llm.engine.num_running, _free(srv.llm), _full(srv.llm))
    assert srv.eng.stats()["aborted"] == aborted + 1
    # a non-streaming client that gives up is aborted too
    with pytest.raises(httpx.TimeoutException):
        httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5,
                   json={"messages": CHAT, "max_tokens": 1000, "ignore_eos": True})
    assert _wait_idle(srv.llm)
    assert srv.eng.stats()["aborted"] == aborted + 2
    r = client.completions.create(model="toy-v4", prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == srv.ref.text


def test_overload_gets_429_and_server_survives(srv, client):
    assert _wait_idle(srv.llm)
    srv.eng.max_queue = 1

    async def burst(stream: bool):
        async with httpx.AsyncClient(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
            async def one(i):
                r = await c.post("/v1/completions", json={"prompt": f"{i} {PROMPT}", "max_tokens": 4, "stream": stream})
                return r.status_code, (r.json() if r.status_code != 200 else r.text)
            return await asyncio.gather(*(one(i) for i in range(24)))

    try:
        for stream in (False, True):
            res = asyncio.run(burst(stream))
            codes = [c for c, _ in res]
            assert set(codes) <= {200, 429}, res
            assert codes.count(429) >= 1 and codes.count(200) >= 1, codes
            for code, body in res:
                if code == 429:
                    assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "engine_overloaded"
                elif stream:
                    assert body.rstrip().endswith("data: [DONE]")
    finally:
        srv.eng.max_queue = 64
    assert _wait_idle(srv.llm)
    assert client.completions.create(model="toy-v4", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text \
        == srv.ref.text


def test_dead_engine_gets_503(srv, http):
    srv.eng._error = RuntimeError("simulated engine failure")
    try:
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert http.get("/health").status_code == 503
    finally:
        srv.eng._error = None
    assert http.get("/health").status_code == 200


# ---- metrics -------------------------------------------------------------------------------------------------
_SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? \S+$')


def test_metrics(srv, client):
    client.completions.create(model="toy-v4", prompt=PROMPT, max_tokens=3, temperature=0)
    r = httpx.get(srv.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    values = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert line.startswith(("# HELP ", "# TYPE "))
            continue
        assert _SAMPLE.match(line), line
        name, v = line.rsplit(" ", 1)
        values[name] = float(v)
        assert not math.isnan(values[name])
    for name in ("ascend_dsv4_prompt_tokens_total", "ascend_dsv4_generation_tokens_total",
                 "ascend_dsv4_num_requests_waiting", "ascend_dsv4_num_requests_running",
                 "ascend_dsv4_kv_cache_usage_ratio", "ascend_dsv4_prefix_cache_hit_rate",
                 "ascend_dsv4_mtp_acceptance_rate", "ascend_dsv4_time_to_first_token_seconds_count",
                 "ascend_dsv4_time_per_output_token_seconds_count", "ascend_dsv4_requests_aborted_total"):
        assert name in values, name
    assert 'ascend_dsv4_time_to_first_token_seconds_bucket{le="+Inf"}' in values
    assert values["ascend_dsv4_generation_tokens_total"] >= 3 and values["ascend_dsv4_prompt_tokens_total"] > 0
    assert values["ascend_dsv4_time_to_first_token_seconds_count"] >= 1
    assert 0.0 <= values["ascend_dsv4_kv_cache_usage_ratio"] <= 1.0
    assert values['ascend_dsv4_http_requests_total{path="/v1/completions",status="200"}'] >= 1
