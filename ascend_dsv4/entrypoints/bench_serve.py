"""``ascend-dsv4 bench serve``: a load generator for a running OpenAI-compatible server.

``--concurrency`` workers send streaming ``/v1/completions`` requests (``stream_options.include_usage``) until
``--num-requests`` have been sent or ``--duration`` seconds have passed. Prompts are token-id lists of
``--input-len`` ids drawn from ``[3, 259)`` (valid in any vocabulary of at least 259 ids, and exactly
``--input-len`` tokens long whatever the tokenizer); the first ``--shared-prefix-ratio`` of every prompt is the
same for all requests (to exercise prefix caching). Everything is seeded by ``--seed``.

Per request it measures the time to the first streamed token (TTFT), the end-to-end latency and the time per
output token after the first (TPOT = (latency - TTFT) / (output tokens - 1)); it reports requests/s, output
tokens/s and p50/p90/p99 of each, and counts every failure (HTTP status, in-band error event, timeout,
connection error, malformed stream) instead of stopping. Each request is bounded by ``--timeout``, so the
whole run ends within about ``duration + timeout`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["BenchConfig", "make_prompt", "make_prompts", "run_bench", "format_report", "add_arguments", "main"]

TOKEN_LO, TOKEN_HI = 3, 259


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    api_key: str | None = None
    concurrency: int = 8
    num_requests: int | None = None
    duration: float | None = None
    input_len: int = 128
    output_len: int = 64
    shared_prefix_ratio: float = 0.0
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout: float = 120.0
    progress: bool = False

    def check(self) -> None:
        self.base_url = server_root(self.base_url)
        if self.concurrency < 1:
            raise ValueError("--concurrency must be >= 1")
        if self.num_requests is None and self.duration is None:
            self.num_requests = 64
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("--num-requests must be >= 1")
        if self.duration is not None and not self.duration > 0:
            raise ValueError("--duration must be > 0 seconds")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--input-len and --output-len must be >= 1")
        if not 0.0 <= self.shared_prefix_ratio <= 1.0:
            raise ValueError("--shared-prefix-ratio must be in [0, 1]")
        if not self.timeout > 0:
            raise ValueError("--timeout must be > 0 seconds")


def server_root(url: str) -> str:
    """The server root of ``url``: a trailing ``/`` and ``/v1`` are dropped (vLLM's and OpenAI's clients take the
    ``.../v1`` form, so users paste it)."""
    u = url.strip().rstrip("/")
    if u.endswith("/v1"):
        u = u[:-3].rstrip("/")
    if not u.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must be an http:// or https:// URL, got {url!r}")
    return u


@dataclass
class _Result:
    ok: bool
    latency: float
    ttft: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class _Run:
    results: list[_Result] = field(default_factory=list)
    sent: int = 0


def make_prompt(i: int, input_len: int, shared_prefix_ratio: float, seed: int) -> list[int]:
    """Prompt ``i``: ``input_len`` token ids, of which the first ``round(ratio * input_len)`` are common to all
    prompts of this seed and the rest depend on ``(seed, i)`` only."""
    k = int(round(shared_prefix_ratio * input_len))
    rng = random.Random(seed)
    prefix = [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(k)]
    rng = random.Random(f"{seed}/{i}")
    return prefix + [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(input_len - k)]


def make_prompts(n: int, input_len: int, shared_prefix_ratio: float, seed: int) -> list[list[int]]:
    return [make_prompt(i, input_len, shared_prefix_ratio, seed) for i in range(n)]


def _pct(xs: list[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default)."""
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _summary_ms(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {"mean": 1000 * sum(xs) / len(xs), "p50": 1000 * _pct(xs, 50), "p90": 1000 * _pct(xs, 90),
            "p99": 1000 * _pct(xs, 99)}


def _error_of(status: int, raw: bytes) -> str:
    try:
        err = json.loads(raw).get("error") or {}
        msg = err.get("code") or err.get("type") or ""
    except (ValueError, AttributeError):
        msg = ""
    return f"HTTP {status}" + (f" ({msg})" if msg else "")


async def _one(client, cfg: BenchConfig, model: str, prompt: list[int]) -> _Result:
    """One streaming request, bounded by ``cfg.timeout`` seconds in all."""
    t0 = time.perf_counter()
    try:
        return await asyncio.wait_for(_stream_one(client, cfg, model, prompt), cfg.timeout)
    except asyncio.TimeoutError:
        return _Result(False, time.perf_counter() - t0, error="timeout")


async def _stream_one(client, cfg: BenchConfig, model: str, prompt: list[int]) -> _Result:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": cfg.output_len, "temperature": cfg.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    ttft = None
    n_chunks = 0
    usage = None
    finish = None
    done = False
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                return _Result(False, time.perf_counter() - t0, error=_error_of(resp.status_code, raw[:2000]))
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    obj = json.loads(data)
                except ValueError:
                    return _Result(False, time.perf_counter() - t0, ttft, error="malformed event")
                if not isinstance(obj, dict):
                    return _Result(False, time.perf_counter() - t0, ttft, error="malformed event")
                if obj.get("error"):
                    e = obj["error"]
                    code = (e.get("code") or e.get("type")) if isinstance(e, dict) else None
                    return _Result(False, time.perf_counter() - t0, ttft, error=f"stream error ({code})")
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj.get("choices") or []:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    n_chunks += 1
                    if ch.get("finish_reason"):
                        finish = ch["finish_reason"]
    except httpx.TimeoutException:
        return _Result(False, time.perf_counter() - t0, ttft, error="timeout")
    except httpx.HTTPError as e:
        return _Result(False, time.perf_counter() - t0, ttft, error=type(e).__name__)
    latency = time.perf_counter() - t0
    if not done or finish is None:
        return _Result(False, latency, ttft, error="stream ended early")
    out = usage.get("completion_tokens", n_chunks) if isinstance(usage, dict) else n_chunks
    inp = usage.get("prompt_tokens", len(prompt)) if isinstance(usage, dict) else len(prompt)
    return _Result(True, latency, ttft, inp, out, finish)


async def _resolve_model(client, cfg: BenchConfig) -> str:
    if cfg.model:
        return cfg.model
    r = await client.get("/v1/models")
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError("the server lists no models; pass --model")
    return data[0]["id"]


async def run_bench(cfg: BenchConfig) -> dict:
    """Run the load and return the report (a JSON-serialisable dict)."""
    import httpx

    cfg.check()
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency + 2, max_keepalive_connections=cfg.concurrency + 2)
    timeout = httpx.Timeout(cfg.timeout, connect=min(cfg.timeout, 10.0))
    run = _Run()
    async with httpx.AsyncClient(base_url=cfg.base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=timeout) as client:
        try:
            model = await _resolve_model(client, cfg)
        except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as e:
            return {"base_url": cfg.base_url, "error": f"cannot query {cfg.base_url}/v1/models: {e!r}",
                    "completed": 0, "errors": 0, "num_requests": 0}
        t_start = time.perf_counter()
        deadline = t_start + cfg.duration if cfg.duration is not None else None

        async def worker() -> None:
            while True:
                if cfg.num_requests is not None and run.sent >= cfg.num_requests:
                    return
                if deadline is not None and time.perf_counter() >= deadline:
                    return
                i = run.sent
                run.sent += 1
                prompt = make_prompt(i, cfg.input_len, cfg.shared_prefix_ratio, cfg.seed)
                res = await _one(client, cfg, model, prompt)
                run.results.append(res)
                bar.update(1)
                if not res.ok:
                    bar.set_postfix_str(f"{sum(not r.ok for r in run.results)} errors", refresh=False)

        from tqdm import tqdm

        bar = tqdm(total=cfg.num_requests, unit="req", desc="bench serve", file=sys.stderr,
                   disable=not cfg.progress, dynamic_ncols=True)
        try:
            await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
        finally:
            bar.close()
        elapsed = time.perf_counter() - t_start
    ok = [r for r in run.results if r.ok]
    bad = [r for r in run.results if not r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]
    return {
        "base_url": cfg.base_url, "model": model, "concurrency": cfg.concurrency, "input_len": cfg.input_len,
        "output_len": cfg.output_len, "shared_prefix_ratio": cfg.shared_prefix_ratio, "seed": cfg.seed,
        "num_requests": len(run.results), "completed": len(ok), "errors": len(bad),
        "error_kinds": dict(Counter(r.error for r in bad)),
        "finish_reasons": dict(Counter(r.finish_reason for r in ok)),
        "duration_s": elapsed,
        "requests_per_s": len(ok) / elapsed if elapsed > 0 else 0.0,
        "input_tokens_per_s": in_tok / elapsed if elapsed > 0 else 0.0,
        "output_tokens_per_s": out_tok / elapsed if elapsed > 0 else 0.0,
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "ttft_ms": _summary_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _summary_ms(tpots),
        "e2e_latency_ms": _summary_ms([r.latency for r in ok]),
    }


def format_report(r: dict) -> str:
    if r.get("error"):
        return f"bench serve: {r['error']}"

    def row(name: str, d: dict) -> str:
        if d.get("p50") is None:
            return f"{name:<18} n/a"
        return f"{name:<18} mean {d['mean']:9.1f}  p50 {d['p50']:9.1f}  p90 {d['p90']:9.1f}  p99 {d['p99']:9.1f}"

    lines = [
        f"server             {r['base_url']}  model {r['model']}",
        f"load               concurrency {r['concurrency']}, input {r['input_len']} tok, output {r['output_len']} "
        f"tok, shared prefix {r['shared_prefix_ratio']:.0%}",
        f"requests           {r['completed']} ok / {r['num_requests']} sent in {r['duration_s']:.2f} s"
        + (f"  ({r['errors']} errors: {', '.join(f'{k} x{v}' for k, v in r['error_kinds'].items())})"
           if r["errors"] else ""),
        f"throughput         {r['requests_per_s']:.2f} req/s, {r['output_tokens_per_s']:.1f} output tok/s, "
        f"{r['input_tokens_per_s']:.1f} input tok/s",
        row("TTFT (ms)", r["ttft_ms"]),
        row("TPOT (ms)", r["tpot_ms"]),
        row("E2E latency (ms)", r["e2e_latency_ms"]),
    ]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server URL; the root or the OpenAI base URL ending in /v1 (both work)")
    p.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer <key>'")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--num-requests", type=int, default=None, help="requests to send (default 64 without --duration)")
    p.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request")
    p.add_argument("--shared-prefix-ratio", type=float, default=0.0,
                   help="fraction of every prompt that is a prefix common to all requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly --output-len tokens (vLLM extension)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds allowed per request")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress bar on stderr (auto: when stderr is a terminal)")


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    return BenchConfig(base_url=a.base_url, model=a.model, api_key=a.api_key, concurrency=a.concurrency,
                       num_requests=a.num_requests, duration=a.duration, input_len=a.input_len,
                       output_len=a.output_len, shared_prefix_ratio=a.shared_prefix_ratio, seed=a.seed,
                       temperature=a.temperature, ignore_eos=a.ignore_eos, timeout=a.timeout,
                       progress=_progress_on(getattr(a, "progress", "auto")))


def _progress_on(mode: str) -> bool:
    if mode in ("on", "off"):
        return mode == "on"
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def main(a: argparse.Namespace) -> int:
    """Entry point of ``ascend-dsv4 bench serve``: 0 when every request succeeded, 1 otherwise."""
    try:
        import httpx  # noqa: F401
    except ImportError:
        print("error: bench serve needs the 'httpx' package (pip install httpx)", file=sys.stderr)
        return 2
    cfg = config_from_args(a)
    try:
        cfg.check()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = asyncio.run(run_bench(cfg))
    print(json.dumps(report, indent=2) if a.json else format_report(report))
    return 0 if not report.get("error") and report["errors"] == 0 else 1
