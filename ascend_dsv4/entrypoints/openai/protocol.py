"""The OpenAI protocol side of the server: the error type and body, and the reading and checking of request fields
(models, prompts, token ids, sampling parameters) against the engine's limits. Every failure is an
:class:`ApiError` naming the offending field (``param``)."""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from typing import Any

from ...engine.async_engine import AsyncEngine, EngineDead, EngineOverloaded, EngineShuttingDown
from ...engine.prompts import PromptError, check_prompt_ids
from ...engine.sampling import SamplingParams
from ...errors import RequestError
from ..chat import ChatFormatter

log = logging.getLogger("ascend_dsv4.server")

MAX_LOGPROBS = 20  # top alternatives per token, as vLLM's default max_logprobs
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
PARAM_RE = re.compile(r"sampling parameter (\w+)=")


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


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def engine_error(e: BaseException, prompt_param: str) -> ApiError:
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
        m = PARAM_RE.search(msg)
        param = m.group(1) if m else prompt_param
        return bad_request(msg, param, "context_length_exceeded" if "max_model_len" in msg else "invalid_value")
    log.exception("unexpected error while serving a request", exc_info=e)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error")


# ---- request field helpers -------------------------------------------------------------------------------
def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def opt_int(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f" in [{lo}, {hi}]" if hi is not None else f" >= {lo}" if lo is not None else ""
        raise bad_request(f"{name} must be null or an integer{rng}, got {v!r}", name)
    return v


def opt_bool(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad_request(f"{name} must be true or false, got {v!r}", name)
    return v


def lone_surrogate(obj: Any, path: str = "", top: str | None = None) -> tuple[str, str] | None:
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
                bad = lone_surrogate(k, f"{path}.<key>" if path else "a field name", top or "body")
                if bad:
                    return bad
            bad = lone_surrogate(v, f"{path}.{key}" if path else key, top or key)
            if bad:
                return bad
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            bad = lone_surrogate(v, f"{path}[{i}]", top)
            if bad:
                return bad
    return None


def finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf; OpenAI clients expect a number


@dataclasses.dataclass
class Prompt:
    text: str | None
    ids: list[int]


class ServerState:
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
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
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
                raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                           f"{param} has {len(ids)} tokens (it must leave room for at least one generated token).",
                           param, "context_length_exceeded") from None
            raise bad_request(str(e), param) from None

    def completion_prompts(self, p: Any) -> list[Prompt]:
        if p is None:
            raise bad_request("prompt is required", "prompt", "missing_required_parameter")
        if isinstance(p, str):
            items: list = [p]
        elif isinstance(p, list) and p and all(is_int(t) for t in p):
            items = [p]
        elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            items = p
        else:
            raise bad_request("prompt must be a string, a non-empty list of strings, a list of token ids or a list of "
                       "token id lists", "prompt")
        out = []
        for x in items:
            if isinstance(x, str):
                pr = Prompt(x, self.tokenizer.encode(x))
            else:
                pr = Prompt(None, list(x))
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
            m = PARAM_RE.search(str(e))
            param = m.group(1) if m else None
            if param == "max_tokens":
                param = max_tokens_param
            raise bad_request(str(e), param) from None
        except (TypeError, ValueError) as e:  # e.g. float() of a string that slipped past validation
            raise bad_request(f"invalid sampling parameters: {e}") from None
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


