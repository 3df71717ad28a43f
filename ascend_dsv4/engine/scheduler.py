"""Continuous-batching scheduler with a token budget per step.

Every step packs (1) one token for each running request that decodes, (2) chunks of running prefills,
(3) newly admitted waiting requests (first come, first served), up to ``max_num_batched_tokens`` tokens and
``max_num_seqs`` running requests. Admission checks that the KV pools can hold the chunk. When a running
request cannot grow, the most recently admitted other running request is preempted by recompute: its pages
are freed and it goes back to the front of the queue, keeping its generated tokens, which are recomputed as
part of its prompt when it is readmitted.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from .request import Request, Status


class Scheduler:
    def __init__(self, pools, max_num_seqs: int, max_num_batched_tokens: int,
                 on_admit: Callable[[Request], None] | None = None, on_free: Callable[[Request], None] | None = None):
        self.pools = pools
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # hooks for the prefix cache: attach cached pages on admission, keep / release pages on free
        self.on_admit = on_admit
        self.on_free = on_free or (lambda r: self.pools.free(r.seq))

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.release(req)
        req.status, req.finish_reason = Status.ABORTED, "abort"

    def release(self, req: Request) -> None:
        if req.seq.token or req.seq.c4 or req.seq.c128:
            self.on_free(req)
        req.seq.num_tokens = 0

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        self.release(req)
        req.status = Status.FINISHED

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.release(victim)
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def schedule(self) -> list[tuple[Request, int]]:
        """The (request, number of new tokens) pairs of the next step."""
        budget = self.max_num_batched_tokens
        batch: list[tuple[Request, int]] = []
        # running requests: decodes first (one token each), then prefill chunks
        for req in sorted(self.running, key=lambda r: (r.num_pending > 1, r.arrival)):
            if budget == 0 or req not in self.running:
                continue
            n = min(req.num_pending, budget)
            fits = self.pools.can_grow(req.seq, req.seq.num_tokens + n)  # asked once per state of the pools
            while not fits:
                victims = [r for r in self.running if r is not req and r not in [b[0] for b in batch]]
                if not victims:
                    break
                self._preempt(max(victims, key=lambda r: r.arrival))
                fits = self.pools.can_grow(req.seq, req.seq.num_tokens + n)
            if not fits:
                if len(self.running) == 1 and not batch:
                    # alone and still too big for the pools: it can never run
                    self.running.remove(req)
                    self.release(req)
                    req.status, req.finish_reason = Status.ABORTED, "abort"
                    req.error = "request needs more KV cache than the pools hold"
                continue
            self.pools.ensure(req.seq, req.seq.num_tokens + n)
            batch.append((req, n))
            budget -= n
        # admit waiting requests
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if self.on_admit is not None and req.seq.num_tokens == 0:
                self.on_admit(req)
            n = min(req.num_pending, budget)
            if not self.pools.can_grow(req.seq, req.seq.num_tokens + n):
                if not self.running and not batch:
                    self.waiting.popleft()
                    self.release(req)
                    req.status, req.finish_reason = Status.ABORTED, "abort"
                    req.error = "request needs more KV cache than the pools hold"
                    continue
                break
            self.waiting.popleft()
            self.pools.ensure(req.seq, req.seq.num_tokens + n)
            req.status = Status.RUNNING
            self.running.append(req)
            batch.append((req, n))
            budget -= n
        return batch
