"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over :class:`~ascend_dsv4.engine.async_engine.AsyncEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream over server-sent events when
``"stream": true``: ``data: {json}\\n\\n`` chunks, then ``data: [DONE]\\n\\n``), ``GET /v1/models``,
``GET /v1/models/{name}``, ``GET /health`` and ``GET /metrics`` (Prometheus text format).

* ``create_app(async_engine, model_name, api_key=None, max_model_len=None, ...)`` builds the app; tests drive
  it through ``httpx.ASGITransport`` or :class:`ServerThread` (uvicorn on 127.0.0.1 in a background thread).
* ``run_server(llm, host="127.0.0.1", port=8000, ...)`` wraps an :class:`~ascend_dsv4.LLM` in an AsyncEngine
  and serves until interrupted (``ascend-dsv4 serve``).

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid requests (the
offending field in ``param``), 401 for a missing / wrong API key (``Authorization: Bearer <key>``, only on
``/v1/*``), 429 when the engine queue is full, 503 when the engine thread died, 500 for anything unexpected.
A client that disconnects (streaming or not) aborts its request, which frees its KV pages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import math
import re
import socket
import threading
import time
import uuid
from typing import Any, AsyncIterator, Sequence

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.async_engine import AsyncEngine, EngineDead, EngineOverloaded, EngineShuttingDown
from ..engine.prompts import PromptError, check_prompt_ids
from ..engine.request import RequestOutput
from ..engine.sampling import MAX_N, SamplingParams
from ..errors import AscendDSV4Error, RequestError
from .chat import ChatFormatter
from .serve_lifecycle import DrainingServer, DrainState, bind_socket

log = logging.getLogger("ascend_dsv4.server")

__all__ = ["create_app", "run_server", "ServerThread", "ApiError", "MAX_LOGPROBS"]

MAX_LOGPROBS = 20  # top alternatives per token, as vLLM's default max_logprobs
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_PARAM_RE = re.compile(r"sampling parameter (\w+)=")


# ---- errors -----------------------------------------------------------------------------------------------
class ApiError(Exception):
    """An HTTP error with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type = type or ("invalid_request_error" if status < 429 else
                             "rate_limit_error" if status == 429 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def _engine_error(e: BaseException, prompt_param: str) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, EngineOverloaded):
        return ApiError(429, f"the server is overloaded: {e}", None, "engine_overloaded", headers={"Retry-After": "1"})
    if isinstance(e, EngineDead):
        return ApiError(503, f"the engine is not running: {e}", None, "engine_dead")
    if isinstance(e, EngineShuttingDown):
        return ApiError(503, f"the request was ended: {e}", None, "server_shutting_down")
    if isinstance(e, RequestError):
        msg = str(e)
        m = _PARAM_RE.search(msg)
        param = m.group(1) if m else prompt_param
        return _bad(msg, param, "context_length_exceeded" if "max_model_len" in msg else "invalid_value")
    log.exception("unexpected error while serving a request", exc_info=e)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error")


# ---- request field helpers -------------------------------------------------------------------------------
def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _opt_int(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f" in [{lo}, {hi}]" if hi is not None else f" >= {lo}" if lo is not None else ""
        raise _bad(f"{name} must be null or an integer{rng}, got {v!r}", name)
    return v


def _opt_bool(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise _bad(f"{name} must be true or false, got {v!r}", name)
    return v


def _lone_surrogate(obj: Any, path: str = "", top: str | None = None) -> tuple[str, str] | None:
    """(path of the first string holding a lone surrogate, its top-level field), or None. JSON's ``\\ud800``
    escapes decode to such strings; UTF-8 cannot encode them (the tokenizer would fail with a 500)."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return path or "the request body", top or path
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            key = k if isinstance(k, str) else str(k)
            if isinstance(k, str):
                bad = _lone_surrogate(k, f"{path}.<key>" if path else "a field name", top or "body")
                if bad:
                    return bad
            bad = _lone_surrogate(v, f"{path}.{key}" if path else key, top or key)
            if bad:
                return bad
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            bad = _lone_surrogate(v, f"{path}[{i}]", top)
            if bad:
                return bad
    return None


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf; OpenAI clients expect a number


@dataclasses.dataclass
class _Prompt:
    text: str | None
    ids: list[int]


class _State:
    def __init__(self, engine: AsyncEngine, names: list[str], api_key: str | None, max_model_len: int,
                 chat: ChatFormatter):
        self.engine, self.names, self.api_key, self.chat = engine, names, api_key, chat
        self.max_model_len = max_model_len
        self.tokenizer = engine.tokenizer
        cfg = getattr(engine.engine, "cfg", None)
        self.vocab_size = getattr(cfg, "vocab_size", None) or getattr(self.tokenizer, "vocab_size", None)
        self.created = int(time.time())
        self.http_counts: dict[tuple[str, int], int] = {}
        self._tok_cache: dict[int, str] = {}

    # ---- validation --------------------------------------------------------------------------------
    def model(self, body: dict) -> str:
        m = body.get("model")
        if m is None:
            return self.names[0]
        if not isinstance(m, str) or m not in self.names:
            raise ApiError(404, f"The model {m!r} does not exist; this server serves {', '.join(self.names)}",
                           "model", "model_not_found")
        return m

    def check_max_tokens(self, ids: list[int], max_tokens: int | None, param: str) -> int | None:
        """``max_tokens`` must fit the context left after the prompt (vLLM's rule: a 400 naming both numbers, not
        a request that runs to the limit). Returns the context left."""
        left = self.max_model_len - len(ids)
        if max_tokens is not None and max_tokens > left:
            raise _bad(f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                       f"{max_tokens} output tokens ({param}) and your prompt contains {len(ids)} tokens, for a "
                       f"total of {len(ids) + max_tokens} tokens: {param} must be at most {left}, the context left.",
                       param, "context_length_exceeded")
        return left

    def check_prompt(self, ids: list, param: str) -> list[int]:
        """The prompt's ids (engine's validator), or a 400 naming ``param`` (OpenAI's wording for length)."""
        try:
            return check_prompt_ids(ids, self.vocab_size, self.max_model_len, param)
        except PromptError as e:
            if e.code == "context_length_exceeded":
                raise _bad(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                           f"{param} has {len(ids)} tokens (it must leave room for at least one generated token).",
                           param, "context_length_exceeded") from None
            raise _bad(str(e), param) from None

    def completion_prompts(self, p: Any) -> list[_Prompt]:
        if p is None:
            raise _bad("prompt is required", "prompt", "missing_required_parameter")
        if isinstance(p, str):
            items: list = [p]
        elif isinstance(p, list) and p and all(_is_int(t) for t in p):
            items = [p]
        elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            items = p
        else:
            raise _bad("prompt must be a string, a non-empty list of strings, a list of token ids or a list of "
                       "token id lists", "prompt")
        out = []
        for x in items:
            if isinstance(x, str):
                pr = _Prompt(x, self.tokenizer.encode(x))
            else:
                pr = _Prompt(None, list(x))
            pr.ids = self.check_prompt(pr.ids, "prompt")
            out.append(pr)
        return out

    def sampling(self, body: dict, max_tokens: int, max_tokens_param: str, logprobs: int | None) -> SamplingParams:
        kw: dict[str, Any] = {"max_tokens": max_tokens, "logprobs": logprobs}
        for f in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "stop", "stop_token_ids", "ignore_eos"):
            if body.get(f) is not None:
                kw[f] = body[f]
        if isinstance(kw.get("stop"), list) and not kw["stop"]:
            kw.pop("stop")  # [] means no stop strings
        try:
            params = SamplingParams(**kw)
            params.validate(self.vocab_size)
        except RequestError as e:
            m = _PARAM_RE.search(str(e))
            param = m.group(1) if m else None
            if param == "max_tokens":
                param = max_tokens_param
            raise _bad(str(e), param) from None
        except (TypeError, ValueError) as e:  # e.g. float() of a string that slipped past validation
            raise _bad(f"invalid sampling parameters: {e}") from None
        return params

    # ---- token strings for logprobs ------------------------------------------------------------------
    def tok_str(self, t: int) -> str:
        s = self._tok_cache.get(t)
        if s is None:
            try:
                s = self.tokenizer.decode([t], skip_special=False)
            except Exception:  # noqa: BLE001 - an id the tokenizer cannot show
                s = f"<token {t}>"
            if len(self._tok_cache) < 200_000:
                self._tok_cache[t] = s
        return s

    def tok_bytes(self, t: int) -> list[int]:
        tb = getattr(self.tokenizer, "token_bytes", None)
        if tb is not None:
            try:
                return list(tb(t, skip_special=False))
            except Exception:  # noqa: BLE001
                pass
        return list(self.tok_str(t).encode("utf-8"))


# ---- streaming plumbing ------------------------------------------------------------------------------------
def _failed(o: RequestOutput) -> bool:
    """The engine ended this request with an error while computing it (not for lack of KV cache)."""
    return bool(o.finished and o.error and "KV cache" not in o.error)


def _failure(o: RequestOutput) -> ApiError:
    return ApiError(500, f"the request failed: {o.error}", None, "request_failed")


async def _prime(gens: list, prompt_param: str) -> list[RequestOutput]:
    """Admit every request and wait for its first output, so errors (overload, bad request) become an HTTP
    status before any byte of the response is sent."""
    results = await asyncio.gather(*(g.__anext__() for g in gens), return_exceptions=True)
    err = next((r for r in results if isinstance(r, BaseException)), None)
    if err is None:
        for r in results:
            if _failed(r):
                err = _failure(r)
                break
            if r.finished and r.finish_reason == "abort" and not r.token_ids:
                err = _bad("the request needs more KV cache than this server holds; shorten the prompt or "
                           "max_tokens", prompt_param, "kv_capacity_exceeded")
                break
    if err is not None:
        for g in gens:
            await g.aclose()  # aborts the admitted ones
        if isinstance(err, StopAsyncIteration):
            err = ApiError(500, "the engine ended a request without output", None, "internal_error")
        raise _engine_error(err, prompt_param)
    return results


async def _merge(gens: list, firsts: list[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) pairs of several primed engine streams, in arrival order; closing this aborts them."""
    if len(gens) == 1:
        g, o = gens[0], firsts[0]
        try:
            yield 0, o
            while not o.finished:
                o = await g.__anext__()
                if _failed(o):
                    raise _failure(o)
                yield 0, o
        finally:
            await g.aclose()
        return
    tasks: dict[asyncio.Future, int] = {}
    try:
        for i, o in enumerate(firsts):
            yield i, o
        for i, o in enumerate(firsts):
            if not o.finished:
                tasks[asyncio.ensure_future(gens[i].__anext__())] = i
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in sorted(done, key=lambda t: tasks[t]):
                i = tasks.pop(t)
                o = t.result()
                if _failed(o):
                    raise _failure(o)
                yield i, o
                if not o.finished:
                    tasks[asyncio.ensure_future(gens[i].__anext__())] = i
    finally:
        running = set(tasks.values())
        for t in tasks:
            t.cancel()  # the generator inside sees CancelledError and aborts its request
        for i, g in enumerate(gens):
            if i not in running:
                await g.aclose()


def _sse(obj: Any) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n\n"


def _usage(outs: Sequence[RequestOutput], n: int = 1) -> dict:
    """Token counts of ``outs`` (``n`` completions per prompt, in order: each prompt counts once)."""
    p = sum(len(o.prompt_token_ids) for o in outs[::n])
    c = sum(len(o.token_ids) for o in outs)
    cached = sum(getattr(o, "num_cached_tokens", 0) or 0 for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


# ---- metrics -------------------------------------------------------------------------------------------------
def _histogram(lines: list[str], name: str, help_: str, values: Sequence[float], buckets: Sequence[float]) -> None:
    lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
    vs = sorted(values)
    j = 0
    for b in buckets:
        while j < len(vs) and vs[j] <= b:
            j += 1
        lines.append(f'{name}_bucket{{le="{b:g}"}} {j}')
    lines.append(f'{name}_bucket{{le="+Inf"}} {len(vs)}')
    lines.append(f"{name}_sum {sum(vs):.9g}")
    lines.append(f"{name}_count {len(vs)}")


def _metrics_text(s: dict, st: _State, alive: bool) -> str:
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, value, labels: str = "") -> None:
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{labels} {float(value):.9g}"])

    P = "ascend_dsv4_"
    metric(P + "prompt_tokens_total", "counter", "Prompt tokens accepted by the engine.", s.get("prompt_tokens", 0))
    metric(P + "generation_tokens_total", "counter", "Tokens generated by the engine.", s.get("generation_tokens", 0))
    metric(P + "requests_finished_total", "counter", "Requests that finished (stop or length).", s.get("finished", 0))
    metric(P + "requests_aborted_total", "counter", "Requests aborted (client disconnects, errors).",
           s.get("aborted", 0))
    metric(P + "preemptions_total", "counter", "Requests preempted for lack of KV pages.", s.get("preemptions", 0))
    metric(P + "engine_steps_total", "counter", "Engine steps run.", s.get("steps", 0))
    metric(P + "num_requests_waiting", "gauge", "Requests in the queue (queue length).", s.get("num_waiting", 0))
    metric(P + "num_requests_running", "gauge", "Requests being decoded or prefilled.", s.get("num_running", 0))
    metric(P + "kv_cache_usage_ratio", "gauge", "Fraction of KV token pages in use (0..1).", s.get("kv_usage", 0.0))
    metric(P + "prefix_cache_hit_rate", "gauge", "Prompt tokens served from the prefix cache / prompt tokens "
           "looked up.", s.get("prefix_hit_rate", 0.0))
    metric(P + "mtp_acceptance_rate", "gauge", "Accepted / proposed MTP draft tokens.", s.get("mtp_acceptance", 0.0))
    up = s.get("uptime_s", 0.0)
    metric(P + "uptime_seconds", "gauge", "Seconds since the engine started.", up)
    metric(P + "generation_tokens_per_second", "gauge", "Average generation throughput since start.",
           s.get("generation_tokens", 0) / up if up > 0 else 0.0)
    metric(P + "engine_alive", "gauge", "1 while the engine thread runs.", 1 if alive else 0)
    _histogram(lines, P + "time_to_first_token_seconds", "Time from arrival to the first generated token.",
               s.get("ttft", []), _TTFT_BUCKETS)
    _histogram(lines, P + "time_per_output_token_seconds", "Mean time per output token after the first, per "
               "request.", s.get("tpot", []), _TPOT_BUCKETS)
    name = P + "http_requests_total"
    lines += [f"# HELP {name} HTTP responses by route and status.", f"# TYPE {name} counter"]
    for (path, status), n in sorted(st.http_counts.items()):
        lines.append(f'{name}{{path="{path}",status="{status}"}} {n}')
    return "\n".join(lines) + "\n"


# ---- the app -----------------------------------------------------------------------------------------------
_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class _Gate:
    """Pure ASGI middleware: API-key check on /v1/* and response counts by route and status (streaming-safe,
    unlike BaseHTTPMiddleware)."""

    def __init__(self, app, state: _State):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        drain = self.state.drain
        drain.enter()
        try:
            await self._serve(scope, receive, send)
        finally:
            drain.leave()

    async def _serve(self, scope, receive, send):
        path = scope.get("path", "")
        label = path if path in _ROUTES else "/v1/models" if path.startswith("/v1/models/") else "other"
        status_box = [0]

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
                key = (label, message["status"])
                self.state.http_counts[key] = self.state.http_counts.get(key, 0) + 1
            await send(message)

        async def send_error(err: ApiError, extra: list | None = None) -> None:
            body = json.dumps(err.body()).encode()
            await counting_send({"type": "http.response.start", "status": err.status,
                                 "headers": [(b"content-type", b"application/json"),
                                             (b"content-length", str(len(body)).encode())] + (extra or [])})
            await counting_send({"type": "http.response.body", "body": body})

        if self.state.drain.draining and path != "/metrics":
            return await send_error(ApiError(503, "the server is shutting down; retry on another replica", None,
                                             "server_shutting_down"), [(b"connection", b"close")])

        key = self.state.api_key
        if key and path.startswith("/v1"):
            auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(given.encode(), key.encode()):
                err = ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'", None,
                               "invalid_api_key")
                body = json.dumps(err.body()).encode()
                await counting_send({"type": "http.response.start", "status": 401,
                                     "headers": [(b"content-type", b"application/json"),
                                                 (b"content-length", str(len(body)).encode()),
                                                 (b"www-authenticate", b"Bearer")]})
                await counting_send({"type": "http.response.body", "body": body})
                return
        try:
            await self.app(scope, receive, counting_send)
        except Exception as e:  # noqa: BLE001 - answered here (and counted), so the connection stays usable
            if status_box[0]:
                raise  # the response had started: nothing else can be sent
            await send_error(_engine_error(e, "prompt"))


def create_app(async_engine: AsyncEngine, model_name: str | Sequence[str], api_key: str | None = None,
               max_model_len: int | None = None, *, model_dir: str | None = None, chat_template: str | None = None,
               drain: DrainState | None = None):
    """The FastAPI app serving ``async_engine`` under ``model_name`` (one name or several aliases; the first is
    listed first). ``max_model_len`` defaults to the engine's. The chat format comes from ``chat_template``
    (a Jinja2 string or file), else ``model_dir``'s ``tokenizer_config.json``, else DeepSeek's encoding."""
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError("model_name must be a non-empty string or a list of them")
    mml = max_model_len or async_engine.engine.max_model_len
    st = _State(async_engine, names, api_key or None, mml, ChatFormatter.from_folder(model_dir, chat_template))
    st.drain = drain or DrainState()  # SIGTERM drain (serve_lifecycle): refuse new requests, count those in flight

    app = FastAPI(title="ascend-dsv4 OpenAI-compatible server", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = st

    class SSEResponse(StreamingResponse):
        """Closes its body iterator and the engine streams however the response ends (even before the body
        started), so a dropped client always aborts its requests."""

        def __init__(self, content, gens: list):
            super().__init__(content, media_type="text/event-stream", headers=_SSE_HEADERS)
            self.gens = gens

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                with anyio.CancelScope(shield=True):
                    await self.body_iterator.aclose()
                    for g in self.gens:
                        try:
                            await g.aclose()
                        except RuntimeError:  # still running inside a cancelled merge task: it aborts itself
                            pass

    def error_response(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(ApiError)
    async def _api_error(_req, e: ApiError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error_response(ApiError(e.status_code, str(e.detail), None, code))

    @app.exception_handler(Exception)
    async def _internal(_req, e: Exception):
        return error_response(_engine_error(e, "prompt"))

    async def read_json(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
        bad = _lone_surrogate(body)
        if bad is not None:
            field, top = bad
            raise _bad(f"{field} holds a lone UTF-16 surrogate (an escape \\ud800-\\udfff without its pair): it is "
                       f"not Unicode text and cannot be encoded", top, "invalid_unicode")
        return body

    def common(body: dict) -> tuple[str, bool, bool]:
        model = st.model(body)
        n = body.get("n")
        if n is not None and (not _is_int(n) or not 1 <= n <= MAX_N):
            raise _bad(f"n must be an integer in [1, {MAX_N}], got n={n!r}", "n")
        best_of = body.get("best_of")
        if best_of is not None and best_of != 1:
            raise _bad(f"only best_of=1 is supported, got {best_of!r}", "best_of", "unsupported_value")
        if body.get("logit_bias"):
            raise _bad("logit_bias is not supported", "logit_bias", "unsupported_parameter")
        if body.get("min_tokens"):
            raise _bad("min_tokens is not supported", "min_tokens", "unsupported_parameter")
        stream = _opt_bool(body, "stream") or False
        so = body.get("stream_options")
        if so is not None and not isinstance(so, dict):
            raise _bad("stream_options must be an object", "stream_options")
        inc = (so or {}).get("include_usage")
        if inc is not None and not isinstance(inc, bool):
            raise _bad("stream_options.include_usage must be true or false", "stream_options")
        return model, stream, bool(inc)

    async def run_until_disconnect(request: Request, coro):
        """Await ``coro``; if the client goes away first, cancel it (its requests are aborted)."""
        work = asyncio.ensure_future(coro)

        async def disconnected():
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    return

        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if work.cancelled():
            return None
        return work.result()

    def start(prompts: list[list[int]], params: SamplingParams, rid: str, n: int = 1) -> list:
        """One engine stream per (prompt, completion): choice ``i * n + j`` is completion ``j`` of prompt ``i``
        (OpenAI's order); a seeded request's completion ``j`` uses seed ``seed + j``."""
        gens = []
        for i, ids in enumerate(prompts):
            for j in range(n):
                seed = params.seed if params.seed is None or j == 0 else (params.seed + j) % 2**64
                gens.append(async_engine.generate(ids, dataclasses.replace(params, seed=seed), f"{rid}-{i * n + j}"))
        return gens

    # ---- /v1/completions -----------------------------------------------------------------------------
    def completion_logprobs(out_lps, toks: list[int], text_len: int, base: int) -> dict:
        tokens, lps, tops, offs = [], [], [], []
        off = base
        for t, lp in zip(toks, out_lps):
            s = st.tok_str(t)
            tokens.append(s)
            lps.append(_finite(lp.logprob))
            top: dict[str, float] = {}
            for a, b in lp.top:  # tokens that print alike (e.g. partial UTF-8 bytes) keep the likeliest
                top.setdefault(st.tok_str(a), _finite(b))
            top.setdefault(s, _finite(lp.logprob))
            tops.append(top)
            offs.append(min(off, base + text_len))
            off += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        model, stream, include_usage = common(body)
        if body.get("echo"):
            raise _bad("echo is not supported", "echo", "unsupported_parameter")
        if body.get("suffix"):
            raise _bad("suffix is not supported", "suffix", "unsupported_parameter")
        prompts = st.completion_prompts(body.get("prompt"))
        max_tokens = _opt_int(body, "max_tokens", 1)
        left = min(st.check_max_tokens(p.ids, max_tokens, "max_tokens") for p in prompts)
        if max_tokens is None:  # OpenAI's default, within the context left
            max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, left)
        lp = body.get("logprobs")
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
            raise _bad(f"logprobs must be null or an integer in [0, {MAX_LOGPROBS}], got {lp!r}", "logprobs")
        params = st.sampling(body, max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, "max_tokens", lp)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        n = body.get("n") or 1
        gens = start([p.ids for p in prompts], params, rid, n)
        if not stream:
            async def collect():
                firsts = await _prime(gens, "prompt")
                finals = list(firsts)
                async for i, o in _merge(gens, firsts):
                    finals[i] = o
                return finals

            finals = await run_until_disconnect(request, collect())
            if finals is None:
                return JSONResponse({}, status_code=499)
            choices = [{"index": i, "text": o.text, "finish_reason": o.finish_reason,
                        "logprobs": completion_logprobs(o.logprobs, o.token_ids, len(o.text), 0) if lp is not None
                        else None} for i, o in enumerate(finals)]
            return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                 "choices": choices, "usage": _usage(finals, n), "system_fingerprint": None})

        firsts = await _prime(gens, "prompt")

        async def events():
            finals = list(firsts)
            n_lp = [0] * len(gens)
            offsets = [0] * len(gens)
            try:
                async for i, o in _merge(gens, firsts):
                    finals[i] = o
                    lps = None
                    if lp is not None:
                        new = o.logprobs[n_lp[i]:]
                        n_lp[i] = len(o.logprobs)
                        lps = completion_logprobs(new, [x.token for x in new], len(o.delta_text), offsets[i])
                    offsets[i] += len(o.delta_text)
                    # one chunk per engine output, even when its token printed nothing yet (a partial UTF-8
                    # character, text held back by a stop string): clients can time every token
                    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": [{"index": i, "text": o.delta_text, "logprobs": lps,
                                          "finish_reason": o.finish_reason if o.finished else None}]}
                    if include_usage:
                        chunk["usage"] = None
                    yield _sse(chunk)
                if include_usage:
                    yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                "choices": [], "usage": _usage(finals, n)})
            except Exception as e:  # noqa: BLE001 - report in-band: the status line is already sent
                yield _sse(_engine_error(e, "prompt").body())
            yield "data: [DONE]\n\n"

        return SSEResponse(events(), gens)

    # ---- /v1/chat/completions -------------------------------------------------------------------------
    def chat_logprobs(out_lps) -> list[dict]:
        out = []
        for lp in out_lps:
            out.append({"token": st.tok_str(lp.token), "logprob": _finite(lp.logprob), "bytes": st.tok_bytes(lp.token),
                        "top_logprobs": [{"token": st.tok_str(a), "logprob": _finite(b), "bytes": st.tok_bytes(a)}
                                         for a, b in lp.top]})
        return out

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        model, stream, include_usage = common(body)
        tools = body.get("tools")
        if tools and body.get("tool_choice") != "none":
            raise _bad("tool calling is not supported", "tools", "unsupported_parameter")
        rf = body.get("response_format")
        if rf is not None and (not isinstance(rf, dict) or rf.get("type") not in (None, "text")):
            raise _bad("only response_format {'type': 'text'} is supported", "response_format", "unsupported_value")
        want_lp = _opt_bool(body, "logprobs") or False
        top = _opt_int(body, "top_logprobs", 0, MAX_LOGPROBS)
        if top is not None and not want_lp:
            raise _bad("top_logprobs needs logprobs=true", "top_logprobs")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise _bad("chat_template_kwargs must be an object", "chat_template_kwargs")
        agp = _opt_bool(body, "add_generation_prompt")
        try:
            text = st.chat.format(body.get("messages"), True if agp is None else agp, **kwargs)
        except RequestError as e:
            raise _bad(str(e), "messages") from None
        ids = st.tokenizer.encode(text)
        ids = st.check_prompt(ids, "messages")
        mt = _opt_int(body, "max_completion_tokens", 1)
        mt_param = "max_completion_tokens"
        if mt is None:
            mt, mt_param = _opt_int(body, "max_tokens", 1), "max_tokens"
        st.check_max_tokens(ids, mt, mt_param)
        params = st.sampling(body, mt or (st.max_model_len - len(ids)), mt_param, (top or 0) if want_lp else None)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        gens = start([ids], params, rid, body.get("n") or 1)
        if not stream:
            async def collect():
                firsts = await _prime(gens, "messages")
                finals = list(firsts)
                async for i, o in _merge(gens, firsts):
                    finals[i] = o
                return finals

            finals = await run_until_disconnect(request, collect())
            if finals is None:
                return JSONResponse({}, status_code=499)
            choices = [{"index": i, "message": {"role": "assistant", "content": o.text},
                        "logprobs": {"content": chat_logprobs(o.logprobs)} if want_lp else None,
                        "finish_reason": o.finish_reason} for i, o in enumerate(finals)]
            usage = _usage(finals, len(finals))  # one prompt, however many completions
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                                 "choices": choices, "usage": usage, "system_fingerprint": None})

        firsts = await _prime(gens, "messages")

        async def events():
            finals = list(firsts)
            n_lp = [0] * len(gens)

            def chunk(i: int, delta: dict, finish, lps=None) -> str:
                c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": [{"index": i, "delta": delta, "logprobs": lps, "finish_reason": finish}]}
                if include_usage:
                    c["usage"] = None
                return _sse(c)

            try:
                for i in range(len(gens)):
                    yield chunk(i, {"role": "assistant", "content": ""}, None)
                async for i, o in _merge(gens, firsts):
                    finals[i] = o
                    lps = None
                    if want_lp:
                        lps = {"content": chat_logprobs(o.logprobs[n_lp[i]:])}
                        n_lp[i] = len(o.logprobs)
                    yield chunk(i, {"content": o.delta_text}, o.finish_reason if o.finished else None, lps)
                if include_usage:
                    usage = _usage(finals, len(finals))
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                "choices": [], "usage": usage})
            except Exception as e:  # noqa: BLE001
                yield _sse(_engine_error(e, "messages").body())
            yield "data: [DONE]\n\n"

        return SSEResponse(events(), gens)

    # ---- models, health, metrics ----------------------------------------------------------------------
    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": st.created, "owned_by": "ascend-dsv4", "root": names[0],
                "parent": None, "max_model_len": st.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(n) for n in names]}

    @app.get("/v1/models/{name:path}")
    async def model_info(name: str):
        if name not in names:
            raise ApiError(404, f"the model {name!r} does not exist", "model", "model_not_found")
        return model_card(name)

    def engine_alive() -> bool:
        th = getattr(async_engine, "_thread", None)
        return getattr(async_engine, "_error", None) is None and (th is None or th.is_alive())

    @app.get("/health")
    async def health():
        if not engine_alive():
            return JSONResponse({"status": "error", "message": repr(getattr(async_engine, "_error", None))},
                                status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        s = await asyncio.to_thread(async_engine.stats)  # takes the engine lock: keep the event loop free
        return PlainTextResponse(_metrics_text(s, st, engine_alive()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    app.add_middleware(_Gate, state=st)  # API key + response counts, around every route
    return app


# ---- running ------------------------------------------------------------------------------------------------
class ServerThread:
    """uvicorn serving ``app`` on ``host:port`` (``port=0``: a free port) in a background thread.

    ``with ServerThread(app) as srv: ... srv.url ...``; :meth:`stop` asks uvicorn to exit and joins the thread."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(fam, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        cfg = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2, lifespan="off")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="ascend-dsv4-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{h}:{self.port}"

    def start(self, timeout: float = 20.0) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_server(llm, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               served_model_name: str | Sequence[str] | None = None, max_queue: int = 256,
               model_dir: str | None = None, chat_template: str | None = None, log_level: str = "info",
               sock=None, shutdown_timeout: float = 30.0) -> None:
    """Serve ``llm`` (an :class:`~ascend_dsv4.LLM`) until interrupted; the engine thread stops on exit.

    ``sock``: a socket from :func:`~.serve_lifecycle.bind_socket` (bound before the model loaded); else
    ``host:port`` is bound here. SIGTERM drains: new requests get 503, those in flight get ``shutdown_timeout``
    seconds, then the server exits normally."""
    import uvicorn

    if not isinstance(max_queue, int) or max_queue < 1:
        raise AscendDSV4Error(f"max_queue must be a positive integer, got {max_queue!r}")
    sock = sock if sock is not None else bind_socket(host, port)
    engine = AsyncEngine(llm.engine, max_queue=max_queue, ops_context=llm._ops)
    try:
        names = served_model_name or getattr(llm.cfg, "name", None) or "ascend-dsv4"
        drain = DrainState()
        app = create_app(engine, names, api_key, llm.max_model_len, model_dir=model_dir, chat_template=chat_template,
                         drain=drain)
        port = sock.getsockname()[1]
        where = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        log.info("serving %s on %s (max_model_len %d, max_queue %d, API key %s)",
                 names if isinstance(names, str) else ", ".join(names), where, llm.max_model_len, max_queue,
                 "required" if api_key else "off")
        server = DrainingServer(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5), drain,
                                engine.fail_all, shutdown_timeout)
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()
