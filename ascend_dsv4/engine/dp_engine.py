"""The data-parallel front end: one :class:`LLMEngine` per attention replica, stepped together, requests balanced.

A request goes to the replica that already caches the longest prefix of its prompt (prefix-cache affinity, when
prefix caching is on and some replica has a hit), else to the replica with the fewest outstanding tokens
(prompt tokens not yet computed plus tokens still to generate, over its unfinished requests); ties go to the lower
replica. :meth:`DPEngine.step` runs one step of every replica at once (one thread per replica, see
``executor_dp``): a replica whose engine step sent no forward sends a dummy step, so that every rank of the
expert-parallel group takes part in every step; with speculative decoding the same holds for the MTP forward
(one per step and replica, real or dummy). With CUDA graphs every replica's forward of a step is a graph replay
of one key or every one is eager (``executor_dp.GraphVote``), and so is every MTP forward of a graph step. The
interface is the part of :class:`LLMEngine` that ``LLM`` and the async server use.
"""

from __future__ import annotations

import dataclasses
import types
from concurrent.futures import ThreadPoolExecutor

from ..errors import RequestError
from .engine import EngineStats, LLMEngine
from .request import Request, RequestOutput


class DPEngine:
    def __init__(self, engines: list[LLMEngine], executor):
        self.engines, self.executor = engines, executor
        self.tokenizer, self.cfg = engines[0].tokenizer, engines[0].cfg
        self.max_model_len = engines[0].max_model_len
        self.owner: dict[str, int] = {}  # request id -> replica
        self._pool = ThreadPoolExecutor(len(engines), thread_name_prefix="ascend-dsv4-dp")
        self._ids = 0
        # graph steps: every replica replays one key or none does (executor_dp.GraphVote)
        self.vote = self.draft_vote = None
        runners = [e.runner for e in engines]
        if all(getattr(r, "graphs", None) is not None for r in runners):
            from .executor_dp import GraphVote

            timeout = float(getattr(executor.spec, "timeout_s", 300.0))
            self.vote, self.draft_vote = GraphVote(len(runners), timeout), GraphVote(len(runners), timeout)
            for r in runners:
                r.vote, r.draft_vote = self.vote, self.draft_vote

    # ---- requests ----------------------------------------------------------------------------------------
    def make_request(self, prompt, params=None, request_id: str | None = None) -> Request:
        if request_id is None:
            request_id = f"req-{self._ids}"
            self._ids += 1
        return self.engines[0].make_request(prompt, params, request_id)

    @staticmethod
    def outstanding(engine: LLMEngine) -> int:
        """Tokens a replica still has to compute: pending prompt tokens + tokens left to generate."""
        return sum(r.num_pending + max(0, r.params.max_tokens - len(r.output_ids))
                   for r in engine.requests.values() if not r.finished)

    def pick(self, req: Request) -> int:
        """The replica for ``req``: longest cached prefix if any replica has one, else least outstanding tokens."""
        hits = []
        for d, e in enumerate(self.engines):
            pc = e.prefix_cache
            hits.append(pc.radix.match_prefix(req.all_ids[:-1]).length if pc is not None else 0)
        if max(hits) > 0:
            return hits.index(max(hits))
        loads = [self.outstanding(e) for e in self.engines]
        return loads.index(min(loads))

    def enqueue(self, req: Request) -> str:
        if req.request_id in self.owner:
            raise RequestError(f"request id {req.request_id!r} is already in use")
        d = self.pick(req)
        self.engines[d].enqueue(req)
        self.owner[req.request_id] = d
        return req.request_id

    def add_request(self, prompt, params=None, request_id: str | None = None) -> str:
        return self.enqueue(self.make_request(prompt, params, request_id))

    def abort_request(self, request_id: str) -> bool:
        d = self.owner.pop(request_id, None)
        return False if d is None else self.engines[d].abort_request(request_id)

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.engines)

    # ---- stepping ------------------------------------------------------------------------------------------
    def _replica_step(self, d: int) -> list[RequestOutput]:
        e = self.engines[d]
        runner = e.runner
        before, drafts_before = runner.calls, runner.draft_calls
        try:
            busy = e.has_unfinished() or e.requests or (e.overlap is not None and e.overlap.inflight is not None)
            outs = e.step() if busy else []  # (a step launched ahead for requests that finished: collected here)
        except BaseException:
            if self.vote is not None and runner.calls == before:  # failed before its forward: release the others
                self.vote.abort()
            if self.draft_vote is not None and runner.draft_calls == drafts_before:  # the same for its MTP forward
                self.draft_vote.abort()
            raise
        if runner.calls == before:  # no forward from this replica in this step: meet the EP collectives
            runner.dummy()
        if e.drafter is not None and runner.draft_calls == drafts_before:  # nor an MTP forward (speculation on)
            runner.dummy_draft()
        return outs

    def step(self) -> list[RequestOutput]:
        """One step of every replica together (outputs of all replicas, replica order)."""
        from .executor_dp import VoteAborted

        check = getattr(self.executor, "check_health", None)
        if check is not None:  # a dead executor says so before any replica meets a vote broken by its failure
            check()
        futures = [self._pool.submit(self._replica_step, d) for d in range(len(self.engines))]
        outputs, errors = [], []
        for f in futures:
            try:
                outputs.extend(f.result())
            except Exception as ex:  # noqa: BLE001 - reported after every thread ended
                errors.append(ex)
        if errors:  # the first failure that is a cause, not a replica released from a vote by it
            raise next((ex for ex in errors if not isinstance(ex, VoteAborted)), errors[0])
        for o in outputs:
            if o.finished:
                self.owner.pop(o.request_id, None)
        return outputs

    def run_to_completion(self, on_output=None) -> None:
        while self.has_unfinished():
            for o in self.step():
                if on_output:
                    on_output(o)

    # ---- metrics --------------------------------------------------------------------------------------------
    @property
    def requests(self) -> dict:
        return {k: v for e in self.engines for k, v in e.requests.items()}

    @property
    def stats(self) -> EngineStats:
        """Counters summed over the replicas (lists concatenated)."""
        out = EngineStats()
        for e in self.engines:
            for f in dataclasses.fields(EngineStats):
                setattr(out, f.name, getattr(out, f.name) + getattr(e.stats, f.name))
        return out

    @property
    def num_waiting(self) -> int:
        return sum(e.num_waiting for e in self.engines)

    @property
    def num_running(self) -> int:
        return sum(e.num_running for e in self.engines)

    @property
    def scheduler(self):
        return types.SimpleNamespace(num_preemptions=sum(e.scheduler.num_preemptions for e in self.engines))

    def kv_usage(self) -> float:
        return max(e.kv_usage() for e in self.engines)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)
