"""Read msModelSlim (Ascend) quantised checkpoints and compute their linears on any torch device.

Usable without this project's models::

    import quant.msmodelslim as msm
    ckpt = msm.load("out/w8a8")                     # description + weight headers, validated; no tensor data yet
    ckpt.model_quant_type, ckpt.kv_cache_type       # "W8A8", "C8" | None
    ckpt.entries()                                  # [("model.layers.0.self_attn.q_proj", "W8A8"), ...]
    lin = ckpt.linear("model.layers.0.self_attn.q_proj", path="int")   # torch.nn.Module: x [..., k] -> [..., n]
    ckpt.bytes_per_param()                          # stored bytes / logical parameters

Modules:

* :mod:`.description` -- the description JSON (types, global keys);
* :mod:`.weights`     -- finding and lazily reading ``quant_model_weight*.safetensors`` (+ index);
* :mod:`.schemes`     -- per-type tensor layouts; :class:`~.schemes.QuantLinear` (``path="int"|"float"``),
  :class:`~.schemes.AntiOutlierNorm`, :class:`~.schemes.KVCacheQuant`;
* :mod:`.packing`     -- int4 packing (msModelSlim bytes, NPU int32 words);
* :mod:`.npu_params`  -- pure functions preparing NPU op arguments (layouts, offset sign, deq_scale encodings,
  TP quant_bias rule, N > 65535 split);
* :mod:`.validate`    -- description vs weights, per-linear layouts, fused-module types, the MTP layer.

Facts and formulas: ``quant/msmodelslim/README.md`` (§3-§7).
"""

from __future__ import annotations

import difflib
import json
import os
from typing import Optional

from quant.errors import QuantFormatError
from quant.msmodelslim.description import (
    FLOAT,
    KNOWN_TYPES,
    QUANT_LINEAR_TYPES,
    SUPPORTED_TYPES,
    Description,
    parse_description,
    read_description,
)
from quant.msmodelslim.schemes import AntiOutlierNorm, KVCacheQuant, QuantLinear
from quant.msmodelslim.validate import CheckpointLayout, MsModelSlimWarning, metas_from_store, validate
from quant.msmodelslim.weights import WeightStore, find_weight_files


def _num_hidden_layers_from_config(folder: str) -> Optional[int]:
    """``num_hidden_layers`` (or V4-native ``n_layers``) from ``folder/config.json`` (v1 copies it), else None."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    for c in (cfg, cfg.get("text_config") if isinstance(cfg, dict) else None):
        if isinstance(c, dict):
            for key in ("num_hidden_layers", "n_layers"):
                v = c.get(key)
                if isinstance(v, int) and not isinstance(v, bool):
                    return v
    return None


class MsModelSlimCheckpoint:
    """An opened msModelSlim checkpoint (see :func:`load`). Tensor data is read on demand."""

    def __init__(self, folder: str, description: Description, weights: WeightStore, layout: CheckpointLayout,
                 num_hidden_layers: Optional[int] = None):
        self.folder = folder
        self.description = description
        self.weights = weights
        self.layout = layout
        self.num_hidden_layers = num_hidden_layers

    # -- global keys
    @property
    def model_quant_type(self) -> Optional[str]:
        return self.description.model_quant_type

    @property
    def kv_cache_type(self) -> Optional[str]:
        return self.description.kv_cache_type

    @property
    def fa_quant_type(self) -> Optional[str]:
        return self.description.fa_quant_type

    @property
    def indexer_quant_type(self) -> Optional[str]:
        return self.description.indexer_quant_type

    @property
    def version(self) -> Optional[str]:
        return self.description.version

    @property
    def types(self) -> dict[str, str]:
        """Effective tensor key -> type (the description, with allow_float_mtp adjustments)."""
        return self.layout.types

    # -- listing
    def entries(self, quantized_only: bool = False) -> list[tuple[str, str]]:
        """``(name, type)`` of every described linear (2-D weight), name without ``.weight``, in description order.

        ``quantized_only=True`` keeps the quantised ones (types other than FLOAT).
        """
        out = []
        for key, qtype in self.layout.types.items():
            if key.endswith(".weight"):
                name = key[: -len(".weight")]
                if name in self.layout.linears and (not quantized_only or qtype != FLOAT):
                    out.append((name, qtype))
        return out

    def _close(self, name: str, pool) -> str:
        close = difflib.get_close_matches(name, list(pool), n=5, cutoff=0.5)
        return f"; close matches: {', '.join(close)}" if close else ""

    # -- modules
    def linear(self, name: str, path: str = "int", **kwargs) -> QuantLinear:
        """The :class:`~.schemes.QuantLinear` of the described linear ``name`` (``.weight`` suffix optional).

        ``path``: ``"int"`` or ``"float"``; other keyword arguments go to :class:`~.schemes.QuantLinear`
        (``act_sim``, ``mix_mode``, ``fixpipe_fp19``). An unknown name raises ``KeyError`` listing close matches.
        """
        if name.endswith(".weight"):
            name = name[: -len(".weight")]
        entry = self.layout.linears.get(name)
        if entry is None:
            raise KeyError(f"{self.folder}: no described linear {name!r}{self._close(name, self.layout.linears)}")
        if not entry.supported:
            raise QuantFormatError(
                f"{name}.weight: type {entry.qtype} is recognised but not supported by quant.msmodelslim "
                f"(supported: {', '.join(SUPPORTED_TYPES)})"
            )
        tensors = {suffix: self.weights.get(key) for suffix, key in entry.tensors.items()}
        return QuantLinear(entry.qtype, tensors, name=name, path=path, **kwargs)

    def norm(self, name: str, eps: float = 1e-6, kind: str = "rms") -> AntiOutlierNorm:
        """The (possibly smoothed) norm ``name``: ``norm(x) * weight + bias``.

        Uses ``<name>.module.weight`` / ``.module.bias`` when present (the pair MindIE's ``AntiModule`` reads),
        else ``<name>.weight`` / ``<name>.bias``.
        """
        e = self.layout.norms.get(name)
        if e is None:
            raise KeyError(f"{self.folder}: no described norm {name!r}{self._close(name, self.layout.norms)}")
        wkey = e.module_weight or e.weight
        bkey = e.module_bias if e.module_weight else e.bias
        if bkey is None:
            bkey = e.module_bias or e.bias
        w = self.weights.get(wkey)
        b = None if bkey is None else self.weights.get(bkey)
        return AntiOutlierNorm(w, b, eps=eps, kind=kind, name=name)

    def kv_cache(self, name: str, reciprocal: bool = False) -> KVCacheQuant:
        """C8 quantiser of ``<attn>.k_proj`` / ``<attn>.v_proj`` from ``kv_cache_scale`` / ``kv_cache_offset``."""
        e = self.layout.kv.get(name)
        if e is None:
            raise KeyError(f"{self.folder}: no KV-cache entry {name!r}{self._close(name, self.layout.kv)}")
        off = None if e.offset is None else self.weights.get(e.offset)
        return KVCacheQuant(self.weights.get(e.scale), off, name=name, reciprocal=reciprocal)

    def tensor(self, key: str):
        """One stored tensor, read now."""
        return self.weights.get(key)

    # -- sizes
    def bytes_per_param(self, quantized_only: bool = False) -> float:
        """Stored bytes per logical parameter.

        Logical parameters are those of the float model: ``n * k`` (+ ``n`` for a bias) per linear -- whatever its
        packing -- plus every other described float tensor; quantisation metadata (scales, offsets, deq_scale,
        quant_bias, scale_bias, KV scales, ``.module.*`` duplicates) adds bytes but no parameters. With
        ``quantized_only=True`` only quantised linears count (their weights and metadata bytes over ``n * k``).
        """
        infos = self.weights.infos()
        params = 0
        nbytes = 0
        counted: set[str] = set()
        for name, e in self.layout.linears.items():
            if quantized_only and e.qtype == FLOAT:
                continue
            keys = list(e.tensors.values())
            counted.update(keys)
            nbytes += sum(infos[k].nbytes for k in keys)
            if e.layout is not None:
                params += e.layout.n * e.layout.k + (e.layout.n if e.layout.has_bias else 0)
            else:
                params += sum(infos[k].numel for s, k in e.tensors.items() if s in ("weight", "bias"))
        if not quantized_only:
            for key, info in infos.items():
                if key in counted:
                    continue
                nbytes += info.nbytes
                e_norm = any(key in (n.module_weight, n.module_bias) for n in self.layout.norms.values())
                is_meta = key.endswith((".kv_cache_scale", ".kv_cache_offset")) or e_norm
                if not is_meta:
                    params += info.numel
        return nbytes / params if params else float("nan")

    # -- lifetime
    def close(self) -> None:
        self.weights.close()

    def __enter__(self) -> "MsModelSlimCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        n_q = len(self.entries(quantized_only=True))
        return (f"MsModelSlimCheckpoint({self.folder!r}, model_quant_type={self.model_quant_type!r}, "
                f"kv_cache_type={self.kv_cache_type!r}, {n_q} quantised linears, {len(self.weights)} tensors)")


def load(
    folder: str,
    allow_float_mtp: bool = False,
    num_hidden_layers: Optional[int] = None,
    description_path: Optional[str] = None,
) -> MsModelSlimCheckpoint:
    """Open and validate the msModelSlim checkpoint in ``folder`` (headers only; tensors load on demand).

    ``num_hidden_layers`` locates the MTP layer; by default it is read from ``folder/config.json`` when present.
    ``allow_float_mtp=True`` loads an undescribed MTP layer as FLOAT (and ignores described-but-absent MTP
    entries) with a :class:`MsModelSlimWarning` instead of raising. ``description_path`` picks the description
    file when the folder holds several. All problems are raised together as one :class:`QuantFormatError`.
    """
    desc = read_description(description_path or folder)
    store = WeightStore(folder)
    try:
        if num_hidden_layers is None:
            num_hidden_layers = _num_hidden_layers_from_config(folder)
        layout = validate(desc, metas_from_store(store), num_hidden_layers, allow_float_mtp)
    except BaseException:
        store.close()
        raise
    return MsModelSlimCheckpoint(folder, desc, store, layout, num_hidden_layers)


__all__ = [
    "AntiOutlierNorm",
    "KNOWN_TYPES",
    "KVCacheQuant",
    "MsModelSlimCheckpoint",
    "MsModelSlimWarning",
    "QUANT_LINEAR_TYPES",
    "QuantFormatError",
    "QuantLinear",
    "SUPPORTED_TYPES",
    "find_weight_files",
    "load",
    "parse_description",
    "read_description",
    "validate",
]
