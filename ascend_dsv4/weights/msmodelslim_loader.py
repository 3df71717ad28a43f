"""Run DeepSeek-V4 / V3 models from msModelSlim-format folders (``quant_model_description*.json`` +
``quant_model_weight*.safetensors``) on the reference backend.

Every described linear becomes either a dense weight (``FLOAT``) or a :class:`quant.msmodelslim.QuantLinear`
computing that entry (``path="int"``: the integer path the NPU runs — int8 x int8 -> int32, plus quant_bias,
times deq_scale, per-token scales for dynamic types; ``path="float"``: the dequantised float path). Routed
experts with quantised weights run per expert through their QuantLinears. Smoothed (anti-outlier) norms become
``norm(x) * w + b``. Names: V4 checkpoints use the official names (``layers.N.attn.wq_b``,
``layers.N.ffn.experts.E.w1``, ``mtp.0.*``); V3 checkpoints DeepSeek's HF names (``model.layers.N...``, MTP at
layer ``num_hidden_layers``).
"""

from __future__ import annotations

import glob
import logging
import os

import torch
from torch import nn

import atb_ops
from parallel.linear import Linear

from ..errors import CheckpointError
from ..models.common import RMSNorm
from ..models.v4_moe import Experts
from .msm_npu import NpuQuantLinear, to_npu_experts, to_npu_linear

log = logging.getLogger("ascend_dsv4")
_V3_W = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def is_msmodelslim_folder(folder: str) -> bool:
    return bool(glob.glob(os.path.join(glob.escape(folder), "quant_model_description*.json")))


class QuantLinearAdapter(nn.Module):
    """A described msModelSlim linear in place of a :class:`parallel.linear.Linear`: [..., K] -> [..., N]."""

    def __init__(self, ql: nn.Module, out_dtype: torch.dtype):
        super().__init__()
        self.ql, self.out_dtype = ql, out_dtype

    @property
    def weight(self) -> torch.Tensor:  # consumers that need the matrix itself (absorption, einsum) get it dense
        return self.ql.dequant_weight().to(self.out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y = self.ql(x2 if isinstance(self.ql, NpuQuantLinear) else x2.float())  # NPU ops take the model dtype
        return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype if x.dtype != torch.float32 else self.out_dtype)


class QuantExperts(nn.Module):
    """Routed experts whose weights are msModelSlim entries: w1 / w3 / w2 QuantLinears per expert."""

    def __init__(self, experts: list[tuple[nn.Module, nn.Module, nn.Module]], limit: float,
                 weight_after_w2: bool = False):
        super().__init__()
        # where the routing weight multiplies: before w2 (DeepSeek-V4, spec §2.4) or after (DeepSeek-V3); it
        # matters once w2 quantises its input
        self.weight_after_w2 = weight_after_w2
        self.w1 = nn.ModuleList(e[0] for e in experts)
        self.w3 = nn.ModuleList(e[1] for e in experts)
        self.w2 = nn.ModuleList(e[2] for e in experts)
        self.limit = limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        T, k = ids.shape
        y = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
        for e in torch.unique(ids).tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            xs = x[tok]
            h = atb_ops.swiglu(self.w1[e](xs), self.w3[e](xs), self.limit)
            w = weights[tok, slot].unsqueeze(-1)
            if self.weight_after_w2:
                y.index_add_(0, tok, self.w2[e](h.to(x.dtype)).float() * w)
            else:
                y.index_add_(0, tok, self.w2[e]((h * w).to(x.dtype)).float())
        return y


class SmoothedRMSNorm(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x)


def _ck_name(cfg, ours: str) -> str:
    """Checkpoint name of one of our parameter / module names."""
    if cfg.model_type == "deepseek_v4":
        return ours
    if ours.startswith("mtp."):
        k, rest = ours[len("mtp."):].split(".", 1)
        return f"model.layers.{cfg.n_layers + int(k)}.{rest}"
    if ours == "lm_head" or ours.startswith("lm_head."):
        return ours
    return "model." + ours


def _expert_name(cfg, mod: str, e: int, w: str) -> str:
    if cfg.model_type == "deepseek_v4":
        return f"{mod}.{e}.{w}"
    return _ck_name(cfg, f"{mod}.{e}.{_V3_W[w]}")


def _set(module: nn.Module, leaf: str, t: torch.Tensor, buffer: bool = False) -> None:
    if buffer:
        module._buffers[leaf] = t
    else:
        module._parameters[leaf] = nn.Parameter(t, requires_grad=False)


@torch.no_grad()
def load_msmodelslim(model: nn.Module, folder: str, path: str = "int", allow_float_mtp: bool = False,
                     act_sim: str | None = None, npu: bool = False) -> dict:
    """Fill ``model`` (built on any device, e.g. meta) from the msModelSlim folder; returns a summary.

    ``npu``: convert the int-path linears to their NPU parameter form at load (:mod:`.msm_npu`)."""
    import quant.msmodelslim as msm

    cfg, dtype = model.cfg, model.dtype
    try:
        ck = msm.load(folder, allow_float_mtp=allow_float_mtp, num_hidden_layers=cfg.n_layers)
    except ValueError as e:  # QuantFormatError names the keys already
        raise CheckpointError(f"{folder}: {e}") from None
    types = ck.types
    kw = {} if act_sim is None else {"act_sim": act_sim}  # float path: which activation fake-quant to apply

    def qlinear(key: str) -> nn.Module:
        ql = ck.linear(key, path=path, **kw)
        return (to_npu_linear(ql, dtype) or ql) if npu and path == "int" else ql
    has_mtp = any(k.startswith("mtp.") if cfg.model_type == "deepseek_v4" else k.startswith(f"model.layers.{cfg.n_layers}.")
                  for k in types)
    problems: list[str] = []
    n_quant = 0
    mods = dict(model.named_modules())
    done: set[str] = set()  # parameters already filled
    replaced: set[str] = set()  # modules swapped for msModelSlim ones (their tensors come from the checkpoint)

    def tensor(key: str) -> torch.Tensor | None:
        try:
            return ck.tensor(key)
        except (KeyError, ValueError):
            problems.append(f"{key}: missing from the msModelSlim checkpoint in {folder}")
            return None

    def skip(name: str) -> bool:
        return name.startswith("mtp.") and not has_mtp

    for name, mod in mods.items():
        if skip(name):
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = mods[parent_name] if name else None
        if isinstance(mod, Linear):
            key = _ck_name(cfg, name)
            qtype = types.get(key + ".weight")
            if qtype is None:
                problems.append(f"{key}.weight: not described in {folder}")
            elif qtype == "FLOAT":
                t = tensor(key + ".weight")
                if t is not None:
                    mod.set_weight(t.to(torch.float32 if mod.compute_fp32 else dtype))
            else:
                setattr(parent, leaf, QuantLinearAdapter(qlinear(key), dtype))
                replaced.add(name)
                n_quant += 1
            done.update({f"{name}.weight", f"{name}.scale"})
        elif isinstance(mod, Experts):
            E = mod.w1.shape[0]
            keys = {(e, w): _expert_name(cfg, name, e, w) for e in range(E) for w in ("w1", "w2", "w3")}
            kinds = {types.get(k + ".weight") for k in keys.values()}
            if None in kinds:
                problems.append(f"{name}: experts not (all) described in {folder}")
            elif kinds == {"FLOAT"}:
                for w in ("w1", "w2", "w3"):
                    ts = [tensor(keys[(e, w)] + ".weight") for e in range(E)]
                    if all(t is not None for t in ts):
                        _set(mod, w, torch.stack(ts).to(dtype))
            else:
                triples = [tuple(QuantLinearAdapter(qlinear(keys[(e, w)]), dtype) for w in ("w1", "w3", "w2"))
                           for e in range(E)]
                qe = QuantExperts(triples, mod.limit, weight_after_w2=cfg.model_type == "deepseek_v3")
                setattr(parent, leaf, to_npu_experts(qe) if npu and path == "int" else qe)
                replaced.add(name)
                n_quant += 3 * E
            done.update({f"{name}.{w}" for w in ("w1", "w2", "w3")})
        elif isinstance(mod, RMSNorm):
            key = _ck_name(cfg, name)
            if key in ck.layout.norms and any(getattr(ck.layout.norms[key], a, None) for a in ("bias", "module_bias")):
                setattr(parent, leaf, SmoothedRMSNorm(ck.norm(key, eps=mod.eps)))
                replaced.add(name)
    for pname, p in list(model.named_parameters()) + list(model.named_buffers()):
        if pname in done or pname.endswith("inv_freq") or skip(pname):
            continue
        if any(pname.startswith(n + ".") for n in replaced):
            continue
        if pname.endswith("e_score_correction_bias") and _ck_name(cfg, pname) not in types:
            # older V3 exports (transformers < 4.52 without noaux_tc) store no correction bias: it is zero
            _set(model.get_submodule(pname.rpartition(".")[0]), "e_score_correction_bias", torch.zeros(p.shape))
            continue
        t = tensor(_ck_name(cfg, pname))
        if t is None:
            continue
        if tuple(t.shape) != tuple(p.shape):
            problems.append(f"{_ck_name(cfg, pname)}: shape {list(t.shape)}, expected {list(p.shape)}")
            continue
        mod_name, _, leaf = pname.rpartition(".")
        owner = model.get_submodule(mod_name) if mod_name else model
        is_buf = leaf in owner._buffers
        _set(owner, leaf, t.to(p.dtype if p.dtype in (torch.float32, torch.long) else dtype), buffer=is_buf)
    if problems:
        raise CheckpointError(f"msModelSlim checkpoint {folder} does not match the model ({len(problems)} "
                              f"problem(s)):\n  " + "\n  ".join(problems[:60]))
    if not has_mtp and getattr(model, "mtp", None) is not None and len(model.mtp):
        log.warning("%s describes no MTP layer: the MTP module is zeroed (draft logits meaningless)", folder)
        for pname, p in list(model.mtp.named_parameters()) + list(model.mtp.named_buffers()):
            mod_name, _, leaf = pname.rpartition(".")
            owner = model.mtp.get_submodule(mod_name)
            _set(owner, leaf, torch.zeros(p.shape, dtype=p.dtype), buffer=leaf in owner._buffers)
    return {"quantized_linears": n_quant, "model_quant_type": ck.model_quant_type,
            "bytes_per_param": ck.bytes_per_param()}
