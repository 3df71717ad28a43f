"""Async scheduling (vLLM's ``--async-scheduling``): the host works on one decode step while the device runs the next.

In a synchronous engine the device idles while the host turns a step's picks into outputs (detokenising, stop
checks) and prepares the next step. With async scheduling, a greedy decode step N+1 is launched *before* the host
waits for step N: its input ids are step N's argmax, fed on the device (:meth:`ModelRunner.launch_greedy` with
``after``), so the timeline in steady decode is::

    host:    launch N+1 | wait N, append / detokenise / stop-check N | launch N+2 | wait N+1, ...
    device:  ... step N ...| ........ step N+1 ........ | ........ step N+2 ........

A step runs ahead like this when every running request is in it and all of them decode greedily with no
penalties and no logprobs (the token is the argmax, known on the device), nothing waits for admission, no
speculative decoding is on, every sequence has room for one more token, and the step replays a captured graph
bucket; otherwise the engine takes its synchronous step. A request the host finds finished after step N (EOS, a
stop token or string, max_tokens) is already in step N+1: that row's token is dropped (one token of device work
per finished request, as in vLLM). Tokens, texts and finish reasons are those of the synchronous engine: the
tests run both and compare. Under data parallelism each replica's engine does this over its
:class:`~ascend_dsv4.engine.executor_dp.ReplicaRunner` (the step launched on the replica's ranks, collected a step
later).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from .request import Request, Status
from .sampling_guard import describe_bad_row

log = logging.getLogger("ascend_dsv4")


class InFlight(NamedTuple):
    """A launched decode step the host has not processed yet."""

    reqs: list[Request]
    starts: list[int]  # each sequence's num_tokens at launch: the position of its input token
    pending: object  # the runner's PendingStep
    ahead: bool  # launched after another step (the sequences' num_tokens were advanced before its picks were seen)


class AsyncDecode:
    """The async-scheduling half of :class:`~ascend_dsv4.engine.engine.LLMEngine` (which owns one when asked)."""

    def __init__(self, engine):
        self.engine = engine
        self.inflight: InFlight | None = None

    # ---- starting from a synchronous step ------------------------------------------------------------
    def start(self, reqs, tokens, rows, by_req, drafts, starts) -> bool:
        """Launch a scheduled step without waiting, when it is a pure greedy decode step (else False and
        nothing happened: the engine runs it synchronously)."""
        e = self.engine
        n = len(reqs)
        if any(len(t) != 1 for t in tokens) or list(rows) != list(range(n)):
            return False
        if len(e._plain_requests(reqs, drafts, by_req)) != n:
            return False
        pend = e.runner.launch_greedy([r.seq for r in reqs], tokens)
        if pend is None:
            return False
        self.inflight = InFlight(list(reqs), list(starts), pend, False)
        return True

    # ---- steady state --------------------------------------------------------------------------------
    def step(self, outputs: list) -> list:
        """One engine step with a step in flight: launch the next one behind it if possible, then process it."""
        prev, self.inflight = self.inflight, None
        nxt = self._launch_after(prev)
        self._process(prev, nxt, outputs)
        self.inflight = nxt
        return outputs

    def _launch_after(self, prev: InFlight) -> InFlight | None:
        e = self.engine
        sch, pools = e.scheduler, e.runner.pools
        # the rows of prev still running (a request that finished or was aborted after the step before is in prev)
        rows = [i for i, r in enumerate(prev.reqs) if r.status is Status.RUNNING]
        reqs = [prev.reqs[i] for i in rows]
        starts = [prev.starts[i] for i in rows]
        if not reqs or sch.waiting or len(sch.running) != len(reqs):
            return None
        if any(r.num_ids + 2 > e.max_model_len for r in reqs):  # the new position must fit, as in a sync step
            return None
        advanced = []
        ok = True
        for r, s0 in zip(reqs, starts):
            if not pools.can_grow(r.seq, s0 + 2):
                ok = False
                break
            r.seq.num_tokens = s0 + 1  # prev's token is computed; its value stays on the device for now
            advanced.append(r)
            pools.ensure(r.seq, s0 + 2)
        pend = e.runner.launch_greedy([r.seq for r in reqs], after=prev.pending, after_rows=rows) if ok else None
        if pend is None:
            for r, s0 in zip(advanced, starts):
                r.seq.num_tokens = s0
            return None
        return InFlight(reqs, [s0 + 1 for s0 in starts], pend, True)

    def _process(self, prev: InFlight, nxt: InFlight | None, outputs: list) -> None:
        """Wait for ``prev``, then append each request's token as the synchronous step does."""
        e = self.engine
        out = e.runner.collect(prev.pending)
        e.stats.steps += 1
        bad = set(out.bad_rows)
        kept = dict(zip(out.kept, range(len(out.kept))))
        in_next = {id(r) for r in nxt.reqs} if nxt is not None else set()
        for i, (r, s0) in enumerate(zip(prev.reqs, prev.starts)):
            if r.finished:  # aborted, or finished after the step before (this row ran ahead): dropped
                continue
            if id(r) in in_next:
                r.seq.num_tokens = s0  # as the synchronous step sees it until the token is appended
            if i in bad:
                e._fail(r, f"the model produced non-finite logits for this request "
                           f"({describe_bad_row(out.logits[kept[i]])})", outputs)
                continue
            try:
                outputs.append(e._append(r, out.row_argmax[i], None))
            except Exception as ex:  # noqa: BLE001 - isolate the request, keep the engine alive
                log.exception("request %s failed while detokenising", r.request_id)
                e._fail(r, f"{type(ex).__name__}: {ex}", outputs)
                continue
            if not r.finished:
                r.seq.num_tokens = s0 + 1
                e.runner.pools.trim(r.seq)
