"""One rank of a data-parallel layout (``executor_dp``): join the groups, build its share, serve its replica's calls.

Every rank of every replica is a worker process (the front end holds no model share). Calls (pickled over the
rank's pipe):

- ``("execute", (ids, ctx, rows, keep, full))``: the replica's step: ``model(ids, ctx)`` then
  ``model.logits(hidden, rows)``; the replica's rank 0 answers the float32 CPU logits (``full`` None) or, with
  ``full`` a list of row indices, :func:`~.model_runner.compact_logits` of them (every row's argmax and
  non-finite check made on the device; only rows ``full`` and bad rows in full: at a vocabulary of 129280 a
  greedy batch of 32 would otherwise pickle 16.5 MB of logits through the pipe every step); the others
  ``None``; with ``keep`` (speculative decoding on) the step's hidden states stay on the rank for a following
  ``draft``;
- ``("draft", (ctx, next_ids, rows, k, full))``: MTP module k over rows ``rows`` of the last ``execute``'s hidden
  states (``model.mtp_logits``, speculative decoding); rank 0 answers the draft logits, in full or compact as
  ``execute``;
- ``("graph", (seqs, tokens, key, keep, full))``: the replica's decode step replayed from the captured graph of bucket
  ``key`` (:meth:`ModelRunner.replay_decode`; every replica replays the same key in the same step, see
  ``executor_dp.GraphVote``), answered and kept as ``execute``;
- ``("graph_dummy", key)``: no work for this replica in a graph step: the graph of ``key`` replayed on padding rows
  only, so that the other replicas' collectives inside their graphs meet;
- ``("graph_draft", (seqs, counts, next_ids, rows, key, full))``: ``draft`` replayed from the captured MTP graph of
  ``key`` (:meth:`ModelRunner.replay_draft`; every replica replays the same key in the same step), answered as
  ``draft``; ``("graph_draft_dummy", key)``: that graph on padding rows only (no MTP work for this replica);
- ``("launch", (seqs, tokens, key, src, step))``: async scheduling: the replica's greedy decode step replayed from the
  graph of ``key`` without waiting for it (:meth:`ModelRunner.replay_greedy`: the input ids from ``tokens`` or, with
  ``src``, from rows ``src`` of the rank's last launched step's argmax, on the device); the rank's answer is only
  an acknowledgement; rank 0 starts copying every row's maximum and argmax to the host and keeps the step as
  ``step`` for ``("collect", step)``, which waits for it and answers as a compact ``execute`` (bad rows in full);
- ``("dummy", None)``: no work for this replica in this step: the expert-parallel collectives of one forward on
  zero tokens (:func:`ascend_dsv4.layers.experts.dummy_moe_step`), so that the other replicas' all-to-alls meet;
- ``("dummy_draft", k)``: the same for MTP module k (:func:`ascend_dsv4.layers.experts.dummy_mtp_step`), when
  another replica drafts in this step and this one does not;
- ``("copy_page", args)``: a prefix-cache page copy on this rank's pools;
- ``("stop", None)``.

:func:`apply_dp_call` applies one call; the Ray actors of ``executor_dp_ray`` use it too.

A call that raises reports its traceback and ends the process, so that the other ranks' collectives fail at once.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import pickle
import traceback

import torch

from .executor import RankSpec, restore
from .model_runner import compact_logits


class DPRankState:
    """What a data-parallel rank keeps between calls: the hidden states of its last ``execute`` (for ``draft``), and
    a zero-row tensor of their shape and dtype (the static input a draft graph of an idle replica is built with)."""

    def __init__(self) -> None:
        self.hidden: torch.Tensor | None = None
        self.like: torch.Tensor | None = None
        self.launched: dict = {}  # step -> ModelRunner.PendingStep of a launched step (rank 0, async scheduling)


def apply_dp_call(op: str, args, model, runner, device, leader: bool, state: DPRankState):
    """Apply one call of the data-parallel protocol (the module docstring) on this rank; returns what the rank
    answers (rank 0 of a replica: logits; others None)."""
    from ..layers.experts import dummy_moe_step, dummy_mtp_step

    if op == "execute":
        ids, ctx, rows, keep, full = restore(args, runner.pools, device)
        hidden = model(ids, ctx)
        state.hidden = hidden if keep else None  # kept only while speculation is on (a prefill's can be large)
        state.like = _like(hidden)
        logits = model.logits(hidden, rows)  # on every rank: under TP it gathers the vocabulary shards
        return _answer(logits, full) if leader else None
    if op in ("graph", "graph_dummy"):
        seqs, tokens, key, keep, full = (restore(args, runner.pools, device) if op == "graph"
                                         else ([], [], args, False, None))
        out = runner.replay_decode(seqs, tokens, key)
        if out is None:
            raise _capture_failed("decode", key)
        hidden, logits = out
        state.hidden = hidden if keep else None
        state.like = _like(hidden)
        return _answer(logits, full) if leader and op == "graph" else None
    if op in ("graph_draft", "graph_draft_dummy"):
        if op == "graph_draft":
            seqs, counts, nxt, rows, key, full = restore(args, runner.pools, device)
            hidden = state.hidden[rows] if state.hidden is not None else None
        else:
            seqs, counts, nxt, key, full, hidden = [], [], [], args, None, state.like
        if hidden is None:
            raise RuntimeError(f"{op}: no hidden states kept from a forward on this rank (keep was off)")
        out = runner.replay_draft(seqs, counts, nxt, hidden, key)
        if out is None:
            raise _capture_failed("MTP", key)
        if op == "graph_draft_dummy":
            return None
        out = out[torch.tensor(list(itertools.accumulate(counts)), device=out.device) - 1]  # each sequence's last
        return _answer(out, full) if leader else None
    if op == "draft":
        ctx, nxt, rows, k, full = restore(args, runner.pools, device)
        if state.hidden is None:
            raise RuntimeError("draft: no hidden states kept from an execute call on this rank (keep was off)")
        logits = model.mtp_logits(state.hidden[rows], nxt, ctx, k, ctx.logits_index)
        return _answer(logits, full) if leader else None
    if op == "launch":
        seqs, tokens, key, src, step = restore(args, runner.pools, device)
        out = runner.replay_greedy(seqs, tokens, key, src)
        if out is None:
            raise _capture_failed("decode", key)
        state.hidden, state.like = None, _like(out[0])
        if leader:
            state.launched[step] = runner.pending_step(None, out[1])
        return None
    if op == "collect":
        return tuple(runner.collect(state.launched.pop(args))[:4]) if leader else None
    if op == "dummy":
        dummy_moe_step(model)
        return None
    if op == "dummy_draft":
        dummy_mtp_step(model, args)
        return None
    if op == "copy_page":
        runner.pools.copy_page(*args)
        return None
    raise ValueError(f"unknown call {op!r}")


def _capture_failed(what: str, key) -> RuntimeError:
    return RuntimeError(f"CUDA graph capture of {what} bucket {key} failed on this rank (its log says why); the "
                        f"replicas replay together, so none can fall back alone: run with --enforce-eager")


def _like(hidden: torch.Tensor) -> torch.Tensor:
    """A zero-row tensor of ``hidden``'s row shape and dtype (its own storage: a view would keep a prefill's alive)."""
    return hidden.new_empty((0,) + tuple(hidden.shape[1:]))


def _answer(logits: torch.Tensor, full):
    """A leader's answer to a step: all float32 CPU logits (``full`` None) or their compact form."""
    return logits.float().cpu() if full is None else compact_logits(logits, full)


def graph_trash(runner) -> tuple | None:
    """The pages this rank's graph decoder reserved for padding rows (token, ratio-4, ratio-128 page spaces), or
    None without one: what the front end's page tables must reserve too (``executor_dp.ReplicaRunner``)."""
    return None if runner.graphs is None else tuple(runner.graphs._trash_pages)


def _send(conn, obj) -> None:
    conn.send_bytes(pickle.dumps(obj))


def dp_worker_main(rank: int, spec: RankSpec, port: int, conn) -> None:
    """Process body of global rank ``rank`` of ``spec.data_parallel_size x spec.tensor_parallel_size``."""
    os.environ.update(spec.env)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    import torch.distributed as dist

    import atb_ops

    from parallel.dp_groups import init_dp_parallel
    from parallel.groups import destroy_parallel, set_rank_device

    from .rank_worker import build_rank_runner

    dp, tp = spec.data_parallel_size, spec.tensor_parallel_size
    try:
        device = torch.device("cpu") if spec.device_type == "cpu" else torch.device(spec.device_type, rank)
        set_rank_device(device)
        store = dist.TCPStore("127.0.0.1", port, dp * tp + 1, False,
                              timeout=datetime.timedelta(seconds=spec.timeout_s))
        store.set(f"alive/{rank}", "1")
        state = init_dp_parallel(dp, tp, rank, store=store, device=spec.device_type, backend=spec.comm_backend,
                                 timeout_s=spec.timeout_s)
        model, runner = build_rank_runner(spec, state, device)
        _send(conn, ("ready", {"pid": os.getpid(), "replica": state.dp_rank, "pool_sizes": runner.pools.sizes,
                               "graph_trash": graph_trash(runner),
                               "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}))
    except BaseException:  # noqa: BLE001 - reported to the front end
        _send(conn, ("err", traceback.format_exc()))
        os._exit(1)
    leader = state.tp.rank == 0
    ops = atb_ops.use_backend(spec.backend) if spec.backend else contextlib.nullcontext()
    kept = DPRankState()
    while True:
        try:
            op, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the front end is gone
            break
        if op == "stop":
            break
        try:
            with torch.inference_mode(), ops:
                out = apply_dp_call(op, args, model, runner, device, leader, kept)
            _send(conn, ("ok", out))
        except BaseException:  # noqa: BLE001
            _send(conn, ("err", traceback.format_exc()))
            os._exit(1)
    try:
        destroy_parallel()
    finally:
        os._exit(0)
