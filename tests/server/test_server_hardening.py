"""Issue 10 items 1 and 5 at the HTTP layer: a lone surrogate is a 400 naming the field and keeps the connection;
every response (errors and 500s included) is counted in http_requests_total; an unknown model is 404
model_not_found; max_tokens above the context left is a 400 naming both numbers; a request the engine fails is a
500 (or an error event and [DONE]) while the engine serves on; ``serve`` on a port in use prints one ``error:`` line
and exits 2; SIGTERM drains (503 for new requests, streams finish or end with an error event and [DONE], exit 0)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from ascend_dsv4 import LLM
from ascend_dsv4.engine.async_engine import AsyncEngine
from ascend_dsv4.entrypoints.cli import main
from ascend_dsv4.entrypoints.server import ServerThread, create_app

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def srv():
    llm = LLM(model="toy-v4", device="cpu", max_model_len=256)
    eng = AsyncEngine(llm.engine, max_queue=64, ops_context=llm._ops)
    app = create_app(eng, ["toy-v4"])
    server = ServerThread(app).start()
    try:
        yield llm, eng, app, server
    finally:
        server.stop()
        eng.shutdown()


def _raw_requests(port: int, bodies: list[bytes], path="/v1/completions") -> list[tuple[int, dict]]:
    """Send every body over ONE keep-alive connection; (status, json) of each response."""
    out = []
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        f = s.makefile("rb")
        for b in bodies:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(b)}\r\n\r\n".encode() + b)
            status = int(f.readline().split()[1])
            length = None
            while True:
                line = f.readline()
                if line in (b"\r\n", b""):
                    break
                k, _, v = line.decode().partition(":")
                if k.lower() == "content-length":
                    length = int(v)
                assert not (k.lower() == "connection" and v.strip() == "close"), "the server closed the connection"
            out.append((status, json.loads(f.read(length))))
    return out


def _counts(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(url + "/metrics").text
    return {(m.group(1), m.group(2)): float(m.group(3)) for m in
            re.finditer(r'ascend_dsv4_http_requests_total\{path="([^"]+)",status="(\d+)"\} (\S+)', text)}


def test_lone_surrogate_is_400_naming_the_field_and_keeps_the_connection(srv):
    _, _, _, server = srv
    before = _counts(server.url)
    bad = b'{"prompt": "a\\ud800b", "max_tokens": 2}'
    good = b'{"prompt": "ab", "max_tokens": 2, "temperature": 0}'
    (s1, e1), (s2, r2) = _raw_requests(server.port, [bad, good])
    assert s1 == 400 and e1["error"]["param"] == "prompt" and "surrogate" in e1["error"]["message"]
    assert s2 == 200 and r2["choices"][0]["finish_reason"] == "length"
    chat = b'{"messages": [{"role": "user", "content": "x\\udfffy"}], "max_tokens": 2}'
    ((s3, e3),) = _raw_requests(server.port, [chat], "/v1/chat/completions")
    assert s3 == 400 and e3["error"]["param"] == "messages" and "messages[0].content" in e3["error"]["message"]
    after = _counts(server.url)
    assert after.get(("/v1/completions", "400"), 0) - before.get(("/v1/completions", "400"), 0) == 1
    assert after.get(("/v1/chat/completions", "400"), 0) - before.get(("/v1/chat/completions", "400"), 0) == 1


def test_unexpected_exception_is_a_counted_500_and_keeps_the_connection(srv, monkeypatch):
    _, _, app, server = srv
    st = app.state.server
    real = st.tokenizer.encode
    calls = []

    def encode(text, *a, **k):
        if text == "explode" and not calls:
            calls.append(1)
            raise KeyError("injected tokenizer failure")
        return real(text, *a, **k)

    monkeypatch.setattr(st.tokenizer, "encode", encode)
    before = _counts(server.url)
    (s1, e1), (s2, _) = _raw_requests(server.port, [b'{"prompt": "explode", "max_tokens": 1}',
                                                    b'{"prompt": "fine", "max_tokens": 1}'])
    assert s1 == 500 and e1["error"]["code"] == "internal_error" and s2 == 200
    after = _counts(server.url)
    assert after.get(("/v1/completions", "500"), 0) - before.get(("/v1/completions", "500"), 0) == 1


def test_unknown_model_is_404_model_not_found(srv):
    url = srv[3].url
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions",
                                                               {"messages": [{"role": "user", "content": "x"}]})):
        r = httpx.post(url + path, json={**body, "model": "gpt-4", "max_tokens": 1})
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-4" in err["message"]
    assert _counts(url).get(("/v1/chat/completions", "404"), 0) >= 1


def test_max_tokens_above_context_left_is_400_naming_both_numbers(srv):
    llm, _, app, server = srv
    ids = app.state.server.tokenizer.encode("hello there")
    left = 256 - len(ids)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello there", "max_tokens": left + 1})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and str(left + 1) in err["message"] and str(left) in err["message"]
    assert str(len(ids)) in err["message"] and "256" in err["message"]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"prompt": "hello there", "max_tokens": left, "stream": True}) as ok:
        assert ok.status_code == 200  # exactly the context left is fine (the stream is dropped at once)
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    assert "10000" in r.json()["error"]["message"]


def test_the_issue_request_no_longer_kills_the_engine(srv):
    """{"prompt":"hi","max_tokens":4,"repetition_penalty":1e-300} made sampling raise on NaN probabilities and every
    later request got 503 engine_dead."""
    _, eng, _, server = srv
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "repetition_penalty": 1e-300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "repetition_penalty": 0.01,
                                                          "temperature": 1.0, "seed": 1}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert eng._error is None and httpx.get(server.url + "/health").status_code == 200


def test_engine_failure_of_one_request_is_500_and_the_engine_serves_on(srv, monkeypatch):
    llm, eng, _, server = srv
    real = llm.runner.model.logits
    state = {"poison": True}

    def logits(streams, rows):
        out = real(streams, rows)
        return out.fill_(math.nan) if state["poison"] else out

    monkeypatch.setattr(llm.runner.model, "logits", logits)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed"
    assert "non-finite logits" in r.json()["error"]["message"]
    with httpx.stream("POST", server.url + "/v1/completions", json={"prompt": "y", "max_tokens": 3, "stream": True},
                      timeout=60) as s:
        assert s.status_code == 500  # failed before its first token: still an HTTP status
    state["poison"] = False
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": "z", "max_tokens": 200, "stream": True, "ignore_eos": True}) as s:
        lines = s.iter_lines()
        next(x for x in lines if x.startswith("data: "))
        state["poison"] = True  # mid-stream: the status line is sent, the error comes in-band
        rest = [x[6:] for x in lines if x.startswith("data: ")]
    assert rest[-1] == "[DONE]" and json.loads(rest[-2])["error"]["code"] == "request_failed"
    state["poison"] = False
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and httpx.get(server.url + "/health").status_code == 200
    assert eng._error is None


def test_serve_on_a_port_in_use_is_one_error_line_and_exit_2(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t = time.monotonic()
        assert main(["serve", "--model", "toy-v4", "--port", str(port)]) == 2
        assert time.monotonic() - t < 5  # before any model is built
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "address already in use" in err[0] and str(port) in err[0]


# ---- SIGTERM drain ---------------------------------------------------------------------------------------------
def _start_server(*extra):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "ascend_dsv4.entrypoints.cli", "serve", "--model", "toy-v4",
                          "--port", "0", "--max-model-len", "2048", *extra], stderr=subprocess.PIPE, text=True,
                         env=env)
    lines = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:
        line = p.stderr.readline()
        lines.append(line)
        m = re.search(r"INFO ascend_dsv4.server: serving .* on (http://\S+)", line)
        if m:
            return p, m.group(1), lines
        if not line and p.poll() is not None:
            break
    p.kill()
    raise AssertionError("server did not start: " + "".join(lines))


def _sse_events(lines) -> list:
    return [line[6:] for line in lines if line.startswith("data: ")]


def test_sigterm_drains():
    """One stream finishes within the grace period, one cannot and ends with an error event; both end with [DONE];
    a request after SIGTERM gets 503; the process exits 0."""
    import threading

    p, url, _ = _start_server("--shutdown-timeout", "5")
    results = {}

    def stream(name, max_tokens, started):
        with httpx.Client(timeout=120) as c, c.stream(
                "POST", url + "/v1/completions",
                json={"prompt": name, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}) as s:
            lines = s.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            started.set()
            results[name] = (s.status_code, [first[6:]] + _sse_events(lines))

    try:
        threads = []
        for name, n in (("short", 12), ("long", 2000)):
            ev = threading.Event()
            th = threading.Thread(target=stream, args=(name, n, ev), daemon=True)
            th.start()
            assert ev.wait(60)
            threads.append(th)
        p.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        r = httpx.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 1}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
        for th in threads:
            th.join(60)
        assert p.wait(timeout=60) == 0
        for name in ("short", "long"):
            status, ev = results[name]
            assert status == 200 and ev[-1] == "[DONE]", (name, ev[-3:])
        short = [json.loads(x) for x in results["short"][1][:-1]]
        assert short[-1]["choices"][0]["finish_reason"] == "length" and len(short) == 12
        long_ = [json.loads(x) for x in results["long"][1][:-1]]
        assert long_[-1]["error"]["code"] == "server_shutting_down" and len(long_) < 2000
    finally:
        if p.poll() is None:
            p.kill()
        p.stderr.close()


def test_listening_when_it_says_serving(monkeypatch):
    """run_server listens before it logs "serving ... on URL": a client that connects the moment it reads the line
    (before uvicorn has started, held back here) is queued, not refused (CI once saw test_sigterm_drains' first
    connection refused on a loaded machine); the socket is only bound, not listening, before that line."""
    import logging
    import socket
    import threading

    import ascend_dsv4.entrypoints.server as srv
    from ascend_dsv4 import LLM
    from ascend_dsv4.entrypoints.serve_lifecycle import bind_socket

    llm = LLM(model="toy-v4", device="cpu", dtype="float32", progress=False)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    with pytest.raises(ConnectionRefusedError):  # bound only: refused (e.g. while the model loads)
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    said, go, servers = threading.Event(), threading.Event(), []

    class Said(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("serving "):
                said.set()

    real_run = srv.DrainingServer.run

    def held_run(self, *a, **k):  # uvicorn starts only once the test has connected
        servers.append(self)
        go.wait(30)
        return real_run(self, *a, **k)

    monkeypatch.setattr(srv.DrainingServer, "run", held_run)
    handler, logger = Said(), logging.getLogger(srv.log.name)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        th = threading.Thread(target=srv.run_server, args=(llm,), kwargs=dict(sock=sock, log_level="warning"),
                              daemon=True)
        th.start()
        assert said.wait(60)
        c = socket.create_connection(("127.0.0.1", port), timeout=5)  # queued in the backlog: no error
        go.set()
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        c.settimeout(30)
        assert c.recv(64).startswith(b"HTTP/1.1 200")
        c.close()
    finally:
        go.set()
        logger.removeHandler(handler)
        logger.setLevel(level)
        for s in servers:
            s.should_exit = True
        th.join(30)
