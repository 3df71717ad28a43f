"""Serving plumbing between the routes and the engine: merging per-request output streams, server-sent events,
usage, and the Prometheus metrics text."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Sequence

from ...engine.request import RequestOutput
from .protocol import ApiError, ServerState, bad_request, engine_error

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# ---- streaming plumbing ------------------------------------------------------------------------------------
def failed(o: RequestOutput) -> bool:
    """The engine ended this request with an error while computing it (not for lack of KV cache)."""
    return bool(o.finished and o.error and "KV cache" not in o.error)


def failure(o: RequestOutput) -> ApiError:
    return ApiError(500, f"the request failed: {o.error}", None, "request_failed")


async def prime(gens: list, prompt_param: str) -> list[RequestOutput]:
    """Admit every request and wait for its first output, so errors (overload, bad request) become an HTTP
    status before any byte of the response is sent."""
    results = await asyncio.gather(*(g.__anext__() for g in gens), return_exceptions=True)
    err = next((r for r in results if isinstance(r, BaseException)), None)
    if err is None:
        for r in results:
            if failed(r):
                err = failure(r)
                break
            if r.finished and r.finish_reason == "abort" and not r.token_ids:
                err = bad_request("the request needs more KV cache than this server holds; shorten the prompt or "
                           "max_tokens", prompt_param, "kv_capacity_exceeded")
                break
    if err is not None:
        for g in gens:
            await g.aclose()  # aborts the admitted ones
        if isinstance(err, StopAsyncIteration):
            err = ApiError(500, "the engine ended a request without output", None, "internal_error")
        raise engine_error(err, prompt_param)
    return results


async def merge(gens: list, firsts: list[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) pairs of several primed engine streams, in arrival order; closing this aborts them."""
    if len(gens) == 1:
        g, o = gens[0], firsts[0]
        try:
            yield 0, o
            while not o.finished:
                o = await g.__anext__()
                if failed(o):
                    raise failure(o)
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
                if failed(o):
                    raise failure(o)
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


def sse(obj: Any) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n\n"


def usage(outs: Sequence[RequestOutput], n: int = 1) -> dict:
    """Token counts of ``outs`` (``n`` completions per prompt, in order: each prompt counts once)."""
    p = sum(len(o.prompt_token_ids) for o in outs[::n])
    c = sum(len(o.token_ids) for o in outs)
    cached = sum(getattr(o, "num_cached_tokens", 0) or 0 for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


# ---- metrics -------------------------------------------------------------------------------------------------
def histogram(lines: list[str], name: str, help_: str, values: Sequence[float], buckets: Sequence[float]) -> None:
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


def metrics_text(s: dict, st: ServerState, alive: bool) -> str:
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
    histogram(lines, P + "time_to_first_token_seconds", "Time from arrival to the first generated token.",
               s.get("ttft", []), TTFT_BUCKETS)
    histogram(lines, P + "time_per_output_token_seconds", "Mean time per output token after the first, per "
               "request.", s.get("tpot", []), TPOT_BUCKETS)
    name = P + "http_requests_total"
    lines += [f"# HELP {name} HTTP responses by route and status.", f"# TYPE {name} counter"]
    for (path, status), n in sorted(st.http_counts.items()):
        lines.append(f'{name}{{path="{path}",status="{status}"}} {n}')
    return "\n".join(lines) + "\n"


