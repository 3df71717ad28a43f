"""The model-family record: everything code outside :mod:`ascend_dsv4.models` may need to know about a family.

Engine, runner, loaders, tools and CLI never ask "is this V3 or V4?": they look the family up in the registry
(:func:`ascend_dsv4.models.registry.family_of`) and ask its record. A new family is one folder under
``ascend_dsv4/models/`` with a ``FAMILY`` record and one line in the registry.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch


@dataclass(frozen=True)
class ModelFamily:
    model_type: str  # the HF ``model_type`` of the family's config.json
    title: str  # for messages: "DeepSeek-V4"
    config_class: type
    presets: Mapping[str, Callable[[], Any]]  # preset name -> config factory
    from_hf_dict: Callable[[dict, str], Any]
    from_official_dict: Callable[[dict, str], Any]
    claims_official_dict: Callable[[dict], bool]  # official dicts carry no model_type: is this one ours?
    numerics: tuple[str, ...]  # activation numerics the model supports ("exact", "reference")
    model_module: str  # module holding ``model_class_name`` (imported on first use: it pulls in torch and atb_ops)
    model_class_name: str
    # checkpoint names: checkpoint tensor name -> our parameter name (None: unknown, "": a duplicate to skip),
    # our parameter / module name -> checkpoint name, stacked expert -> per-expert checkpoint name (no ".weight")
    canonical_name: Callable[[str, int], str | None]  # (name, n_layers)
    checkpoint_name: Callable[[str, int], str]  # (ours, n_layers)
    expert_checkpoint_name: Callable[[str, int, str, int], str]  # (module, expert, "w1"|"w2"|"w3", n_layers)
    stored_copies: Callable[[int, int], list[tuple[str, str]]]  # (n_layers, n_mtp) -> [(checkpoint name, ours)]
    quant_linear_re: re.Pattern  # checkpoint linears the msModelSlim recipe quantises (names without .weight)
    routed_expert_re: re.Pattern  # checkpoint names of routed-expert linears (without .weight)
    experts_weight_after_w2: bool  # routing weight applied after w2 (V3, as msModelSlim's fake-quant model does)
    tensor_inventory: Callable[[Any], list]  # the checkpoint's tensors (models.sizing.TensorSpec)
    format_info: Callable[[Any, int, int], str]  # (cfg, context_len, batch) -> the ``info`` report
    checkpoint_formats: tuple[str, ...]  # random-checkpoint layouts, the first is the default
    random_checkpoint: Callable[[Any, str, int], tuple[dict, Iterator[tuple[str, torch.Tensor]]]]
    # token pages one sequence holds at most (pool sizing): V4 trims to the window, V3 keeps every position
    token_pages_per_sequence: Callable[[Any, int, int, int], int]  # (cfg, block_size, max_model_len, max_batched)
    # sizing: checkpoint-format weight bytes; KV bytes one more token adds to our pools at a dtype size;
    # memory_plan(cfg, context_len, batch) -> dict with at least "weights_bytes" and "kv_bytes"
    weights_bytes: Callable[[Any], int]
    kv_pool_bytes_per_token: Callable[[Any, int], float]
    memory_plan: Callable[[Any, int, int], dict]
    needs_custom_ops: bool  # on NPU: needs custom-op packages beyond torch_npu's built-in ops (V4's sparse attention)
    # tensor parallel (ascend_dsv4.parallel_plan): checkpoint names split on dim 0 / dim 1 (others replicated,
    # routed experts by the expert rule), the family's own layout rules (cfg, tp, ep), the shared experts' width
    tp_split_dim0: re.Pattern
    tp_split_dim1: re.Pattern
    validate_tp: Callable[..., None]  # (cfg, tp, ep, quantized_checkpoint=True, numerics="exact")
    shared_expert_inter: Callable[[Any], int]

    def model_class(self) -> type:
        return getattr(importlib.import_module(self.model_module), self.model_class_name)

    def build_model(self, cfg, dtype: torch.dtype, numerics: str = "exact", parallel=None) -> torch.nn.Module:
        if parallel is None:
            return self.model_class()(cfg, dtype, numerics)
        return self.model_class()(cfg, dtype, numerics, parallel)

    def owns(self, cfg) -> bool:
        return isinstance(cfg, self.config_class)
