"""Model families (one folder each: ``deepseek_v4/``, ``deepseek_v3/``) and their registry.

Models compose :mod:`atb_ops`, :mod:`parallel` linears, :mod:`ascend_dsv4.layers` and :mod:`ascend_dsv4.kv` only:
no device checks, no kernels, nothing of the engine, entrypoints or weights. This package is the only place
that knows which family it is; everything else asks the family record (:mod:`.registry`).
"""

from __future__ import annotations

import torch

from .family import ModelFamily
from .registry import ALL_PRESETS, FAMILIES, family, family_of, from_dict, load_config, preset

__all__ = ["ALL_PRESETS", "FAMILIES", "ModelFamily", "build_model", "family", "family_of", "from_dict",
           "load_config", "preset"]


def build_model(cfg, dtype: torch.dtype, numerics: str = "exact", parallel=None) -> torch.nn.Module:
    """The model of ``cfg``'s family with uninitialised weights (build under ``torch.device("meta")`` to load);
    ``parallel`` (a :class:`parallel.groups.ParallelState`): one rank's share, None: the whole model."""
    return family_of(cfg).build_model(cfg, dtype, numerics, parallel)
