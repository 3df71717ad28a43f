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
        batch_invariant: bool = False,
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
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
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
                                                          msmodelslim_act_sim)
                else:
                    load_weights(net, folder, self.device, dequantize=dequantize, progress=progress)
            net = net.to(self.device).eval()
        self.model = net
        self.tokenizer = load_tokenizer(folder, cfg.bos_token_id, cfg.eos_token_id, cfg.vocab_size)
        self.runner = ModelRunner(net, self._pool_sizes(block_size), self.device)
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
        stack = contextlib.ExitStack()
        if self.backend:
            stack.enter_context(atb_ops.use_backend(self.backend))
        if self.batch_invariant:
            stack.enter_context(atb_ops.batch_invariant())
        return stack

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
                 on_text: Callable[[str, str], None] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list (strings or token-id lists), batched continuously.
        ``on_text(request_id, text)`` receives decoded text as it is produced (for streaming)."""
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
        rids = [self.engine.add_request(p, sp) for (p, _ids), sp in zip(encoded, params)]
        final: dict[str, RequestOutput] = {}
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
            finally:
                for rid in rids:
                    if rid not in final:
                        self.engine.abort_request(rid)
        return [final[r] for r in rids]
