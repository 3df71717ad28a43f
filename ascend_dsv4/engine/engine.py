"""LLMEngine: requests in, tokens out, one scheduler step at a time (synchronous; see async_engine for serving).

Each :meth:`LLMEngine.step` asks the scheduler for a ragged batch, runs it through the model runner, samples
one token for every request whose pending tokens are all computed, applies stop conditions (EOS, stop token
ids, stop strings, max_tokens, max_model_len) and returns a :class:`RequestOutput` for every request that
produced something. Metrics (throughput, TTFT, TPOT, queue length, KV usage, prefix hits) are kept in
:class:`EngineStats`.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from ..errors import RequestError
from .model_runner import ModelRunner
from .overlap import AsyncDecode
from .request import Request, RequestOutput, Status
from .sampling import Sampler, SamplingParams, apply_penalties, make_generator
from .sampling_guard import bad_logit_rows, describe_bad_row
from .prefix_cache import PrefixCache
from .prompts import check_prompt_ids
from .scheduler import Scheduler
from .spec_decode import MTPDrafter, rejection_accept, speculation_problem
from .tokenizer import IncrementalDetokenizer

log = logging.getLogger("ascend_dsv4")


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    ttft: list[float] = field(default_factory=list)  # seconds, per request
    tpot: list[float] = field(default_factory=list)  # seconds per output token after the first, per request
    prefix_queries: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    mtp_proposed: int = 0
    mtp_accepted: int = 0
    steps: int = 0


def async_problem(async_scheduling: bool, num_speculative_tokens) -> str | None:
    """Why async scheduling cannot run with these settings (None: it can): the engine's rule, which ``LLM`` also
    checks before a data-parallel layout starts its workers."""
    if async_scheduling and num_speculative_tokens:
        return ("async_scheduling does not work with speculative decoding (num_speculative_tokens): the draft of a "
                "step depends on the host's view of the step before")
    return None


class LLMEngine:
    def __init__(self, runner: ModelRunner, tokenizer, max_model_len: int, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 512, enable_prefix_caching: bool = False,
                 num_speculative_tokens: int = 0, async_scheduling: bool = False):
        self.runner, self.tokenizer, self.max_model_len = runner, tokenizer, max_model_len
        self.cfg = runner.cfg
        self.stats = EngineStats()
        prefix_cache = PrefixCache(runner.pools, self.stats) if enable_prefix_caching else None
        self.prefix_cache = prefix_cache
        self.scheduler = Scheduler(runner.pools, max_num_seqs, max_num_batched_tokens,
                                   on_admit=prefix_cache.attach if prefix_cache else None,
                                   on_free=prefix_cache.release if prefix_cache else None)
        self.sampler = Sampler()
        problem = speculation_problem(num_speculative_tokens, runner.has_mtp)
        if problem:
            raise RequestError(problem)
        self.num_spec = num_speculative_tokens
        self.drafter = MTPDrafter(runner, self.sampler) if num_speculative_tokens else None
        graphs = getattr(runner, "graphs", None)
        if num_speculative_tokens and graphs is not None:  # verification steps: 1 + drafts rows a sequence
            graphs.allow_rows((1 + num_speculative_tokens) * max_num_seqs)
        problem = async_problem(async_scheduling, num_speculative_tokens)
        if problem:
            raise RequestError(problem)
        # greedy decode steps launched before the host has processed the step in flight (engine/overlap.py);
        # only a runner that can launch a step without waiting takes part (ModelRunner.launch_greedy, under tensor
        # / expert parallelism mirrored to every rank; a data-parallel replica's, executor_dp.ReplicaRunner)
        can = hasattr(runner, "launch_greedy")
        self.overlap = AsyncDecode(self) if async_scheduling and can else None
        if async_scheduling and self.overlap is None:
            log.info("async_scheduling: this runner cannot launch a step without waiting; running without it")
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()

    # ---- requests ------------------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None) -> Request:
        """Validate and tokenize a request without touching the engine's state (safe from any thread)."""
        params = params or SamplingParams()
        params.validate(self.cfg.vocab_size)
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        ids = check_prompt_ids(ids, self.cfg.vocab_size, self.max_model_len)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        return Request(rid, text, ids, params, IncrementalDetokenizer(self.tokenizer), make_generator(params.seed))

    def enqueue(self, req: Request) -> str:
        if req.request_id in self.requests:
            raise RequestError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        self.stats.prompt_tokens += len(req.prompt_ids)
        return req.request_id

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        return self.enqueue(self.make_request(prompt, params, request_id))

    def abort_request(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None or req.finished:
            return False
        self.scheduler.abort(req)
        self.stats.aborted += 1
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def kv_usage(self) -> float:
        a = self.runner.pools.token_alloc
        return 1.0 - a.num_free / max(1, a.num_blocks)

    # ---- stepping ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = self._take_aborted()
        if self.overlap is not None and self.overlap.inflight is not None:
            return self.overlap.step(outputs)
        batch = self.scheduler.schedule()
        outputs += self._take_aborted()  # aborted by the scheduler (can never fit)
        if not batch:
            return outputs
        pools, runner = self.runner.pools, self.runner
        reqs = [r for r, _ in batch]
        chunks = [r.pending[:n] for r, n in batch]
        # a decoding request with a draft verifies it in the same forward
        drafts: list[list[int]] = []
        for r, c in zip(reqs, chunks):
            d = r.draft if (self.num_spec and r.draft and len(c) == 1 and r.num_pending == 1) else []
            if d and (r.num_ids + len(d) >= self.max_model_len
                      or not pools.can_grow(r.seq, r.seq.num_tokens + 1 + len(d))):
                d = []
            drafts.append(d)
        tokens = [c + d for c, d in zip(chunks, drafts)]
        seqs = [r.seq for r in reqs]
        starts = [s.num_tokens for s in seqs]
        # logits rows: every verified position of a drafting request, else the last token of a request
        # whose pending tokens are all in this step
        rows, owner = [], []
        off = 0
        for i, (r, t, d) in enumerate(zip(reqs, tokens, drafts)):
            done = len(chunks[i]) == r.num_pending
            if done:
                m = 1 + len(d)
                rows.extend(range(off + len(t) - m, off + len(t)))
                owner.extend([i] * m)
            off += len(t)
        by_req: dict[int, list[int]] = {}
        for j, i in enumerate(owner):
            by_req.setdefault(i, []).append(j)
        if self.overlap is not None and self.overlap.start(reqs, tokens, rows, by_req, drafts, starts):
            return outputs  # launched; processed by the next step (engine/overlap.py)
        picks = None  # every row's argmax, where the runner computes them on the device
        if hasattr(runner, "execute_rows"):  # greedy picks and the non-finite check on the device
            plain_reqs = set(self._plain_requests(reqs, drafts, by_req))
            # plain greedy requests verifying a draft need only their rows' argmax too (_verify_greedy)
            argmax_only = plain_reqs | {i for i in by_req if drafts[i] and _is_plain_greedy(reqs[i].params)}
            out = runner.execute_rows(seqs, tokens, rows,
                                      [j for i, js in by_req.items() if i not in argmax_only for j in js])
            hidden, bad_rows, picks = out.hidden, set(out.bad_rows), out.row_argmax
            logits = _KeptRows(out.logits, out.kept)
            plain = {i: out.row_argmax[by_req[i][0]] for i in plain_reqs if by_req[i][0] not in bad_rows}
        else:  # a runner without it: every row on the host
            logits, hidden = runner.execute(seqs, tokens, rows)
            bad_rows = set(bad_logit_rows(logits))
            plain = self._plain_greedy(reqs, drafts, by_req, bad_rows, logits)
        self.stats.steps += 1
        committed = [len(c) for c in chunks]
        for i, js in by_req.items():
            r, d = reqs[i], drafts[i]
            # one request's failure (non-finite logits, sampling, stop strings, detokenising) ends that request
            # with an error; the engine and the other requests go on
            bad = [j for j in js if j in bad_rows]
            if bad:
                self._fail(r, f"the model produced non-finite logits for this request "
                              f"({describe_bad_row(logits[bad[0]])})", outputs)
                continue
            try:
                if i in plain:  # the batched argmax (the same token _verify would pick)
                    outputs.append(self._append(r, plain[i], None))
                    continue
                if d and picks is not None and _is_plain_greedy(r.params):
                    acc = self._verify_greedy(r, [picks[j] for j in js], d, outputs)
                else:
                    acc = self._verify(r, logits[js], d, outputs)
            except Exception as e:  # noqa: BLE001 - isolate the request, keep the engine alive
                log.exception("request %s failed while sampling / detokenising", r.request_id)
                self._fail(r, f"{type(e).__name__}: {e}", outputs)
                continue
            committed[i] += acc
            if d:
                self.stats.mtp_proposed += len(d)
                self.stats.mtp_accepted += acc
        for r, s0, n in zip(reqs, starts, committed):
            if not r.finished:
                r.seq.num_tokens = s0 + n  # rollback: rejected draft positions are dropped
        if self.drafter is not None:
            # MTP over every committed position (prefill chunks too: its window KV must cover them all)
            items, off = [], 0
            for i, (r, t) in enumerate(zip(reqs, tokens)):
                n = committed[i] if not r.finished else 0
                items.append((r, starts[i], n, torch.arange(off, off + n)))
                off += len(t)
            for i, ((r, *_), res) in enumerate(zip(items, self.drafter.catch_up(items, hidden))):
                keep = res is not None and i in by_req  # a draft only after a sampled token
                r.draft, r.draft_probs = ([res[0]], res[1]) if keep else ([], None)
        for r, c in zip(reqs, chunks):
            if not r.finished:
                if self.prefix_cache is not None and len(c) > 1:
                    self.prefix_cache.cache_unfinished(r)  # prompt chunks become shareable at once
                pools.trim(r.seq)
        return outputs

    def _take_aborted(self) -> list[RequestOutput]:
        """Final outputs of the requests the engine aborted with an error since the last step (and forget them)."""
        outs = [self._output(r, [], "") for r in list(self.requests.values()) if r.status == Status.ABORTED and r.error]
        for o in outs:
            self.requests.pop(o.request_id, None)
        return outs

    @staticmethod
    def _plain_requests(reqs, drafts, by_req) -> list[int]:
        """Indices of the requests whose next token is the argmax of their one logits row: greedy, no penalties,
        no logprobs, no draft to verify."""
        return [i for i, js in by_req.items() if len(js) == 1 and not drafts[i] and _is_plain_greedy(reqs[i].params)]

    @staticmethod
    def _plain_greedy(reqs, drafts, by_req, bad_rows, logits) -> dict[int, int]:
        """{request index: token} for the requests whose next token is the argmax of their one logits row:
        greedy, no penalties, no logprobs, no draft to verify. One batched argmax instead of a sampler call per
        request (at a vocabulary of 129280 the per-request path cost ~1 ms of host time each)."""
        pick = [i for i in LLMEngine._plain_requests(reqs, drafts, by_req) if by_req[i][0] not in bad_rows]
        if not pick:
            return {}
        rows = torch.tensor([by_req[i][0] for i in pick])
        # torch.argmax returns the first maximal index: ties go to the lowest token id, as in Sampler.sample
        return dict(zip(pick, torch.argmax(logits[rows], dim=-1).tolist()))

    def _verify(self, r: Request, lg: torch.Tensor, draft: list[int], outputs: list) -> int:
        """Sample the next token(s) of ``r`` from its logits rows (row j follows the j-th verified token);
        returns how many draft tokens were accepted."""
        accepted = 0
        for j in range(len(draft) + 1):
            row = apply_penalties(lg[j:j + 1], [r.params], [r.prompt_ids], [r.output_ids])
            if j < len(draft):
                if r.params.greedy:
                    tok = int(torch.argmax(row[0]))
                    ok = tok == draft[j]
                else:
                    p = self.sampler.probs(row, [r.params])[0]
                    ok, tok = rejection_accept(p, r.draft_probs, draft[j], r.generator)
            else:
                tok = int(self.sampler.sample(row, [r.params], [r.generator])[0])
                ok = False
            lp = None
            if r.params.logprobs is not None:
                lp = Sampler.logprobs_of(lg[j:j + 1], torch.tensor([tok]), [r.params.logprobs])[0]
            outputs.append(self._append(r, tok, lp))
            if not ok or r.finished:
                break
            accepted += 1
        return accepted

    def _verify_greedy(self, r: Request, picks: list[int], draft: list[int], outputs: list) -> int:
        """:meth:`_verify` for a plain greedy request (no penalties, no logprobs) from its rows' argmax ``picks``
        (row j follows the j-th verified token): the same tokens without the logits rows on the host."""
        accepted = 0
        for j, tok in enumerate(picks):
            outputs.append(self._append(r, tok, None))
            if j == len(draft) or tok != draft[j] or r.finished:
                break
            accepted += 1
        return accepted

    def _append(self, r: Request, tok: int, lp) -> RequestOutput:
        now = time.monotonic()
        if r.first_token_time is None:
            r.first_token_time = now
            self.stats.ttft.append(now - r.arrival)
        r.last_token_time = now
        r.output_ids.append(tok)
        if lp is not None:
            r.logprobs.append(lp)
        self.stats.generation_tokens += 1
        sp = r.params
        delta = ""
        if (tok == self.tokenizer.eos_token_id and not sp.ignore_eos) or tok in (sp.stop_token_ids or ()):
            r.finish_reason = "stop"
        else:
            delta = self._push_text(r, r.detok.push(tok))
        if r.finish_reason is None and (len(r.output_ids) >= sp.max_tokens or r.num_ids >= self.max_model_len):
            r.finish_reason = "length"
        if r.finish_reason is not None:
            if not r._stop_hit:  # EOS, stop token or length: release the detokenizer tail and held text
                delta += self._push_text(r, r.detok.flush(), final=True)
            self._finish(r)
        return self._output(r, [tok], delta)

    def _push_text(self, r: Request, piece: str, final: bool = False) -> str:
        """Append decoded text, honouring stop strings: text that could begin a stop string is held back."""
        stops = r.params.stop
        if not stops:
            r.text += piece
            return piece
        buf = r._stop_hold + piece
        for s in stops:
            at = buf.find(s)
            if at >= 0:
                out = buf[:at]
                r.text += out
                r._stop_hold = ""
                r._stop_hit = True
                r.finish_reason = "stop"
                return out
        keep = 0 if final else max((len(s) - 1 for s in stops), default=0)
        keep = min(keep, len(buf))
        out = buf[: len(buf) - keep]
        r._stop_hold = buf[len(buf) - keep:]
        r.text += out
        return out

    def _fail(self, r: Request, message: str, outputs: list) -> None:
        """End ``r`` with ``error=message`` (finish_reason "abort"), free its pages, and report it."""
        log.warning("request %s ended with an error: %s", r.request_id, message)
        if not r.finished:
            r.seq.num_tokens = 0  # nothing of this request goes into the prefix cache (its KV may be NaN)
            r.draft, r.draft_probs = [], None
            self.scheduler.abort(r)
            self.stats.aborted += 1
        r.error = message
        self.requests.pop(r.request_id, None)
        outputs.append(self._output(r, [], ""))

    def _finish(self, r: Request) -> None:
        self.scheduler.finish(r)
        self.stats.finished += 1
        if r.first_token_time is not None and len(r.output_ids) > 1:
            self.stats.tpot.append((r.last_token_time - r.first_token_time) / (len(r.output_ids) - 1))
        self.requests.pop(r.request_id, None)

    def _output(self, r: Request, delta_ids: list[int], delta_text: str) -> RequestOutput:
        return RequestOutput(r.request_id, r.prompt, r.prompt_ids, r.output_ids, len(r.output_ids), r.text, delta_ids,
                             delta_text, r.finished, r.finish_reason, r.logprobs, len(r.logprobs), r.num_cached_tokens,
                             r.error)

    def run_to_completion(self, on_output=None) -> None:
        while self.has_unfinished():
            for o in self.step():
                if on_output:
                    on_output(o)


def _is_plain_greedy(p) -> bool:
    return (p.greedy and p.logprobs is None and not p.presence_penalty and not p.frequency_penalty
            and p.repetition_penalty == 1.0)


class _KeptRows:
    """Logits rows by their index among the step's rows when only some rows came to the host
    (:meth:`ModelRunner.execute_rows`): ``kr[j]`` / ``kr[[j, ...]]`` for kept rows j."""

    def __init__(self, logits: torch.Tensor, kept: list[int]):
        self.logits, self.pos = logits, {j: k for k, j in enumerate(kept)}

    def __getitem__(self, js):
        if isinstance(js, int):
            return self.logits[self.pos[js]]
        return self.logits[[self.pos[j] for j in js]]
