"""Offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))`` and ``LLM.logits(token_ids)``.

``model`` is a preset name (random weights from ``seed``, e.g. the embedded ``toy-v4``) or a folder with a
``config.json`` and safetensors weights (official or transformers names). Requests run through the paged
KV pools with a small continuous-batching loop: every step packs the decode tokens of running requests and
chunks of pending prompts into one ragged batch of at most ``max_num_batched_tokens`` tokens.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Callable, Sequence

import torch

import atb_ops

from ..config import load_config
from ..engine.kv_pools import PoolSizes
from ..engine.memory_sizing import check_utilization, device_memory, size_pools_for_memory
from ..engine.model_runner import ModelRunner
from ..engine.engine import LLMEngine
from ..engine.request import RequestOutput
from ..engine.sampling import SamplingParams
from ..engine.tokenizer import load_tokenizer
from ..errors import ConfigError, RequestError
from ..models import build_model
from ..models.deepseek_v4 import NUMERICS

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
        raise ConfigError("device 'npu' requested but torch_npu is not installed or sees no NPU")
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
    ):
        if numerics not in NUMERICS:
            raise ConfigError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
        if backend not in (None, "auto") and backend not in atb_ops.BACKENDS:
            raise ConfigError(f"backend must be 'auto' or one of {', '.join(atb_ops.BACKENDS)}, got {backend!r}")
        self.backend = None if backend in (None, "auto") else backend
        self.device = _resolve_device(device, self.backend)
        cfg = load_config(model)
        if config_overrides:
            cfg = cfg.replace(**config_overrides)
        if cfg.model_type == "deepseek_v3" and numerics != "exact":
            raise ConfigError("DeepSeek-V3 models run with numerics='exact' only")
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

        with self._ops():
            folder = model if os.path.isdir(model) else (os.path.dirname(model) if os.path.isfile(model) else None)
            if folder is None:
                from ..weights.random_init import init_random_

                net = init_random_(build_model(cfg, self.dtype, numerics), seed)
            else:
                from ..weights.loader import load_weights
                from ..weights.msmodelslim_loader import is_msmodelslim_folder, load_msmodelslim

                with torch.device("meta"):
                    net = build_model(cfg, self.dtype, numerics)
                if is_msmodelslim_folder(folder):
                    self.quant_summary = load_msmodelslim(net, folder, msmodelslim_path, allow_float_mtp,
                                                          msmodelslim_act_sim, check_weights=not skip_weight_check)
                else:
                    load_weights(net, folder, self.device, dequantize=dequantize, progress=progress,
                                 check_weights=not skip_weight_check)
            net = net.to(self.device).eval()
        self.model = net
        self.folder = folder
        self.tokenizer = load_tokenizer(folder, cfg.bos_token_id, cfg.eos_token_id, cfg.vocab_size)
        sizes = self._pool_sizes(block_size)
        mem = device_memory(self.device) if gpu_memory_utilization is not None else None
        if mem is not None:
            sizes = size_pools_for_memory(net, sizes, self.dtype, gpu_memory_utilization, *mem)
        elif gpu_memory_utilization is not None:
            log.info("gpu_memory_utilization is ignored on %s: the KV pools hold max_num_seqs (%d) sequences of "
                     "max_model_len (%d)", self.device, max_num_seqs, self.max_model_len)
        self.runner = ModelRunner(net, sizes, self.device)
        self.engine = LLMEngine(self.runner, self.tokenizer, self.max_model_len, max_num_seqs, max_num_batched_tokens,
                                enable_prefix_caching=enable_prefix_caching,
                                num_speculative_tokens=num_speculative_tokens)

    # ---- setup ---------------------------------------------------------------------------------------
    def _pool_sizes(self, B: int) -> PoolSizes:
        cfg = self.cfg
        c4_b, c128_b = 16, 2
        if cfg.model_type == "deepseek_v3":  # full attention: every position of every sequence stays cached
            per_seq_tokens = -(-self.max_model_len // B) + 1
        else:  # V4: token pages are trimmed to the window and the open compression blocks
            keep = max(cfg.window_size, 128 if 128 in cfg.compress_ratios else 8) + B
            per_seq_tokens = -(-(keep + self.max_num_batched_tokens) // B) + 1
        return PoolSizes(
            block_size=B, c4_block_size=c4_b, c128_block_size=c128_b,
            num_blocks=self.max_num_seqs * per_seq_tokens + -(-self.max_num_batched_tokens // B),
            num_c4_blocks=self.max_num_seqs * (-(-self.max_model_len // (4 * c4_b)) + 1),
            num_c128_blocks=self.max_num_seqs * (-(-self.max_model_len // (128 * c128_b)) + 1),
        )

    def _ops(self):
        return atb_ops.use_backend(self.backend) if self.backend else contextlib.nullcontext()

    # ---- logits of one sequence ------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int], prefill_len: int | None = None) -> torch.Tensor:
        """Logits [T, vocab] (float32, CPU) at every position of one sequence: the first ``prefill_len``
        tokens (default all) run as one prefill, the rest one decode step at a time."""
        ids = self._check_ids(list(token_ids), "token_ids")
        if not ids:
            raise RequestError("token_ids is empty")
        p = len(ids) if prefill_len is None else prefill_len
        if not isinstance(p, int) or not 1 <= p <= len(ids):
            raise RequestError(f"prefill_len must be an integer in [1, {len(ids)}], got {prefill_len!r}")
        seq = self.runner.new_sequence()
        try:
            with self._ops():
                rows = [self.runner.step([seq], [ids[:p]], logits="all")]
                for t in ids[p:]:
                    rows.append(self.runner.step([seq], [[t]], logits="all"))
        finally:
            self.runner.release(seq)
        return torch.cat(rows).float().cpu()

    # ---- generation ----------------------------------------------------------------------------------
    def _check_ids(self, ids: list[int], what: str) -> list[int]:
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"{what} holds {bad[0]!r}, not a token id in [0, {self.cfg.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"{what} has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                               f"(the prompt must leave room for at least one generated token)")
        return ids

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
            if not ids:
                raise RequestError(f"prompt {i} is empty")
            encoded.append((p if isinstance(p, str) else ids, self._check_ids(ids, f"prompt {i}")))
        groups = [[self.engine.add_request(p, _nth(sp, j)) for j in range(sp.n)]
                  for (p, _ids), sp in zip(encoded, params)]
        rids = [r for g in groups for r in g]
        final: dict[str, RequestOutput] = {}
        bar = _progress_bar(use_tqdm, len(groups))
        owner = {r: gi for gi, g in enumerate(groups) for r in g}
        left = [len(g) for g in groups]
        with self._ops():
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
