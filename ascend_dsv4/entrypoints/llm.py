"""Offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))`` and ``LLM.logits(token_ids)``.

``model`` is a preset name (random weights from ``seed``, e.g. the embedded ``toy-v4``) or a folder with a
``config.json`` and safetensors weights (official or transformers names, or msModelSlim). A thin facade: it
checks the arguments, then hands the model to a :class:`~ascend_dsv4.engine.model_runner.ModelRunner` (build,
load, pools, steps) and requests to an :class:`~ascend_dsv4.engine.engine.LLMEngine` (continuous batching).
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Sequence

import torch

import atb_ops

from ..engine.engine import LLMEngine, async_problem
from ..engine.memory_sizing import check_utilization
from ..engine.model_runner import ModelRunner
from ..engine.prompts import check_prompt_ids
from ..engine.request import RequestOutput
from ..engine.sampling import SamplingParams
from ..engine.tokenizer import load_tokenizer
from ..errors import ConfigError, RequestError
from ..models import FAMILIES, family_of, load_config

NUMERICS = tuple(dict.fromkeys(n for f in FAMILIES.values() for n in f.numerics))  # every family's, in order

log = logging.getLogger("ascend_dsv4")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _resolve_device(device: str | None, backend: str | None) -> torch.device:
    if device is None:
        if backend == "npu":
            device = "npu"
        elif backend == "cuda" or (backend in (None, "auto") and torch.cuda.is_available()):
            device = "cuda"
        else:
            device = "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available on this machine")
    if device.startswith("npu") and not atb_ops.device_available("npu"):
        from atb_ops.npu.emulation import is_installed

        hint = " (the torch_npu CPU emulation is installed: pass device='cpu' to run the NPU backend on it)" \
            if is_installed() else ""
        raise ConfigError(f"device 'npu' requested but torch_npu is not installed or sees no NPU{hint}")
    return torch.device(device)


def _nth(sp: SamplingParams, j: int) -> SamplingParams:
    """The parameters of completion ``j`` of a request asking ``sp.n`` of them: one completion each, and a seeded
    request's completions use seeds ``seed, seed + 1, ...`` (distinct, reproducible)."""
    import dataclasses

    seed = sp.seed if sp.seed is None or j == 0 else (sp.seed + j) % 2**64
    return dataclasses.replace(sp, n=1, seed=seed)


def _progress_bar(use_tqdm: bool, total: int):
    if not use_tqdm or total == 0:
        return None
    import sys

    from tqdm import tqdm

    return tqdm(total=total, unit="prompt", desc="generating", file=sys.stderr, dynamic_ncols=True)


def _check_max_model_len(value, limit: int) -> int:
    """``max_model_len`` as given (None: the model's limit); 0, negative or above the limit is an error."""
    if value is None:
        return limit
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"max_model_len must be a positive integer, got {value!r}")
    if value > limit:
        raise ConfigError(f"max_model_len {value} is above the model's limit (max_position_embeddings = {limit})")
    return value


class LLM:
    def __init__(
        self,
        model: str = "toy-v4",
        backend: str | None = "auto",
        dtype: str | torch.dtype = "auto",
        numerics: str = "exact",
        device: str | None = None,
        seed: int = 0,
        max_model_len: int | None = None,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 512,
        block_size: int = 16,
        config_overrides: dict | None = None,
        dequantize: bool = False,
        progress: bool = True,
        num_speculative_tokens: int = 0,
        enable_prefix_caching: bool = False,
        msmodelslim_path: str = "int",
        allow_float_mtp: bool = False,
        msmodelslim_act_sim: str | None = None,
        skip_weight_check: bool = False,
        gpu_memory_utilization: float | None = None,
        tensor_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        distributed_executor_backend: str | None = None,
        enforce_eager: bool = False,
        batch_invariant: bool = False,
        data_parallel_size: int = 1,
        async_scheduling: bool = False,
    ):
        if numerics not in NUMERICS:
            raise ConfigError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
        if backend not in (None, "auto") and backend not in atb_ops.BACKENDS:
            raise ConfigError(f"backend must be 'auto' or one of {', '.join(atb_ops.BACKENDS)}, got {backend!r}")
        self.backend = None if backend in (None, "auto") else backend
        # every op in its batch-invariant variant: a sequence's logits bitwise independent of the batch
        self.batch_invariant = bool(batch_invariant)
        self.device = _resolve_device(device, self.backend)
        if self.batch_invariant and self.device.type != "cpu":
            # the MoE combine's scatter-add (outside atb_ops) takes its ordered path, process-wide
            atb_ops.enable_batch_invariant_torch(self.device.type)
        cfg = load_config(model)
        if config_overrides:
            cfg = cfg.replace(**config_overrides)
        family = family_of(cfg)
        if numerics not in family.numerics:
            raise ConfigError(f"{family.title} models run with numerics={' or '.join(map(repr, family.numerics))} "
                              f"only, got {numerics!r}")
        self.cfg = cfg
        if isinstance(dtype, torch.dtype):
            self.dtype = dtype
        elif dtype == "auto":
            self.dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        elif dtype in _DTYPES:
            self.dtype = _DTYPES[dtype]
        else:
            raise ConfigError(f"dtype must be 'auto' or one of {', '.join(_DTYPES)}, got {dtype!r}")
        self.max_model_len = _check_max_model_len(max_model_len, cfg.max_position_embeddings)
        if gpu_memory_utilization is not None:
            check_utilization(gpu_memory_utilization)
        if max_num_batched_tokens < 1 or max_num_seqs < 1 or block_size < 1:
            raise ConfigError("max_num_batched_tokens, max_num_seqs and block_size must be positive")
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        # CUDA-graph decode (vLLM's default); enforce_eager turns it off, and so does the batch-invariant mode (its
        # variants are not capture-safe)
        self._cuda_graphs = not (enforce_eager or self.batch_invariant)

        folder = model if os.path.isdir(model) else (os.path.dirname(model) if os.path.isfile(model) else None)
        self.folder = folder
        self.executor = None
        from ..parallel_plan import validate_dp_layout

        validate_dp_layout(cfg, data_parallel_size, tensor_parallel_size, enable_expert_parallel,
                           distributed_executor_backend)
        parallel = (data_parallel_size > 1 or tensor_parallel_size != 1 or enable_expert_parallel
                    or distributed_executor_backend is not None)
        if self.batch_invariant and parallel:
            raise ConfigError("batch_invariant=True is not supported with tensor / expert / data parallelism yet "
                              "(the all-reduce order is not made batch-invariant); run it at world size 1")
        if data_parallel_size > 1:
            if not enable_expert_parallel:
                log.info("data_parallel_size = %d: the routed experts are expert-parallel over all %d ranks "
                         "(enable_expert_parallel implied)", data_parallel_size,
                         data_parallel_size * tensor_parallel_size)
            self._start_dp(model, folder, numerics, seed, dequantize, block_size, data_parallel_size,
                           tensor_parallel_size, distributed_executor_backend, max_num_seqs, max_num_batched_tokens,
                           enable_prefix_caching, num_speculative_tokens, async_scheduling,
                           dict(msmodelslim_path=msmodelslim_path, allow_float_mtp=allow_float_mtp,
                                msmodelslim_act_sim=msmodelslim_act_sim, check_weights=not skip_weight_check,
                                gpu_memory_utilization=gpu_memory_utilization))
            return
        if tensor_parallel_size != 1 or enable_expert_parallel or distributed_executor_backend is not None:
            self.runner = self._start_parallel(model, folder, numerics, seed, dequantize, block_size,
                                               tensor_parallel_size, enable_expert_parallel,
                                               distributed_executor_backend,
                                               dict(msmodelslim_path=msmodelslim_path, allow_float_mtp=allow_float_mtp,
                                                    msmodelslim_act_sim=msmodelslim_act_sim,
                                                    check_weights=not skip_weight_check,
                                                    gpu_memory_utilization=gpu_memory_utilization))
        else:
            self.runner = ModelRunner.create(
                model, cfg, device=self.device, dtype=self.dtype, numerics=numerics, backend=self.backend,
                block_size=block_size, max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
                max_num_batched_tokens=max_num_batched_tokens, seed=seed, dequantize=dequantize, progress=progress,
                msmodelslim_path=msmodelslim_path, allow_float_mtp=allow_float_mtp,
                msmodelslim_act_sim=msmodelslim_act_sim, check_weights=not skip_weight_check,
                gpu_memory_utilization=gpu_memory_utilization, batch_invariant=self.batch_invariant,
                cuda_graphs=self._cuda_graphs)
        self.tokenizer = load_tokenizer(folder, cfg.bos_token_id, cfg.eos_token_id, cfg.vocab_size)
        self.engine = LLMEngine(self.runner, self.tokenizer, self.max_model_len, max_num_seqs, max_num_batched_tokens,
                                enable_prefix_caching=enable_prefix_caching,
                                num_speculative_tokens=num_speculative_tokens, async_scheduling=async_scheduling)

    def _start_parallel(self, model, folder, numerics, seed, dequantize, block_size, tp, ep, executor, msm: dict):
        """Validate the layout (before any weight is read), then start the executor: rank 0 in this process, one
        worker process (``mp``) or Ray actor (``ray``: the cluster at ``$RAY_ADDRESS``, else a local one) per other
        rank; returns rank 0's runner."""
        from parallel.groups import visible_devices

        from ..engine import model_runner
        from ..engine.executor import RankSpec
        from ..engine.executor_mp import MPExecutor
        from ..parallel_plan import validate_layout

        if executor not in (None, "mp", "ray"):
            raise ConfigError(f"distributed_executor_backend must be 'mp' (one process per rank on this node) or "
                              f"'ray' (ranks on a Ray cluster), got {executor!r}")
        local = None if executor == "ray" else visible_devices(self.device.type)  # Ray: devices of many nodes
        validate_layout(self.cfg, tp, ep, visible_devices=local, device=self.device.type,
                        quantized_checkpoint=folder is not None, numerics=numerics)
        sizes = model_runner.plan_pool_sizes(self.cfg, block_size, self.max_num_seqs, self.max_model_len,
                                             self.max_num_batched_tokens)
        spec = RankSpec(model=folder or model, cfg=self.cfg, dtype=self.dtype, numerics=numerics,
                        device_type=self.device.type, seed=seed, pool_sizes=sizes, tensor_parallel_size=tp,
                        enable_expert_parallel=ep, backend=self.backend, dequantize=dequantize, **msm,
                        cuda_graphs=self._cuda_graphs, max_graph_batch=self.max_num_seqs,
                        timeout_s=float(os.environ.get("ASCEND_DSV4_MP_TIMEOUT", "300")),
                        env={k: v for k, v in os.environ.items() if k.startswith(("ASCEND_DSV4_", "ATB_OPS_", "HCCL_"))})
        if executor == "ray":
            from ..engine.executor_ray import RayEngineExecutor

            self.executor = RayEngineExecutor(spec).start()
        else:
            self.executor = MPExecutor(spec).start()
        runner = self.executor.runner
        runner.max_model_len, runner.max_num_batched_tokens = self.max_model_len, self.max_num_batched_tokens
        return runner

    def _start_dp(self, model, folder, numerics, seed, dequantize, block_size, dp, tp, executor, max_num_seqs,
                  max_num_batched_tokens, enable_prefix_caching, num_speculative_tokens, async_scheduling: bool,
                  msm: dict) -> None:
        """Data-parallel attention (``engine/executor_dp.py``): validate, start ``dp x tp`` worker ranks, one
        engine per replica behind a :class:`~ascend_dsv4.engine.dp_engine.DPEngine`."""
        from parallel.groups import visible_devices

        from ..engine import model_runner
        from ..engine.dp_engine import DPEngine
        from ..engine.executor import RankSpec
        from ..engine.executor_dp import DPExecutor
        from ..parallel_plan import validate_dp_layout, validate_layout

        from ..engine.spec_decode import speculation_problem

        problem = speculation_problem(num_speculative_tokens, bool(getattr(self.cfg, "n_mtp_layers", 0)))
        if problem:  # the engine's rules, checked before any worker starts
            raise ConfigError(problem)
        problem = async_problem(async_scheduling, num_speculative_tokens)
        if problem:
            raise ConfigError(problem)
        local = None if executor == "ray" else visible_devices(self.device.type)  # Ray: devices of many nodes
        validate_dp_layout(self.cfg, dp, tp, True, executor, visible_devices=local, device=self.device.type)
        validate_layout(self.cfg, tp, True, quantized_checkpoint=folder is not None, numerics=numerics)
        sizes = model_runner.plan_pool_sizes(self.cfg, block_size, max_num_seqs, self.max_model_len,
                                             max_num_batched_tokens)
        spec = RankSpec(model=folder or model, cfg=self.cfg, dtype=self.dtype, numerics=numerics,
                        device_type=self.device.type, seed=seed, pool_sizes=sizes, tensor_parallel_size=tp,
                        enable_expert_parallel=True, backend=self.backend, dequantize=dequantize, **msm,
                        timeout_s=float(os.environ.get("ASCEND_DSV4_MP_TIMEOUT", "300")), data_parallel_size=dp,
                        cuda_graphs=self._cuda_graphs and self.device.type == "cuda", max_graph_batch=max_num_seqs,
                        env={k: v for k, v in os.environ.items()
                             if k.startswith(("ASCEND_DSV4_", "ATB_OPS_", "HCCL_"))})
        if executor == "ray":
            from ..engine.executor_dp_ray import RayDPExecutor

            self.executor = RayDPExecutor(spec).start()
        else:
            self.executor = DPExecutor(spec).start()
        self.tokenizer = load_tokenizer(folder, self.cfg.bos_token_id, self.cfg.eos_token_id, self.cfg.vocab_size)
        engines = []
        for r in self.executor.runners:
            r.max_model_len, r.max_num_batched_tokens = self.max_model_len, max_num_batched_tokens
            r.keep_hidden = bool(num_speculative_tokens)
            engines.append(LLMEngine(r, self.tokenizer, self.max_model_len, max_num_seqs, max_num_batched_tokens,
                                     enable_prefix_caching=enable_prefix_caching,
                                     num_speculative_tokens=num_speculative_tokens,
                                     async_scheduling=async_scheduling))
        self.runner = self.executor.runners[0]
        self.engine = DPEngine(engines, self.executor)

    def shutdown(self) -> None:
        """Stop the worker processes of a tensor-parallel LLM (no-op at world size 1; idempotent)."""
        if hasattr(self.engine, "shutdown"):  # the data-parallel front end's step threads
            self.engine.shutdown()
        if self.executor is not None:
            self.executor.shutdown()

    def _single_replica(self, what: str) -> None:
        if self.executor is not None and getattr(self.executor, "dp", 1) > 1:
            raise RequestError(f"LLM.{what} is not available with data_parallel_size > 1 (the model lives on the "
                               f"replicas' ranks); use generate")

    @property
    def model(self) -> torch.nn.Module:
        """The runner's model (read-only access for inspection and tests)."""
        self._single_replica("model")
        return self.runner.model

    @property
    def quant_summary(self) -> dict | None:
        """msModelSlim load summary (quantised linears, quant type, bytes per parameter), None otherwise."""
        return self.runner.quant_summary

    def _ops(self):
        return self.runner.ops()

    # ---- logits of one sequence ------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int], prefill_len: int | None = None) -> torch.Tensor:
        """Logits [T, vocab] (float32, CPU) at every position of one sequence: the first ``prefill_len``
        tokens (default all) run as one prefill, the rest one decode step at a time."""
        self._single_replica("logits")
        ids = check_prompt_ids(token_ids, self.cfg.vocab_size, self.max_model_len, "token_ids")
        p = len(ids) if prefill_len is None else prefill_len
        if not isinstance(p, int) or not 1 <= p <= len(ids):
            raise RequestError(f"prefill_len must be an integer in [1, {len(ids)}], got {prefill_len!r}")
        seq = self.runner.new_sequence()
        try:
            rows = [self.runner.step([seq], [ids[:p]], logits="all")]
            for t in ids[p:]:
                rows.append(self.runner.step([seq], [[t]], logits="all"))
        finally:
            self.runner.release(seq)
        return torch.cat(rows).float().cpu()

    # ---- generation ----------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 on_text: Callable[[str, str], None] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a list (strings or token-id lists), batched continuously.

        One :class:`RequestOutput` per prompt, in order; with ``SamplingParams(n=k)`` its ``outputs`` holds ``k``
        completions (a seeded request's completion ``j`` uses seed ``seed + j``). ``on_text(request_id, text)``
        receives decoded text as it is produced (for streaming); ``use_tqdm`` shows a progress bar (stderr) over
        the prompts, as vLLM does."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise RequestError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        encoded = []
        for i, (p, sp) in enumerate(zip(prompts, params)):  # validate everything before queueing anything
            if not isinstance(sp, SamplingParams):
                raise RequestError(f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}")
            sp.validate(self.cfg.vocab_size)
            if isinstance(p, str):
                ids = self.tokenizer.encode(p)
            elif isinstance(p, (list, tuple)):
                ids = list(p)
            else:
                raise RequestError(f"prompt {i} must be a string or a list of token ids, got {type(p).__name__}")
            ids = check_prompt_ids(ids, self.cfg.vocab_size, self.max_model_len, f"prompt {i}")
            encoded.append((p if isinstance(p, str) else ids, ids))
        groups = [[self.engine.add_request(p, _nth(sp, j)) for j in range(sp.n)]
                  for (p, _ids), sp in zip(encoded, params)]
        rids = [r for g in groups for r in g]
        final: dict[str, RequestOutput] = {}
        bar = _progress_bar(use_tqdm, len(groups))
        owner = {r: gi for gi, g in enumerate(groups) for r in g}
        left = [len(g) for g in groups]
        try:
            while len(final) < len(rids) and self.engine.has_unfinished():
                for out in self.engine.step():
                    if on_text and out.delta_text:
                        on_text(out.request_id, out.delta_text)
                    if out.finished:
                        final[out.request_id] = out
                        if out.error:
                            log.warning("request %s aborted by the engine: %s", out.request_id, out.error)
                        gi = owner.get(out.request_id)
                        if gi is not None:
                            left[gi] -= 1
                            if bar is not None and left[gi] == 0:
                                bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            for rid in rids:
                if rid not in final:
                    self.engine.abort_request(rid)
        results = []
        for g in groups:
            first = final[g[0]]
            first.more_outputs = [final[r].as_completion(j) for j, r in enumerate(g) if j]
            results.append(first)
        return results

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: ``messages`` is one conversation (a list of ``{"role", "content"}`` dicts) or a list
        of them; each is rendered with the model's chat template (the folder's ``tokenizer_config.json`` /
        ``chat_template.jinja``, or ``chat_template``: a Jinja2 string or file; else DeepSeek's encoding) and
        generated as :meth:`generate` does. Returns one :class:`RequestOutput` per conversation."""
        from .chat import ChatFormatter

        if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
            conversations = [messages]
        elif isinstance(messages, (list, tuple)) and messages and all(isinstance(m, (list, tuple)) for m in messages):
            conversations = list(messages)
        else:
            raise RequestError("messages must be a list of {'role', 'content'} dicts or a list of such lists")
        fmt = ChatFormatter.from_folder(self.folder, chat_template)
        kw = dict(chat_template_kwargs or {})
        prompts = [fmt.format(c, add_generation_prompt, **kw) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
