"""ModelRunner: the model of one rank and everything it needs to run a step.

The runner builds the model of the config's family, loads its weights (or random ones for a preset), sizes and
owns its KV pools, and executes ragged steps under the chosen op backend. The engine (scheduler, sampling,
speculative decoding) and the ``LLM`` facade drive it through this interface only; a multi-process or Ray
executor puts one runner per rank behind the same calls.

What goes in: the step description -- the sequences of the step (:class:`~ascend_dsv4.kv.blocks.SeqBlocks`: page
tables and the number of tokens already computed) and the new token ids of each -- plus the rows whose logits
are wanted. What comes out: float32 logits ``[rows, vocab]`` on the CPU (from rank 0 under tensor parallelism).

=====================================================  ==========================================================
``ModelRunner.create(model, cfg, ...)``                 build, load, size pools (``ModelRunner(model, sizes)``
                                                        wraps an already built model)
``runner.cfg``, ``runner.pools``, ``runner.has_mtp``    the config; the KV pools (:class:`~ascend_dsv4.kv.KVPool`,
                                                        whose page bookkeeping the scheduler uses); MTP present
``runner.execute(seqs, tokens, rows)``                  one forward step -> (logits [len(rows), V], hidden): pages
                                                        are allocated, ``seqs`` are not advanced (the engine
                                                        commits what it accepts); ``hidden`` is an opaque handle
                                                        on this step's hidden states for :meth:`draft`
``runner.draft(seqs, counts, next_ids, hidden, rows)``  the MTP module over committed positions -> draft logits
``runner.execute_rows(seqs, tokens, rows, full)``       execute with every row's argmax and non-finite check on the
                                                        device; only rows ``full`` (and bad ones) copied in full
``runner.draft_rows(..., rows, full)``                  draft, compacted the same way (the MTP drafter uses it)
``runner.launch_greedy(seqs, tokens | after=step)``     a greedy decode step launched without waiting (its input
                                                        ids from the host, or on the device from the argmax of
                                                        the step ``after``); ``runner.collect(step)`` waits
``runner.step(seqs, tokens, logits="last"|"all")``      execute + commit + trim, for one-shot callers
``runner.graphs``                                       captured CUDA-graph decode steps (engine/cuda_graphs.py): a
                                                        pure decode step uploads compact inputs and replays
``runner.last_prepare_s``                               host seconds of the last step before its launch
``runner.new_sequence()``, ``runner.release(seq)``      page tables of a new sequence; free its pages
=====================================================  ==========================================================
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from typing import NamedTuple, Sequence

import torch

import atb_ops

from ..errors import ConfigError
from .sampling_guard import bad_rows_of_max
from ..kv.blocks import PoolSizes, SeqBlocks
from ..models import family_of


def plan_pool_sizes(cfg, block_size: int, max_num_seqs: int, max_model_len: int,
                    max_num_batched_tokens: int) -> PoolSizes:
    """Pages for ``max_num_seqs`` sequences of up to ``max_model_len`` tokens with steps of up to
    ``max_num_batched_tokens`` tokens (token pages per sequence from the family's pool layout)."""
    B, c4_b, c128_b = block_size, 16, 2
    per_seq_tokens = family_of(cfg).token_pages_per_sequence(cfg, B, max_model_len, max_num_batched_tokens)
    return PoolSizes(
        block_size=B, c4_block_size=c4_b, c128_block_size=c128_b,
        num_blocks=max_num_seqs * per_seq_tokens + -(-max_num_batched_tokens // B),
        num_c4_blocks=max_num_seqs * (-(-max_model_len // (4 * c4_b)) + 1),
        num_c128_blocks=max_num_seqs * (-(-max_model_len // (128 * c128_b)) + 1),
    )


def build_model(model: str, cfg, dtype: torch.dtype, device: torch.device, numerics: str = "exact", seed: int = 0,
                dequantize: bool = False, progress: bool = True, msmodelslim_path: str = "int",
                allow_float_mtp: bool = False, msmodelslim_act_sim: str | None = None, check_weights: bool = True,
                npu: bool = False) -> tuple[torch.nn.Module, dict | None]:
    """The model of ``cfg`` on ``device`` in eval mode, with the weights of the folder ``model`` (safetensors or
    msModelSlim) or random ones from ``seed`` for a preset; and the msModelSlim summary (None otherwise).

    ``check_weights``: every tensor is checked for NaN / Inf as it lands (:mod:`ascend_dsv4.weights.weight_check`).
    ``npu`` (the NPU backend runs the model): Atlas A2/A3 have no FP8/FP4 matmul, so official FP8/FP4 weights are
    dequantised at load (tensor by tensor), and msModelSlim int-path linears get their NPU parameter form."""
    family = family_of(cfg)
    folder = model if os.path.isdir(model) else (os.path.dirname(model) if os.path.isfile(model) else None)
    summary = None
    if folder is None:
        from ..weights.random_init import init_random_

        net = init_random_(family.build_model(cfg, dtype, numerics), seed)
    else:
        from ..weights.loader import load_weights
        from ..weights.msmodelslim_loader import is_msmodelslim_folder, load_msmodelslim

        with torch.device("meta"):
            net = family.build_model(cfg, dtype, numerics)
        if is_msmodelslim_folder(folder):
            summary = load_msmodelslim(net, folder, msmodelslim_path, allow_float_mtp, msmodelslim_act_sim,
                                       check_weights=check_weights, npu=npu)
        else:
            load_weights(net, folder, device, dequantize=dequantize or npu, progress=progress,
                         check_weights=check_weights)
    return net.to(device).eval(), summary


class StepLogits(NamedTuple):
    """What :meth:`ModelRunner.execute_rows` returns. ``R`` = number of requested rows."""

    logits: torch.Tensor  # float32 CPU [len(kept), V]: the kept rows' logits, in ``kept`` order
    kept: list[int]  # which of the R rows ``logits`` holds (ascending): the asked ones and every bad one
    row_argmax: list[int]  # [R] first maximal index of every row (the greedy token), computed on the device
    bad_rows: list[int]  # rows holding NaN or +inf, or nothing finite (sampling_guard.bad_logit_rows)
    hidden: object  # as execute's ``hidden``


def compact_logits(logits: torch.Tensor, full_rows: Sequence[int]
                   ) -> tuple[torch.Tensor, list[int], list[int], list[int]]:
    """The host's share of a step's logits [R, V] (any device and float dtype): (float32 CPU logits of the rows
    ``kept`` = ``full_rows`` and every bad row, ascending; ``kept``; every row's first maximal index, the greedy
    token; the bad rows, :func:`~.sampling_guard.bad_rows_of_max`), the reductions made on the logits' device --
    :class:`StepLogits` without ``hidden``. :meth:`ModelRunner.execute_rows` and the data-parallel ranks
    (``dp_worker``, whose answers cross a process pipe) use it."""
    row_max = torch.amax(logits, -1).float()  # amax propagates NaN
    arg = torch.argmax(logits, -1)  # first maximal index, as Sampler.sample's greedy pick
    if logits.shape[-1] <= 1 << 24:  # one device-to-host copy for both: float32 holds such an index exactly
        both = torch.stack((row_max, arg.float())).cpu()
        row_max, arg = both[0], both[1].long()
    else:
        row_max, arg = row_max.cpu(), arg.cpu()
    bad = bad_rows_of_max(row_max)
    kept = sorted(set(full_rows) | set(bad))
    if len(kept) == logits.shape[0]:
        host = logits.float().cpu()
    else:
        host = logits[torch.tensor(kept, dtype=torch.long, device=logits.device)].float().cpu()
    return host, kept, arg.tolist(), bad


class PendingStep(NamedTuple):
    """A greedy decode step launched by :meth:`ModelRunner.launch_greedy` and not yet waited for."""

    n: int  # rows (sequences) of the step
    arg: torch.Tensor  # [n] int64 on the device: every row's argmax (the next step's input ids)
    arg_host: torch.Tensor  # [n] int64 host copy of ``arg`` (pinned on CUDA), valid after ``done``
    max_host: torch.Tensor  # [n] float32 host copy of every row's maximum (NaN / inf: a bad row)
    logits: torch.Tensor  # [n, V] float32 on the device (the bad rows are copied from it)
    hidden: object  # as execute's ``hidden``
    done: object  # torch.cuda.Event recorded after the copies (None off CUDA: the copies were synchronous)


def wo_a_fp8() -> bool:
    """``ASCEND_DSV4_WO_A_FP8``: 1 stores DeepSeek-V4's ``wo_a`` back in FP8 on CUDA where its values are the
    checkpoint's FP8 blocks (H200, scripts/bench_results/h200_session38.txt: the op 1.27-1.55x cuBLAS BF16 at 1-16
    tokens, 0.81x at 32, 0.43x at 64; the FP8 + FP4 decode step 0.02-0.03 ms shorter at batch 1 / 8, 0.01 ms longer
    at 32, 0.07 ms at 64; half wo_a's memory); 0 (default) keeps it BF16. Another value is a ValueError naming the
    variable."""
    v = os.environ.get("ASCEND_DSV4_WO_A_FP8", "0")
    if v not in ("0", "1"):
        raise ValueError(f"ASCEND_DSV4_WO_A_FP8={v!r}: expected 0 or 1")
    return v == "1"


def prepare_weights_for(model: torch.nn.Module, device: torch.device, backend: str | None) -> None:
    """Weight storage for the op backend, once per model (create() and __init__ both ask). On CUDA: BF16 storage
    of the float32-compute linears whose values are BF16 (:func:`parallel.linear.compact_fp32_weights_`: the same
    results, half their bytes), with ``ASCEND_DSV4_WO_A_FP8=1`` FP8 storage of the linears marked ``fp8_compact``
    whose values are FP8 blocks (:func:`parallel.linear.compact_fp8_weights_`: V4's ``wo_a``, half its bytes; faster
    decode at small batches, slower at large ones: off by default, :func:`wo_a_fp8`), then one buffer per group of
    linears that read the same input
    (:func:`parallel.linear.stack_model_linears_`: one GEMM for e.g. the compressor's wkv / wgate, the shared
    expert's w1 / w3, attention's wq_a / wkv)."""
    if device.type == "cuda" and backend in (None, "cuda") and not getattr(model, "_weights_prepared", False):
        from parallel.linear import compact_fp8_weights_, compact_fp32_weights_, stack_model_linears_

        compact_fp32_weights_(model)
        if wo_a_fp8():
            compact_fp8_weights_(model)
        stack_model_linears_(model)
        torch.cuda.empty_cache()  # the replaced copies go back to the device (memory sizing reads its free bytes)
        model._weights_prepared = True


class ModelRunner:
    def __init__(self, model: torch.nn.Module, sizes: PoolSizes, device: torch.device | str = "cpu",
                 kv_dtype: torch.dtype | None = None, backend: str | None = None, quant_summary: dict | None = None,
                 cuda_graphs: bool | str = False, max_graph_batch: int = 256, batch_invariant: bool = False):
        self.model = model
        self.cfg = model.cfg
        self.device = torch.device(device)
        self.backend = backend  # atb_ops backend forced for every step (None: by tensor device)
        self.batch_invariant = batch_invariant  # every step in atb_ops' batch-invariant mode
        self.quant_summary = quant_summary
        # the KV layout the op backend's attention ops need (atb_ops.KVLayout; reference layout by default)
        self.kv_layout = atb_ops.kv_layout(backend, self.device)
        prepare_weights_for(model, self.device, backend)
        mult = self.kv_layout.block_size_multiple
        if sizes.block_size % mult:
            raise ConfigError(f"block_size {sizes.block_size} is not a multiple of {mult}, which the "
                              f"{backend or self.device.type} backend's KV layout needs ({self.kv_layout.why})")
        self.pools = model.make_pools(sizes, kv_dtype or model.dtype, self.device, layout=self.kv_layout)
        self.max_model_len: int | None = None  # limits the pools were sized for (set by create)
        self.max_num_batched_tokens: int | None = None
        # captured decode steps (CUDA, DeepSeek-V4 pools, Triton kernels: the reference ops synchronise with the
        # host and cannot be captured), see engine/cuda_graphs.py
        # (cuda_graphs="static": the same static-buffer decode path off CUDA, run without capture -- tests)
        self.graphs = None
        self.last_prepare_s = 0.0  # host time of the last step's preparation (pages, context / static inputs)
        self._prepare_t0: float | None = None  # start of the graph step being prepared (rank 0's decode_graph)
        # set by a multi-rank executor: graph steps are mirrored to every rank (replay_decode, replay_draft,
        # replay_greedy: the other ranks replay the same graph)
        self.mirrored = False
        self._greedy_arg: torch.Tensor | None = None  # argmax of the last launch_greedy step (replay_greedy)
        if (cuda_graphs and (self.device.type == "cuda" or cuda_graphs == "static")
                and hasattr(self.pools, "csa_layers") and backend in (None, "cuda")):
            from .cuda_graphs import CudaGraphDecoder

            self.graphs = CudaGraphDecoder(model, self.pools, max_graph_batch)

    @classmethod
    def create(cls, model: str, cfg, *, device: torch.device, dtype: torch.dtype, numerics: str = "exact",
               backend: str | None = None, block_size: int = 16, max_num_seqs: int = 8, max_model_len: int,
               max_num_batched_tokens: int = 512, gpu_memory_utilization: float | None = None,
               cuda_graphs: bool = False, batch_invariant: bool = False, **load) -> "ModelRunner":
        """Build and load the model (``load``: the keyword arguments of :func:`build_model`) and size its pools
        (``gpu_memory_utilization``: from the device's free memory, :mod:`.memory_sizing`); ``cuda_graphs``:
        capture decode steps on CUDA (``enforce_eager`` turns this off)."""
        runner_ops = atb_ops.use_backend(backend) if backend else contextlib.nullcontext()
        npu = backend == "npu" or (backend is None and torch.device(device).type == "npu")
        with runner_ops:
            net, summary = build_model(model, cfg, dtype, device, numerics, npu=npu, **load)
        prepare_weights_for(net, torch.device(device), backend)  # before the pools are sized
        sizes = plan_pool_sizes(cfg, block_size, max_num_seqs, max_model_len, max_num_batched_tokens)
        if gpu_memory_utilization is not None:
            from .memory_sizing import sized_for_memory

            sizes = sized_for_memory(net, sizes, dtype, gpu_memory_utilization, torch.device(device), max_num_seqs,
                                     max_model_len)
        runner = cls(net, sizes, device, backend=backend, quant_summary=summary, cuda_graphs=cuda_graphs,
                     max_graph_batch=max_num_seqs, batch_invariant=batch_invariant)
        runner.max_model_len, runner.max_num_batched_tokens = max_model_len, max_num_batched_tokens
        return runner

    # ---- properties the engine asks -----------------------------------------------------------------
    @property
    def has_mtp(self) -> bool:
        return bool(getattr(self.model, "mtp", None))

    def ops(self):
        """The op-backend context every step runs under (and batch-invariant mode when asked)."""
        stack = contextlib.ExitStack()
        if self.backend:
            stack.enter_context(atb_ops.use_backend(self.backend))
        if self.batch_invariant:
            stack.enter_context(atb_ops.batch_invariant())
        return stack

    # ---- sequences -----------------------------------------------------------------------------------
    def new_sequence(self) -> SeqBlocks:
        return SeqBlocks()

    def release(self, seq: SeqBlocks) -> None:
        self.pools.free(seq)

    # ---- steps ---------------------------------------------------------------------------------------
    def prepare(self, seqs: Sequence[SeqBlocks], tokens: Sequence[Sequence[int]], logits: str = "last"):
        """Allocate the pages of the new tokens; (input ids [T], step context)."""
        t0 = time.perf_counter()
        for s, t in zip(seqs, tokens):
            self.pools.ensure(s, s.num_tokens + len(t))
        ctx = self.pools.build_context(list(seqs), [len(t) for t in tokens], logits, self.device)
        ids = torch.tensor([x for t in tokens for x in t], dtype=torch.long, device=self.device)
        self.last_prepare_s = time.perf_counter() - t0
        return ids, ctx

    def commit(self, seqs: Sequence[SeqBlocks], ctx) -> None:
        """Advance every sequence over its new tokens and free pages no later query can read."""
        self._advance(seqs, ctx.query_lens)

    def _advance(self, seqs: Sequence[SeqBlocks], lens: Sequence[int]) -> None:
        for s, n in zip(seqs, lens):
            s.num_tokens += n
            self.pools.trim(s)

    def forward(self, ids: torch.Tensor, ctx, rows: Sequence[int]):
        """(streams, float32 logits of token rows ``rows``) of the eager model."""
        streams = self.model(ids, ctx)
        return streams, self.model.logits(streams, torch.tensor(list(rows), dtype=torch.long, device=ids.device))

    def decode_graph(self, seqs: Sequence[SeqBlocks], tokens: Sequence[Sequence[int]], rows: Sequence[int]):
        """(streams, float32 logits [T, vocab]) of a decode step -- one new token a sequence, or a few (an MTP
        verification step), every token's logits -- replayed from a captured CUDA graph (pages allocated here; the
        step context is derived on the device inside the graph), or None when the step must run eagerly (no
        graphs, a step of another shape, or its bucket could not be captured). ``last_prepare_s``: the host time
        from the call to the graph's launch."""
        g = self.graphs
        key = g.key(seqs, tokens, rows) if g is not None else None
        if key is None:
            return None
        t0 = time.perf_counter()
        for s, t in zip(seqs, tokens):
            self.pools.ensure(s, s.num_tokens + len(t))
        self._prepare_t0 = t0
        return self.replay_decode(seqs, tokens, key)

    def replay_decode(self, seqs: Sequence[SeqBlocks], tokens: Sequence[Sequence[int]], key):
        """Stage a decode step whose pages are allocated and replay the graph of bucket ``key`` (captured on first
        use); None when that bucket could not be captured. Under tensor / expert parallelism the executor runs
        this on every rank (the captured collectives meet), the pages having been allocated by rank 0."""
        g = self.graphs
        staged = g.stage(seqs, tokens, key)
        if staged is None:
            return None
        if self._prepare_t0 is not None:  # a worker rank replays without preparing: nothing to time
            self.last_prepare_s = time.perf_counter() - self._prepare_t0
            self._prepare_t0 = None
        return g.replay(staged, sum(len(t) for t in tokens))

    @torch.inference_mode()
    def execute(self, seqs: Sequence[SeqBlocks], tokens: Sequence[Sequence[int]], rows: Sequence[int]):
        """Run the new ``tokens[s]`` of every ``seqs[s]`` (KV written, sequences not advanced).

        ``rows``: indices into the concatenated new tokens whose logits are wanted. Returns (float32 CPU logits
        [len(rows), vocab], hidden): ``hidden`` holds this step's hidden states, row ``i`` = new token ``i``,
        for :meth:`draft`."""
        with self.ops():
            hidden, logits = self._run(seqs, tokens, rows)
            return logits.float().cpu(), hidden

    def _run(self, seqs, tokens, rows):
        """(hidden, logits on the device) of one step: a captured CUDA graph for decode steps, else eager."""
        out = self.decode_graph(seqs, tokens, rows)
        if out is None:
            ids, _ctx = self.prepare(seqs, tokens, "none")
            out = self.forward(ids, _ctx, rows)
        return out

    @torch.inference_mode()
    def execute_rows(self, seqs: Sequence[SeqBlocks], tokens: Sequence[Sequence[int]], rows: Sequence[int],
                     full_rows: Sequence[int]) -> StepLogits:
        """:meth:`execute` with the greedy pick and the non-finite check made where the logits are (the device):
        only the rows ``full_rows`` (indices into ``rows``) and the bad rows travel to the host in full; every
        row's argmax and badness come as two small vectors. At a vocabulary of 129280 this saves the engine a
        host copy of 0.5 MB and a host scan per greedy row."""
        with self.ops():
            hidden, logits = self._run(seqs, tokens, rows)
            return StepLogits(*compact_logits(logits, full_rows), hidden)

    @torch.inference_mode()
    def launch_greedy(self, seqs: Sequence[SeqBlocks], tokens: Sequence[Sequence[int]] | None = None,
                      after: PendingStep | None = None, after_rows: Sequence[int] | None = None
                      ) -> PendingStep | None:
        """Launch a pure decode step from its captured graph bucket and return without waiting (async
        scheduling: the host works on the previous step while the device runs this one). Every ``seqs[s]``
        adds one token: ``tokens[s][0]``, or with ``after`` (the step launched last), the argmax of row
        ``after_rows[s]`` (default s) of that step, fed on the device (no host round trip). Every row's argmax and
        maximum start copying to the host at once (:meth:`collect`). None, with nothing launched, when the step
        cannot replay a graph bucket (no graphs, above the largest bucket, capture failed): the caller runs it
        synchronously. Under tensor / expert parallelism :meth:`replay_greedy` runs on every rank."""
        n = len(seqs)
        g = self.graphs
        src = list(range(n)) if after_rows is None else list(after_rows)
        if g is None or n == 0 or (after is not None and (len(src) != n or max(src) >= after.n
                                                          or after.arg is not self._greedy_arg)):
            return None
        tok = [[0]] * n if after is not None else tokens
        rows = list(range(n))
        key = g.key(seqs, tok, rows)
        if key is None:
            return None
        with self.ops():
            t0 = time.perf_counter()
            for s in seqs:
                self.pools.ensure(s, s.num_tokens + 1)
            out = self.replay_greedy(seqs, tok, key, None if after is None else src)
            if out is None:
                return None
            self.last_prepare_s = time.perf_counter() - t0  # through the launch (every rank's, when mirrored)
            return self.pending_step(*out)

    def pending_step(self, hidden, logits: torch.Tensor) -> PendingStep:
        """The :class:`PendingStep` of a step just replayed by :meth:`replay_greedy` (its argmax kept there): every
        row's argmax and maximum start copying to the host without waiting (:meth:`collect` waits). A data-parallel
        rank uses it for the steps it launches (``dp_worker``)."""
        n = logits.shape[0]
        arg = self._greedy_arg
        row_max = torch.amax(logits, -1).float()  # amax propagates NaN
        cuda = arg.device.type == "cuda"
        arg_host = torch.empty(n, dtype=torch.long, pin_memory=cuda)
        max_host = torch.empty(n, dtype=torch.float32, pin_memory=cuda)
        arg_host.copy_(arg, non_blocking=cuda)
        max_host.copy_(row_max, non_blocking=cuda)
        done = None
        if cuda:
            done = torch.cuda.Event()
            done.record()
        return PendingStep(n, arg, arg_host, max_host, logits, hidden, done)

    def replay_greedy(self, seqs: Sequence[SeqBlocks], tokens: Sequence[Sequence[int]], key,
                      src: Sequence[int] | None):
        """The device half of :meth:`launch_greedy` (pages allocated): stage the bucket ``key``, take the input ids
        from ``tokens`` or, with ``src``, from rows ``src`` of this runner's last greedy step's argmax (on the
        device, stream-ordered after the buffer's upload), replay, and keep this step's argmax (the first maximal
        index, as Sampler.sample's greedy pick) for the next. (streams, logits), or None when the bucket could not
        be captured. Mirrored to every rank under tensor / expert parallelism: each rank feeds its own argmax of
        the same all-gathered logits, so every rank's ids agree without a host round trip."""
        g = self.graphs
        staged = g.stage(seqs, tokens, key)
        if staged is None:
            return None
        n = len(seqs)
        if src is not None:
            last = self._greedy_arg
            arg = last if list(src) == list(range(last.shape[0])) else last[torch.tensor(src, device=last.device)]
            staged.inputs.ids[:n].copy_(arg)
        hidden, logits = g.replay(staged, n)
        self._greedy_arg = torch.argmax(logits, -1)
        return hidden, logits

    @torch.inference_mode()
    def collect(self, p: PendingStep) -> StepLogits:
        """Wait for a launched step; its :class:`StepLogits` (every row greedy: only bad rows kept in full)."""
        if p.done is not None:
            p.done.synchronize()
        bad = bad_rows_of_max(p.max_host)
        kept = sorted(bad)
        logits = p.logits[torch.tensor(kept, dtype=torch.long, device=p.logits.device)].float().cpu()
        return StepLogits(logits, kept, p.arg_host.tolist(), bad, p.hidden)

    @torch.inference_mode()
    def draft(self, seqs: Sequence[SeqBlocks], counts: Sequence[int], next_ids: Sequence[int], hidden,
              rows: torch.Tensor, k: int = 0, on_device: bool = False) -> torch.Tensor:
        """MTP draft logits (float32, one row per sequence: its last position; on the CPU, or left on the device
        with ``on_device``: the drafter copies only what it needs) of ``counts[s]`` committed positions of every
        ``seqs[s]`` starting at its ``num_tokens``, given the main model's hidden states ``hidden[rows]`` at those
        positions (from :meth:`execute`) and the true next token of each position; ``k``: which MTP module."""
        with self.ops():
            out = None
            g = self.graphs
            key = g.draft_key(seqs, counts, k) if g is not None else None
            if key is not None:  # every committed position a row of a captured graph (engine/cuda_graphs.py)
                out = self.replay_draft(seqs, counts, next_ids, hidden[rows], key)
                if out is not None:
                    out = out[torch.tensor(list(itertools.accumulate(counts)), device=out.device) - 1]
            if out is None:
                ctx = self.pools.build_context(list(seqs), list(counts), "last", self.device)
                nxt = torch.tensor(list(next_ids), dtype=torch.long, device=self.device)
                out = self.model.mtp_logits(hidden[rows], nxt, ctx, k, ctx.logits_index)
            return out.float() if on_device else out.float().cpu()

    def draft_rows(self, seqs: Sequence[SeqBlocks], counts: Sequence[int], next_ids: Sequence[int], hidden,
                   rows: torch.Tensor, full_rows: Sequence[int], k: int = 0) -> StepLogits:
        """:meth:`draft` with every row's argmax and non-finite check made on the device and only rows
        ``full_rows`` (and bad ones) copied in full (:func:`compact_logits`); ``hidden`` of the result is None."""
        out = self.draft(seqs, counts, next_ids, hidden, rows, k, on_device=True)
        return StepLogits(*compact_logits(out, full_rows), None)

    def replay_draft(self, seqs: Sequence[SeqBlocks], counts: Sequence[int], next_ids: Sequence[int],
                     hidden: torch.Tensor, key):
        """Float32 draft logits [sum(counts), vocab], one row per committed position, of the MTP graph of bucket
        ``key`` (:meth:`CudaGraphDecoder.draft_key`; captured on first use), or None when it could not be
        captured. Mirrored to every rank under tensor / expert parallelism, as :meth:`replay_decode`."""
        g = self.graphs
        staged = g.stage_draft(seqs, counts, next_ids, hidden, key)
        return None if staged is None else g.replay(staged, sum(counts))[1]

    @torch.inference_mode()
    def step(self, seqs: Sequence[SeqBlocks], tokens: Sequence[Sequence[int]], logits: str = "last",
             return_streams: bool = False):
        """Run the new ``tokens[s]`` of every ``seqs[s]`` and advance them; returns float32 logits [rows, vocab]
        (rows per ``logits``: "last" = one per sequence, "all" = every token), and the streams if asked."""
        lens = [len(t) for t in tokens]
        if logits == "last":
            ends = itertools.accumulate(lens)
            rows = [e - 1 for e, n in zip(ends, lens) if n > 0]
        elif logits == "all":
            rows = list(range(sum(lens)))
        else:
            rows = []
        with self.ops():
            graphed = None if return_streams else self.decode_graph(seqs, tokens, rows)
            if graphed is not None:
                streams, out = graphed
            else:
                ids, ctx = self.prepare(seqs, tokens, logits)
                streams, out = self.forward(ids, ctx, rows)
            self._advance(seqs, lens)
        return (out, streams, ctx, ids) if return_streams else out
