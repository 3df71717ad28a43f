"""Model definitions. They compose atb_ops and parallel linears only: no device checks, no kernels."""

from __future__ import annotations

import torch


def model_class(cfg):
    """The model class for a config (by ``cfg.model_type``)."""
    if cfg.model_type == "deepseek_v4":
        from .deepseek_v4 import DeepseekV4Model

        return DeepseekV4Model
    if cfg.model_type == "deepseek_v3":
        from .deepseek_v3 import DeepseekV3Model

        return DeepseekV3Model
    raise ValueError(f"no model for model_type {cfg.model_type!r}")


def build_model(cfg, dtype: torch.dtype, numerics: str = "exact", parallel=None) -> torch.nn.Module:
    """The model (``parallel``: a :class:`parallel.groups.ParallelState` for one rank's share; None = whole)."""
    return model_class(cfg)(cfg, dtype, numerics, parallel) if parallel is not None else model_class(cfg)(cfg, dtype, numerics)
