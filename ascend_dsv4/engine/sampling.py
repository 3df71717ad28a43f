"""Sampling parameters and the token sampler.

:class:`SamplingParams` holds what a request asks of sampling and checks it (every bad field raises
:class:`~ascend_dsv4.errors.RequestError` naming the field and the allowed range). :class:`Sampler`
turns a batch of last-position logits into one token per row:

* ``temperature == 0`` (or below ``GREEDY_EPS``): greedy argmax; ties go to the lowest token id.
* otherwise: logits / temperature, then top-k, then top-p (nucleus), then min-p, then one draw with
  :func:`torch.multinomial` using the row's own :class:`torch.Generator`. A row's draw depends only on
  its logits, its parameters and its generator, so a seeded request yields the same tokens whatever
  else is in the batch.

:meth:`Sampler.logprobs_of` reports the chosen token's log-probability and the top-k alternatives,
taken from ``log_softmax`` of the raw (unscaled, unfiltered) logits.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from ..errors import RequestError, RequestFailed
from .sampling_guard import bad_logit_rows, check_distribution, describe_bad_row

__all__ = ["SamplingParams", "Sampler", "TokenLogprobs", "make_generator", "apply_penalties", "GREEDY_EPS",
           "TEMPERATURE_MAX", "REPETITION_PENALTY_RANGE"]

# Temperatures below this are treated as greedy: dividing by them would overflow float32 logits.
GREEDY_EPS = 1e-5
# Ranges where the arithmetic stays finite for any float32 logit a model produces (|logit| < 1e30): dividing or
# multiplying by a repetition penalty in this range, or dividing by a temperature >= GREEDY_EPS, cannot overflow
# float32. (A repetition_penalty of 1e-300 is 0 in float32: its division made every seen logit inf and NaN
# probabilities.) Non-finite results that slip through anyway end only their own request (sampling_guard).
TEMPERATURE_MAX = 1e4
MAX_N = 128  # completions per prompt
REPETITION_PENALTY_RANGE = (1e-2, 1e2)
_SEED_MAX = 2**64  # torch.Generator.manual_seed takes seeds in [0, 2**64)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _bad(field: str, rule: str, value) -> RequestError:
    return RequestError(f"sampling parameter {field}={value!r} is invalid: {rule}")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to report; None: no logprobs
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # prompt + generated tokens: positive logits / p, negative * p
    stop: list[str] | None = None  # stop strings: the output ends before the first occurrence
    n: int = 1  # completions per prompt (LLM.generate and the server fan a request out; the engine runs one each)

    def __post_init__(self):
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.min_p = float(self.min_p)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise RequestError naming the first bad field; ``vocab_size`` adds the range checks on ids."""
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise _bad("n", f"must be an integer in [1, {MAX_N}]", self.n)
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise _bad("max_tokens", "must be an integer >= 1", self.max_tokens)
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or not 0 <= t <= TEMPERATURE_MAX:
            raise _bad("temperature", f"must be a number in [0, {TEMPERATURE_MAX:g}] (0 means greedy)", t)
        p = self.top_p
        if not _is_real(p) or not (0.0 < p <= 1.0):
            raise _bad("top_p", "must be a number in (0, 1]", p)
        k = self.top_k
        if not _is_int(k) or k < -1:
            raise _bad("top_k", "must be an integer >= -1 (-1 or 0 disables it)", k)
        if vocab_size is not None and k > vocab_size:
            raise _bad("top_k", f"must be an integer in [-1, {vocab_size}] (vocab_size={vocab_size})", k)
        m = self.min_p
        if not _is_real(m) or not (0.0 <= m <= 1.0):
            raise _bad("min_p", "must be a number in [0, 1]", m)
        s = self.seed
        if s is not None and (not _is_int(s) or not (0 <= s < _SEED_MAX)):
            raise _bad("seed", "must be null or an integer in [0, 2**64)", s)
        ids = self.stop_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)):
                raise _bad("stop_token_ids", "must be null or a list of integer token ids", ids)
            hi = f"vocab_size={vocab_size}" if vocab_size is not None else "no upper bound known"
            for i in ids:
                if not _is_int(i) or i < 0 or (vocab_size is not None and i >= vocab_size):
                    rng = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                    raise _bad("stop_token_ids", f"each id must be an integer in {rng} ({hi})", i)
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", "must be true or false", self.ignore_eos)
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            v = getattr(self, name)
            if not _is_real(v) or not (lo <= v <= hi):
                raise _bad(name, f"must be a number in [{lo:g}, {hi:g}]", v)
        rp = self.repetition_penalty
        lo, hi = REPETITION_PENALTY_RANGE
        if not _is_real(rp) or not math.isfinite(rp) or not lo <= rp <= hi:
            raise _bad("repetition_penalty", f"must be a number in [{lo:g}, {hi:g}] (1 disables it)", rp)
        if self.stop is not None and (not isinstance(self.stop, (list, tuple))
                                      or not all(isinstance(x, str) and x for x in self.stop)):
            raise _bad("stop", "must be null, a non-empty string or a list of non-empty strings", self.stop)
        lp = self.logprobs
        if lp is not None:
            if not _is_int(lp) or lp < 0:
                raise _bad("logprobs", "must be null or an integer >= 0", lp)
            if vocab_size is not None and lp > vocab_size:
                raise _bad("logprobs", f"must be null or an integer in [0, {vocab_size}] (vocab_size)", lp)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded with ``seed`` on ``device``; None when ``seed`` is None (use the global RNG)."""
    if seed is None:
        return None
    if not _is_int(seed) or not (0 <= seed < _SEED_MAX):
        raise _bad("seed", "must be null or an integer in [0, 2**64)", seed)
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return g


def _refuse_bad_rows(logits: torch.Tensor) -> None:
    """RequestFailed when a row of ``logits`` holds NaN / +inf or nothing finite: argmax would return token 0
    and multinomial would raise."""
    bad = bad_logit_rows(logits)
    if bad:
        raise RequestFailed(f"the model produced non-finite logits (row {bad[0]}: {describe_bad_row(logits[bad[0]])})")


class TokenLogprobs(NamedTuple):
    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first; ties: lowest id first


class Sampler:
    """Stateless; one instance serves every step."""

    @staticmethod
    def _filtered_sorted(x: torch.Tensor, sp: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
        """(probabilities in descending-logit order after temperature, top-k, top-p and min-p; that order)."""
        dev, V = x.device, x.shape[1]
        temp = torch.tensor([p.temperature for p in sp], dtype=torch.float32, device=dev)
        x = x.float() / temp[:, None]
        # Stable descending sort: equal logits keep ascending token order, so filtering is deterministic.
        vals, order = torch.sort(x, dim=-1, descending=True, stable=True)
        pos = torch.arange(V, device=dev)[None, :]
        keep = torch.ones_like(vals, dtype=torch.bool)
        ks = [p.top_k if p.top_k > 0 else V for p in sp]
        if any(k < V for k in ks):
            k_t = torch.tensor([min(k, V) for k in ks], device=dev)
            keep &= pos < k_t[:, None]
        tps = [p.top_p for p in sp]
        if any(tp < 1.0 for tp in tps):
            probs = torch.softmax(vals.masked_fill(~keep, -math.inf), dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
            tp_t = torch.tensor(tps, dtype=torch.float32, device=dev)
            nucleus = (before < tp_t[:, None]) | (tp_t[:, None] >= 1.0)
            nucleus[:, 0] = True  # the top token always survives
            keep &= nucleus
        mps = [p.min_p for p in sp]
        if any(mp > 0.0 for mp in mps):
            probs = torch.softmax(vals.masked_fill(~keep, -math.inf), dim=-1)
            mp_t = torch.tensor(mps, dtype=torch.float32, device=dev)
            above = probs >= mp_t[:, None] * probs[:, :1]
            above[:, 0] = True
            keep &= above
        return torch.softmax(vals.masked_fill(~keep, -math.inf), dim=-1), order

    def probs(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """The distribution [B, V] that :meth:`sample` draws from (one-hot on the argmax for greedy rows)."""
        _refuse_bad_rows(logits)
        out = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        for i, p in enumerate(params):
            if p.greedy:
                out[i, torch.argmax(logits[i])] = 1.0
            else:
                pr, order = self._filtered_sorted(logits[i:i + 1], [p])
                check_distribution(pr, "sampling")
                out[i].scatter_(0, order[0], pr[0])
        return out

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        """One token per row of ``logits`` [B, V]; returns int64 [B] on the logits' device."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        B, V = logits.shape
        if len(params) != B or len(generators) != B:
            raise ValueError(f"logits has {B} rows but got {len(params)} params and {len(generators)} generators")
        dev = logits.device
        out = torch.empty(B, dtype=torch.int64, device=dev)
        if B == 0:
            return out
        logits = logits.float()
        _refuse_bad_rows(logits)
        greedy = [p.greedy for p in params]
        g_rows = [i for i in range(B) if greedy[i]]
        s_rows = [i for i in range(B) if not greedy[i]]
        if g_rows:
            idx = torch.tensor(g_rows, device=dev)
            # torch.argmax returns the first maximal index: ties go to the lowest token id.
            out[idx] = torch.argmax(logits[idx], dim=-1)
        if not s_rows:
            return out

        sp = [params[i] for i in s_rows]
        probs, order = self._filtered_sorted(logits[torch.tensor(s_rows, device=dev)], sp)
        check_distribution(probs, "sampling")

        # Draw in sorted space, then map back through ``order``. Seeded rows draw alone with their own
        # generator; unseeded rows share one draw from the global RNG.
        picks = torch.empty(len(sp), dtype=torch.int64, device=dev)
        free = []
        for j, i in enumerate(s_rows):
            g = generators[i]
            if g is None:
                free.append(j)
            else:
                picks[j] = torch.multinomial(probs[j], 1, generator=g)[0]
        if free:
            f = torch.tensor(free, device=dev)
            picks[f] = torch.multinomial(probs[f], 1)[:, 0]
        tokens = torch.gather(order, 1, picks[:, None])[:, 0]
        out[torch.tensor(s_rows, device=dev)] = tokens
        return out

    @staticmethod
    @torch.no_grad()
    def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor | Sequence[int],
                    k: int | Sequence[int | None]) -> list[TokenLogprobs]:
        """Per row: the chosen token's logprob and the ``k`` most likely (token, logprob) pairs.

        Log-probabilities are ``log_softmax`` of the raw logits (before temperature and filtering).
        ``k`` is one count for every row or one per row (None or 0: no alternatives); it is capped at V.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        B, V = logits.shape
        tok = torch.as_tensor(tokens, dtype=torch.int64, device=logits.device).reshape(-1)
        if tok.numel() != B:
            raise ValueError(f"logits has {B} rows but got {tok.numel()} tokens")
        ks = [k] * B if isinstance(k, numbers.Integral) or k is None else list(k)
        if len(ks) != B:
            raise ValueError(f"logits has {B} rows but got {len(ks)} logprob counts")
        ks = [min(int(x or 0), V) for x in ks]
        lp = torch.log_softmax(logits.float(), dim=-1)
        chosen = torch.gather(lp, 1, tok[:, None])[:, 0].tolist()
        kmax = max(ks, default=0)
        if kmax > 0:
            top_v, top_i = torch.sort(lp, dim=-1, descending=True, stable=True)
            top_v, top_i = top_v[:, :kmax].tolist(), top_i[:, :kmax].tolist()
        out = []
        for r in range(B):
            top = list(zip(top_i[r][:ks[r]], top_v[r][:ks[r]])) if ks[r] else []
            out.append(TokenLogprobs(int(tok[r]), chosen[r], top))
        return out


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
                    outputs: Sequence[Sequence[int]]) -> torch.Tensor:
    """Presence / frequency penalties (over generated tokens) and the repetition penalty (over prompt and
    generated tokens), OpenAI / vLLM semantics. logits: [B, V] float32; returns a new tensor."""
    out = logits.clone()
    for i, p in enumerate(params):
        if p.presence_penalty or p.frequency_penalty:
            if outputs[i]:
                ids = torch.tensor(outputs[i], dtype=torch.long, device=out.device)
                counts = torch.bincount(ids, minlength=out.shape[1]).to(out.dtype)
                out[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(out.dtype)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompts[i]) | set(outputs[i])), dtype=torch.long, device=out.device)
            if len(seen):
                v = out[i, seen]
                out[i, seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    return out
