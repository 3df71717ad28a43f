"""The data-parallel ``mp`` executor: ``D`` attention replicas of ``T`` ranks each, one worker process per rank.

Design (vLLM's ``--data-parallel-size D --enable-expert-parallel``): global rank ``r`` is rank ``r % T`` of replica
``r // T`` (``parallel/dp_groups.py``): attention, dense layers, shared experts, embedding and head are TP inside a
replica; the routed experts are EP over all ``D x T`` ranks. The front-end process holds no model share: it runs
one :class:`~ascend_dsv4.engine.engine.LLMEngine` per replica (own scheduler, KV page bookkeeping, prefix cache)
on a :class:`ReplicaRunner`, whose pools live on the ``meta`` device (page tables only: the KV lives on the
replica's ranks, which get the same slots). :class:`~ascend_dsv4.engine.dp_engine.DPEngine` steps every replica
together: one thread per replica runs its engine's step, whose forward is sent to the replica's ranks; a replica
with no work sends a *dummy* step instead (its ranks run the expert all-to-alls on zero tokens), so that every
rank meets every EP collective of the step. The lock step is decided by the front end, which sees every
replica, so no "has work" all-reduce between ranks is needed.

Failure: a worker that raises reports its traceback and exits; one that dies closes its pipe; either way the call
raises :class:`ExecutorError` naming the rank, and every rank is stopped (the replicas share the EP collectives,
so one lost rank stops them all); a replica waiting on its ranks stops waiting as soon as another replica's
failure marked the executor down. Speculative decoding (MTP) keeps the lock step per forward kind: every step of
every replica sends one main forward and one MTP forward, each real or a dummy on zero tokens (the MTP module's
experts are EP too). The same front end over Ray actors: ``executor_dp_ray.py``.

CUDA graphs (decode steps, ``engine/cuda_graphs.py``): every rank captures and replays its replica's decode steps, and
a replica's graph holds the expert-parallel collectives in their static form (``layers/experts.py``
``ep_static_gather``: the same shapes on every rank for a given batch bucket). So in each step either every replica
replays a graph of ONE key -- the largest batch bucket and visible-list widths of the replicas' steps -- or every
replica runs eagerly: :class:`GraphVote` takes each replica's proposal (its step's key, None for a step that cannot
replay, or idle) before the forward is sent. An idle replica replays that key on padding rows (``graph_dummy``).
The MTP forwards of speculative decoding vote the same way (a second :class:`GraphVote`, ``draft_vote``) in steps
whose main forwards replayed graphs: every replica replays the MTP graph of one key (``graph_draft``; an idle
replica ``graph_draft_dummy``) or every one drafts eagerly. Async scheduling (``engine/overlap.py``): a replica's
greedy decode step is launched on its ranks (``launch``) and collected a step later (``collect``); the launch takes
the step's vote, and when the vote says eager the synchronous forward or dummy that follows keeps that decision.
The ranks' graph decoders reserve the first page of each page space for padding rows; the front end's
:class:`ReplicaRunner` reserves the same pages in its page tables (checked against what the ranks report).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import multiprocessing as mp
import pickle
import threading
import time
import weakref
from typing import NamedTuple, Sequence

import torch

from .executor import ExecutorError, RankSpec, kill_processes, sanitize
from .model_runner import StepLogits

log = logging.getLogger("ascend_dsv4")


class _ReplicaHidden:
    """Stands for the hidden states of a replica's last ``execute``, which stay on its ranks (``dp_worker``)."""

    def __init__(self, replica: int, step: int):
        self.replica, self.step = replica, step


class _ReplicaPending(NamedTuple):
    """A step launched on a replica's ranks (async scheduling) and not collected yet."""

    n: int  # rows
    step: int  # the replica's forward count at the launch: the ranks keep the step under it


class VoteAborted(ExecutorError):
    """A replica released from a :class:`GraphVote` because another replica failed: a consequence, not the cause
    (``DPEngine.step`` reports the cause when there is one)."""


class GraphVote:
    """Graph or eager, decided once per step for every replica of a data-parallel layout (the module docstring).

    Each replica's step thread calls :meth:`agree` exactly once per step, just before it sends its main forward
    (or its dummy), with its proposal: the key of its step (``CudaGraphDecoder.key``), None (the step cannot replay
    a graph: prefill, a chunk, a batch above the largest bucket) or :data:`IDLE` (no work). When every replica has
    proposed, the step replays graphs -- key: the largest bucket and the widest visible lists among the proposals --
    if no proposal is None and at least one is not idle; else it runs eagerly (None for every replica)."""

    IDLE = "idle"

    def __init__(self, n: int, timeout_s: float):
        self._props: list = [None] * n
        self._decision = None
        self._barrier = threading.Barrier(n, action=self._decide, timeout=timeout_s)

    def agree(self, replica: int, proposal):
        self._props[replica] = proposal
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise VoteAborted(f"replica {replica}: another replica's step failed, or did not reach its forward "
                              f"within the timeout, before this step's graph / eager decision") from None
        return self._decision

    def _decide(self) -> None:
        real = [p for p in self._props if p != self.IDLE]
        if not real or any(p is None for p in real):
            self._decision = None
            return
        widths: dict = {}
        for p in real:
            for r, w in p[1:]:
                widths[r] = max(widths.get(r, 0), w)
        self._decision = (max(p[0] for p in real),) + tuple(sorted(widths.items()))

    def abort(self) -> None:
        """A replica's step failed before proposing: release the others (they raise :class:`ExecutorError`)."""
        self._barrier.abort()


class ReplicaRunner:
    """The runner interface the engine uses (``cfg``, ``pools``, ``has_mtp``, ``execute``, ``execute_rows``,
    ``draft``, ``draft_rows``, ``ops``), for one replica whose model runs on its ranks. ``calls`` counts the main
    forwards sent and ``draft_calls`` the MTP forwards (the DP engine adds a dummy of either kind when a replica's
    engine step sent none)."""

    def __init__(self, executor: "DPExecutor", replica: int, model_on_meta: torch.nn.Module, sizes,
                 graph_trash: tuple | None = None, max_graph_batch: int = 256):
        self.executor, self.replica = executor, replica
        self.cfg = model_on_meta.cfg
        self.device = torch.device("cpu")  # where step inputs are built
        self.backend = None
        self.quant_summary = None
        self.has_mtp = bool(getattr(model_on_meta, "mtp", None))
        self.pools = model_on_meta.make_pools(sizes, model_on_meta.dtype, torch.device("meta"))
        # graph steps (the ranks capture; here only the bucket keys and the reserved padding pages): see GraphVote
        self.graphs = None
        self.vote: GraphVote | None = None  # set by the DP engine when every replica replays graphs
        self.draft_vote: GraphVote | None = None  # the same for the MTP forwards (speculative decoding)
        self._graph_step = False  # this step's main forward replayed a graph (every replica's did, or none)
        self._decided: tuple | None = None  # (None,): this step's vote, taken by a launch that then ran nothing
        self._last_launch: _ReplicaPending | None = None
        if graph_trash is not None:
            from .cuda_graphs import CudaGraphDecoder

            self.graphs = CudaGraphDecoder(model_on_meta, self.pools, max_graph_batch)
            if tuple(self.graphs._trash_pages) != tuple(graph_trash):
                raise ExecutorError(f"replica {replica}: the ranks reserved pages {tuple(graph_trash)} for graph "
                                    f"padding, the front end {tuple(self.graphs._trash_pages)}")
        copy_page = self.pools.copy_page

        def mirrored_copy(*args):
            copy_page(*args)
            executor.call(replica, "copy_page", args)

        self.pools.copy_page = mirrored_copy
        self.calls = 0
        self.draft_calls = 0
        self.keep_hidden = False  # set by the front end when speculative decoding is on (draft reads them)
        self.max_model_len: int | None = None
        self.max_num_batched_tokens: int | None = None

    def ops(self):
        import contextlib

        return contextlib.nullcontext()

    def execute(self, seqs, tokens: Sequence[Sequence[int]], rows: Sequence[int]):
        """As :meth:`ModelRunner.execute`; ``hidden`` is a handle: the hidden states stay on the replica's ranks,
        where :meth:`draft` uses them. A graph step when every replica's step can replay one (:class:`GraphVote`)."""
        return self._step(seqs, tokens, rows, None)

    def execute_rows(self, seqs, tokens: Sequence[Sequence[int]], rows: Sequence[int], full_rows: Sequence[int]):
        """As :meth:`ModelRunner.execute_rows`: the replica's rank 0 makes every row's argmax and non-finite check
        on its device and sends back only rows ``full_rows`` and the bad rows in full (``dp_worker``)."""
        logits, hidden = self._step(seqs, tokens, rows, list(full_rows))
        return StepLogits(*logits, hidden)

    def _agree(self, proposal):
        """This step's graph key (None: eager) -- the vote's decision, or the one a launch already took."""
        if self._decided is not None:
            key, self._decided = self._decided[0], None
            return key
        return self.vote.agree(self.replica, proposal) if self.vote is not None else None

    def _step(self, seqs, tokens, rows, full):
        key = self._agree(self.graphs.key(seqs, tokens, rows) if self.vote is not None else None)
        self._graph_step = key is not None
        for s, t in zip(seqs, tokens):
            self.pools.ensure(s, s.num_tokens + len(t))
        if key is not None:
            self.calls += 1
            logits = self.executor.call(self.replica, "graph", (list(seqs), [list(t) for t in tokens], key,
                                                                self.keep_hidden, full))
            return logits, _ReplicaHidden(self.replica, self.calls)
        ctx = self.pools.build_context(list(seqs), [len(t) for t in tokens], "none", self.device)
        ids = torch.tensor([x for t in tokens for x in t], dtype=torch.long)
        self.calls += 1
        logits = self.executor.call(self.replica, "execute", (ids, ctx, torch.tensor(list(rows), dtype=torch.long),
                                                              self.keep_hidden, full))
        return logits, _ReplicaHidden(self.replica, self.calls)

    def draft(self, seqs, counts: Sequence[int], next_ids: Sequence[int], hidden, rows: torch.Tensor,
              k: int = 0, on_device: bool = False) -> torch.Tensor:
        """As :meth:`ModelRunner.draft`, on the replica's ranks; ``hidden`` must be the handle of this replica's
        last :meth:`execute`. The logits come back on the CPU whatever ``on_device`` asks (they cross processes)."""
        return self._draft(seqs, counts, next_ids, hidden, rows, k, None)

    def draft_rows(self, seqs, counts: Sequence[int], next_ids: Sequence[int], hidden, rows: torch.Tensor,
                   full_rows: Sequence[int], k: int = 0) -> StepLogits:
        """As :meth:`ModelRunner.draft_rows`: only rows ``full_rows`` and bad rows cross the pipe in full."""
        return StepLogits(*self._draft(seqs, counts, next_ids, hidden, rows, k, list(full_rows)), None)

    def _draft(self, seqs, counts, next_ids, hidden, rows, k, full):
        if not isinstance(hidden, _ReplicaHidden) or hidden.replica != self.replica or hidden.step != self.calls:
            raise ValueError(f"replica {self.replica}: draft needs the hidden states of this replica's last execute")
        if not self.keep_hidden:
            raise ValueError(f"replica {self.replica}: draft without keep_hidden (the ranks did not keep the hidden "
                             f"states; LLM sets it when num_speculative_tokens > 0)")
        key = None
        if self.draft_vote is not None:  # a draft graph only in a step whose main forwards replayed graphs
            dk = self.graphs.draft_key(seqs, counts, k) if self._graph_step else None
            key = self.draft_vote.agree(self.replica, None if dk is None else dk[2:])
        rows = torch.as_tensor(rows, dtype=torch.long)
        self.draft_calls += 1
        if key is not None:
            return self.executor.call(self.replica, "graph_draft", (list(seqs), list(counts), list(next_ids), rows,
                                                                    ("mtp", k) + key, full))
        ctx = self.pools.build_context(list(seqs), list(counts), "last", self.device)
        nxt = torch.tensor(list(next_ids), dtype=torch.long)
        return self.executor.call(self.replica, "draft", (ctx, nxt, rows, k, full))

    def launch_greedy(self, seqs, tokens=None, after=None, after_rows=None):
        """Async scheduling (:meth:`ModelRunner.launch_greedy`): a pure greedy decode step sent to the replica's
        ranks (``launch``) without waiting for it; ``after``: the input ids are that step's argmax rows
        ``after_rows``, taken on the ranks' devices. Only where every replica replays graphs, and only when this
        step's vote (taken here) gives a graph key; when it gives eager, None, and the synchronous forward or the
        dummy that follows in this step keeps that decision instead of voting again."""
        n = len(seqs)
        src = list(range(n)) if after_rows is None else list(after_rows)
        if self.vote is None or n == 0 or (after is not None and (after is not self._last_launch or len(src) != n
                                                                 or max(src) >= after.n)):
            return None
        tok = [[0]] * n if after is not None else [list(t) for t in tokens]
        key = self.vote.agree(self.replica, self.graphs.key(seqs, tok, list(range(n))))
        if key is None:
            self._decided = (None,)
            return None
        self._graph_step = True
        for s in seqs:
            self.pools.ensure(s, s.num_tokens + 1)
        self.calls += 1
        self.executor.call(self.replica, "launch", (list(seqs), tok, key, None if after is None else src,
                                                    self.calls))
        self._last_launch = _ReplicaPending(n, self.calls)
        return self._last_launch

    def collect(self, p: "_ReplicaPending") -> StepLogits:
        """Wait for a launched step: every row's argmax, bad rows in full (``collect`` on the ranks)."""
        return StepLogits(*self.executor.call(self.replica, "collect", p.step), _ReplicaHidden(self.replica, p.step))

    def dummy(self) -> None:
        key = self._agree(GraphVote.IDLE)
        self._graph_step = key is not None
        self.calls += 1
        if key is not None:
            self.executor.call(self.replica, "graph_dummy", key)
        else:
            self.executor.call(self.replica, "dummy", None)

    def dummy_draft(self, k: int = 0) -> None:
        key = None
        if self.draft_vote is not None:
            key = self.draft_vote.agree(self.replica, GraphVote.IDLE if self._graph_step else None)
        self.draft_calls += 1
        if key is not None:
            self.executor.call(self.replica, "graph_draft_dummy", ("mtp", k) + key)
        else:
            self.executor.call(self.replica, "dummy_draft", k)

    def new_sequence(self):
        from ..kv.blocks import SeqBlocks

        return SeqBlocks()

    def release(self, seq) -> None:
        self.pools.free(seq)


def replica_runners(executor, meta: torch.nn.Module, sizes) -> list[ReplicaRunner]:
    """One :class:`ReplicaRunner` per replica; with graph steps where every rank has a graph decoder (its ready
    report's ``graph_trash``: the pages it reserved for padding rows)."""
    trash = [info.get("graph_trash") for info in executor.ready_info]
    graphs = bool(executor.spec.cuda_graphs) and all(t is not None for t in trash)
    if graphs and any(tuple(t) != tuple(trash[0]) for t in trash):
        raise ExecutorError(f"the ranks reserved different pages for graph padding: {[tuple(t) for t in trash]}")
    if executor.spec.cuda_graphs and not graphs:
        log.info("data parallelism: not every rank can capture decode steps (a model or backend without graph "
                 "decode); every step runs eagerly")
    return [ReplicaRunner(executor, d, meta, sizes, tuple(trash[0]) if graphs else None,
                          executor.spec.max_graph_batch) for d in range(executor.dp)]


class DPExecutor:
    def __init__(self, spec: RankSpec):
        self.spec = spec
        self.dp, self.tp = spec.data_parallel_size, spec.tensor_parallel_size
        self.world = self.dp * self.tp
        self.procs: list = []
        self.conns: list = []
        self.locks: list = []
        self.runners: list[ReplicaRunner] = []
        self.dead: str | None = None
        self.ready_info: list[dict] = []
        self._closed = False

    def start(self) -> "DPExecutor":
        import torch.distributed as dist

        from ..models import build_model
        from .dp_worker import dp_worker_main

        spec = self.spec
        ctx = mp.get_context("spawn")
        # port 0: the store binds a free port itself (a port probed free, closed, then bound can be taken between:
        # seen as EADDRINUSE in the test suite)
        store = dist.TCPStore("127.0.0.1", 0, self.world + 1, True,
                              timeout=datetime.timedelta(seconds=spec.timeout_s), wait_for_workers=False)
        port = store.port
        self._store = store
        for r in range(self.world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=dp_worker_main, args=(r, spec, port, child), daemon=True,
                            name=f"ascend-dsv4-dp-rank{r}")
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
            self.locks.append(threading.Lock())
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().shutdown())
        try:
            self.ready_info = [self._reply(r, "start-up", spec.timeout_s) for r in range(self.world)]
        except BaseException as e:
            err = e if isinstance(e, ExecutorError) else ExecutorError(f"start-up failed: {e}")
            self.shutdown()
            raise err from e
        with torch.device("meta"):
            meta = build_model(spec.cfg, spec.dtype, spec.numerics)
        sizes = self.ready_info[0].get("pool_sizes", spec.pool_sizes)  # as the ranks agreed (memory_sizing.py)
        self.runners = replica_runners(self, meta, sizes)
        log.info("dp executor: %d replicas x %d ranks ready", self.dp, self.tp)
        return self

    def ranks_of(self, replica: int) -> range:
        return range(replica * self.tp, (replica + 1) * self.tp)

    def call(self, replica: int, op: str, args):
        """Send ``op(args)`` to every rank of ``replica`` and wait for them; returns the replica rank 0's answer."""
        self.check_health()
        msg = pickle.dumps((op, sanitize(args)))
        ranks = self.ranks_of(replica)
        try:
            for r in ranks:
                self.conns[r].send_bytes(msg)
        except (BrokenPipeError, OSError) as e:
            raise self._die(ExecutorError(f"replica {replica}: could not send {op}: {e}"))
        out = [self._reply(r, op, self.spec.timeout_s) for r in ranks]
        return out[0]

    def _reply(self, rank: int, what: str, timeout: float):
        conn, proc = self.conns[rank], self.procs[rank]
        deadline = time.monotonic() + timeout
        while not conn.poll(0.05):
            if self.dead:
                raise ExecutorError(f"the dp executor is down ({self.dead})")
            if not proc.is_alive() and not conn.poll(0):
                raise self._die(ExecutorError(f"worker rank {rank} died (exit code {proc.exitcode}) during {what}"))
            if time.monotonic() > deadline:
                raise self._die(ExecutorError(f"worker rank {rank} did not answer within {timeout:.0f} s during "
                                              f"{what}"))
        try:
            kind, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            raise self._die(ExecutorError(f"worker rank {rank} closed its pipe during {what} (exit code "
                                          f"{proc.exitcode})"))
        if kind == "err":
            last = payload.strip().splitlines()[-1] if payload.strip() else "?"
            log.error("worker rank %d failed during %s:\n%s", rank, what, payload)
            raise self._die(ExecutorError(f"worker rank {rank} failed during {what}: {last}"))
        return payload

    def _die(self, err: ExecutorError) -> ExecutorError:
        if not self.dead:
            self.dead = str(err)
        self._kill()
        return err

    def check_health(self) -> None:
        if self.dead:
            raise ExecutorError(f"the dp executor is down ({self.dead}); restart the engine")
        for r, p in enumerate(self.procs):
            if not p.is_alive():
                raise self._die(ExecutorError(f"worker rank {r} died (exit code {p.exitcode})"))

    def _kill(self) -> None:
        kill_processes(self.procs)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for c in self.conns:
            try:
                c.send_bytes(pickle.dumps(("stop", None)))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 5
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        self._kill()
        for c in self.conns:
            c.close()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]
