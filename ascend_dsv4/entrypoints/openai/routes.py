"""The FastAPI app: routes (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/metrics``), the API-key / drain / counting middleware, and the per-route request handling."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import time
import uuid
from typing import Sequence

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...engine.async_engine import AsyncEngine
from ...engine.sampling import MAX_N, SamplingParams
from ...errors import RequestError
from ..chat import ChatFormatter
from ..serve_lifecycle import DrainState
from .protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS, MAX_LOGPROBS, ApiError, ServerState, bad_request, engine_error, finite, is_int,
    lone_surrogate, opt_bool, opt_int,
)
from .serving import SSE_HEADERS, merge, metrics_text, prime, sse, usage

# ---- the app -----------------------------------------------------------------------------------------------
_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class _Gate:
    """Pure ASGI middleware: API-key check on /v1/* and response counts by route and status (streaming-safe,
    unlike BaseHTTPMiddleware)."""

    def __init__(self, app, state: ServerState):
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
            await send_error(engine_error(e, "prompt"))


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
    st = ServerState(async_engine, names, api_key or None, mml, ChatFormatter.from_folder(model_dir, chat_template))
    st.drain = drain or DrainState()  # SIGTERM drain (serve_lifecycle): refuse new requests, count those in flight

    app = FastAPI(title="ascend-dsv4 OpenAI-compatible server", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = st

    class SSEResponse(StreamingResponse):
        """Closes its body iterator and the engine streams however the response ends (even before the body
        started), so a dropped client always aborts its requests."""

        def __init__(self, content, gens: list):
            super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
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
        return error_response(engine_error(e, "prompt"))

    async def read_json(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
        bad = lone_surrogate(body)
        if bad is not None:
            field, top = bad
            raise bad_request(f"{field} holds a lone UTF-16 surrogate (an escape \\ud800-\\udfff without its pair): it is "
                       f"not Unicode text and cannot be encoded", top, "invalid_unicode")
        return body

    def common(body: dict) -> tuple[str, bool, bool]:
        model = st.model(body)
        n = body.get("n")
        if n is not None and (not is_int(n) or not 1 <= n <= MAX_N):
            raise bad_request(f"n must be an integer in [1, {MAX_N}], got n={n!r}", "n")
        best_of = body.get("best_of")
        if best_of is not None and best_of != 1:
            raise bad_request(f"only best_of=1 is supported, got {best_of!r}", "best_of", "unsupported_value")
        if body.get("logit_bias"):
            raise bad_request("logit_bias is not supported", "logit_bias", "unsupported_parameter")
        if body.get("min_tokens"):
            raise bad_request("min_tokens is not supported", "min_tokens", "unsupported_parameter")
        stream = opt_bool(body, "stream") or False
        so = body.get("stream_options")
        if so is not None and not isinstance(so, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        inc = (so or {}).get("include_usage")
        if inc is not None and not isinstance(inc, bool):
            raise bad_request("stream_options.include_usage must be true or false", "stream_options")
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
            lps.append(finite(lp.logprob))
            top: dict[str, float] = {}
            for a, b in lp.top:  # tokens that print alike (e.g. partial UTF-8 bytes) keep the likeliest
                top.setdefault(st.tok_str(a), finite(b))
            top.setdefault(s, finite(lp.logprob))
            tops.append(top)
            offs.append(min(off, base + text_len))
            off += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        model, stream, include_usage = common(body)
        if body.get("echo"):
            raise bad_request("echo is not supported", "echo", "unsupported_parameter")
        if body.get("suffix"):
            raise bad_request("suffix is not supported", "suffix", "unsupported_parameter")
        prompts = st.completion_prompts(body.get("prompt"))
        max_tokens = opt_int(body, "max_tokens", 1)
        left = min(st.check_max_tokens(p.ids, max_tokens, "max_tokens") for p in prompts)
        if max_tokens is None:  # OpenAI's default, within the context left
            max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, left)
        lp = body.get("logprobs")
        if lp is not None and (not is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
            raise bad_request(f"logprobs must be null or an integer in [0, {MAX_LOGPROBS}], got {lp!r}", "logprobs")
        params = st.sampling(body, max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, "max_tokens", lp)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        n = body.get("n") or 1
        gens = start([p.ids for p in prompts], params, rid, n)
        if not stream:
            async def collect():
                firsts = await prime(gens, "prompt")
                finals = list(firsts)
                async for i, o in merge(gens, firsts):
                    finals[i] = o
                return finals

            finals = await run_until_disconnect(request, collect())
            if finals is None:
                return JSONResponse({}, status_code=499)
            choices = [{"index": i, "text": o.text, "finish_reason": o.finish_reason,
                        "logprobs": completion_logprobs(o.logprobs, o.token_ids, len(o.text), 0) if lp is not None
                        else None} for i, o in enumerate(finals)]
            return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                 "choices": choices, "usage": usage(finals, n), "system_fingerprint": None})

        firsts = await prime(gens, "prompt")

        async def events():
            finals = list(firsts)
            n_lp = [0] * len(gens)
            offsets = [0] * len(gens)
            try:
                async for i, o in merge(gens, firsts):
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
                    yield sse(chunk)
                if include_usage:
                    yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                "choices": [], "usage": usage(finals, n)})
            except Exception as e:  # noqa: BLE001 - report in-band: the status line is already sent
                yield sse(engine_error(e, "prompt").body())
            yield "data: [DONE]\n\n"

        return SSEResponse(events(), gens)

    # ---- /v1/chat/completions -------------------------------------------------------------------------
    def chat_logprobs(out_lps) -> list[dict]:
        out = []
        for lp in out_lps:
            out.append({"token": st.tok_str(lp.token), "logprob": finite(lp.logprob), "bytes": st.tok_bytes(lp.token),
                        "top_logprobs": [{"token": st.tok_str(a), "logprob": finite(b), "bytes": st.tok_bytes(a)}
                                         for a, b in lp.top]})
        return out

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        model, stream, include_usage = common(body)
        tools = body.get("tools")
        if tools and body.get("tool_choice") != "none":
            raise bad_request("tool calling is not supported", "tools", "unsupported_parameter")
        rf = body.get("response_format")
        if rf is not None and (not isinstance(rf, dict) or rf.get("type") not in (None, "text")):
            raise bad_request("only response_format {'type': 'text'} is supported", "response_format", "unsupported_value")
        want_lp = opt_bool(body, "logprobs") or False
        top = opt_int(body, "top_logprobs", 0, MAX_LOGPROBS)
        if top is not None and not want_lp:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
        agp = opt_bool(body, "add_generation_prompt")
        try:
            text = st.chat.format(body.get("messages"), True if agp is None else agp, **kwargs)
        except RequestError as e:
            raise bad_request(str(e), "messages") from None
        ids = st.tokenizer.encode(text)
        ids = st.check_prompt(ids, "messages")
        mt = opt_int(body, "max_completion_tokens", 1)
        mt_param = "max_completion_tokens"
        if mt is None:
            mt, mt_param = opt_int(body, "max_tokens", 1), "max_tokens"
        st.check_max_tokens(ids, mt, mt_param)
        params = st.sampling(body, mt or (st.max_model_len - len(ids)), mt_param, (top or 0) if want_lp else None)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        gens = start([ids], params, rid, body.get("n") or 1)
        if not stream:
            async def collect():
                firsts = await prime(gens, "messages")
                finals = list(firsts)
                async for i, o in merge(gens, firsts):
                    finals[i] = o
                return finals

            finals = await run_until_disconnect(request, collect())
            if finals is None:
                return JSONResponse({}, status_code=499)
            choices = [{"index": i, "message": {"role": "assistant", "content": o.text},
                        "logprobs": {"content": chat_logprobs(o.logprobs)} if want_lp else None,
                        "finish_reason": o.finish_reason} for i, o in enumerate(finals)]
            total = usage(finals, len(finals))  # one prompt, however many completions
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                                 "choices": choices, "usage": total, "system_fingerprint": None})

        firsts = await prime(gens, "messages")

        async def events():
            finals = list(firsts)
            n_lp = [0] * len(gens)

            def chunk(i: int, delta: dict, finish, lps=None) -> str:
                c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": [{"index": i, "delta": delta, "logprobs": lps, "finish_reason": finish}]}
                if include_usage:
                    c["usage"] = None
                return sse(c)

            try:
                for i in range(len(gens)):
                    yield chunk(i, {"role": "assistant", "content": ""}, None)
                async for i, o in merge(gens, firsts):
                    finals[i] = o
                    lps = None
                    if want_lp:
                        lps = {"content": chat_logprobs(o.logprobs[n_lp[i]:])}
                        n_lp[i] = len(o.logprobs)
                    yield chunk(i, {"content": o.delta_text}, o.finish_reason if o.finished else None, lps)
                if include_usage:
                    total = usage(finals, len(finals))
                    yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                "choices": [], "usage": total})
            except Exception as e:  # noqa: BLE001
                yield sse(engine_error(e, "messages").body())
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
        return PlainTextResponse(metrics_text(s, st, engine_alive()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    app.add_middleware(_Gate, state=st)  # API key + response counts, around every route
    return app


