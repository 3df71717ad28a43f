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

from parallel.linear import Linear

from ..errors import CheckpointError
from ..layers.experts import Experts
from ..layers.norm import RMSNorm
from ..layers.quantized import QuantExperts, QuantLinearAdapter, SmoothedRMSNorm
from ..models import family_of
from .weight_check import count_nonfinite, nonfinite_flag
from .msm_npu import to_npu_experts, to_npu_linear
from .msmodelslim_tp import ParallelQuantExperts, linear_kind, quant_linear
from .tp_shards import Shard, module_shard

log = logging.getLogger("ascend_dsv4")


def is_msmodelslim_folder(folder: str) -> bool:
    return bool(glob.glob(os.path.join(glob.escape(folder), "quant_model_description*.json")))


def _set(module: nn.Module, leaf: str, t: torch.Tensor, buffer: bool = False) -> None:
    if buffer:
        module._buffers[leaf] = t
    else:
        module._parameters[leaf] = nn.Parameter(t, requires_grad=False)


@torch.no_grad()
def load_msmodelslim(model: nn.Module, folder: str, path: str = "int", allow_float_mtp: bool = False,
                     act_sim: str | None = None, check_weights: bool = True, npu: bool = False) -> dict:
    """Fill ``model`` (built on any device, e.g. meta) from the msModelSlim folder; returns a summary.

    ``check_weights``: every floating-point tensor read is checked for NaN / Inf (:mod:`.weight_check`).
    ``npu``: convert the int-path linears to their NPU parameter form at load (:mod:`.msm_npu`)."""
    import quant.msmodelslim as msm

    cfg, dtype = model.cfg, model.dtype
    fam = family_of(cfg)

    def _ck_name(cfg, ours: str) -> str:
        return fam.checkpoint_name(ours, cfg.n_layers)

    def _expert_name(cfg, mod: str, e: int, w: str) -> str:
        return fam.expert_checkpoint_name(mod, e, w, cfg.n_layers)

    try:
        ck = msm.load(folder, allow_float_mtp=allow_float_mtp, num_hidden_layers=cfg.n_layers)
    except ValueError as e:  # QuantFormatError names the keys already
        raise CheckpointError(f"{folder}: {e}") from None
    types = ck.types
    kw = {} if act_sim is None else {"act_sim": act_sim}  # float path: which activation fake-quant to apply

    def qlinear(key: str) -> nn.Module:
        ql = ck.linear(key, path=path, **kw)
        return (to_npu_linear(ql, dtype) or ql) if npu and path == "int" else ql
    mtp_prefix = fam.checkpoint_name("mtp.0", cfg.n_layers) + "."
    has_mtp = any(k.startswith(mtp_prefix) for k in types)
    problems: list[str] = []
    n_quant = 0
    mods = dict(model.named_modules())
    done: set[str] = set()  # parameters already filled
    replaced: set[str] = set()  # modules swapped for msModelSlim ones (their tensors come from the checkpoint)

    def tensor(key: str) -> torch.Tensor | None:
        try:
            t = ck.tensor(key)
        except (KeyError, ValueError):
            problems.append(f"{key}: missing from the msModelSlim checkpoint in {folder}")
            return None
        if check_weights:
            if bool(nonfinite_flag(t)):
                n = int(count_nonfinite(t))
                try:
                    shard = os.path.basename(ck.weights.file_of(key)) + ": "
                except Exception:  # noqa: BLE001 - the name of the shard is a courtesy
                    shard = ""
                problems.append(f"{shard}{key}: {n} non-finite value(s) (NaN or Inf) in the weight")
        return t

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
                    sh = module_shard(mod, "weight")  # tensor parallel: this rank's part
                    mod.set_weight((sh.take(t, key) if sh else t).to(torch.float32 if mod.compute_fp32 else dtype))
            elif linear_kind(mod) is not None:
                setattr(parent, leaf, quant_linear(ck, key, linear_kind(mod), mod.tp, path, kw, dtype,
                                                   getattr(mod, "reduce", True), npu=npu))
                replaced.add(name)
                n_quant += 1
            else:
                setattr(parent, leaf, QuantLinearAdapter(qlinear(key), dtype))
                replaced.add(name)
                n_quant += 1
            done.update({f"{name}.weight", f"{name}.scale"})
        elif isinstance(mod, Experts):
            E, first = mod.w1.shape[0], getattr(mod, "first_expert", 0)  # EP: this rank's experts only
            keys = {(e, w): _expert_name(cfg, name, first + e, w) for e in range(E) for w in ("w1", "w2", "w3")}
            kinds = {types.get(k + ".weight") for k in keys.values()}
            if None in kinds:
                problems.append(f"{name}: experts not (all) described in {folder}")
            elif kinds == {"FLOAT"}:
                for w in ("w1", "w2", "w3"):
                    ts = [tensor(keys[(e, w)] + ".weight") for e in range(E)]
                    if all(t is not None for t in ts):
                        st = torch.stack(ts)
                        if getattr(mod, "shard", None):  # TP: every expert split
                            st = Shard(mod.shard[w], mod.tp.rank, mod.tp.size).take(st, f"{name}.{w}")
                        _set(mod, w, st.to(dtype))
            elif getattr(mod, "shard", None) or mod.ep.size > 1:
                kinds_tp = {"w1": "column", "w3": "column", "w2": "row"} if mod.shard else {}
                triples = [tuple(quant_linear(ck, keys[(e, w)], kinds_tp.get(w), mod.tp, path, kw, dtype, reduce=False,
                                              npu=npu)
                                 for w in ("w1", "w3", "w2")) for e in range(E)]
                local = QuantExperts(triples, mod.limit, weight_after_w2=fam.experts_weight_after_w2)
                if npu and path == "int":  # one grouped matmul per projection where every linear allows it
                    local = to_npu_experts(local)
                setattr(parent, leaf, ParallelQuantExperts(local, E, first, mod.ep, mod.tp, ep_comm=mod.ep_comm,
                                                           split=mod.split, dim=mod.w2.shape[1]))
                replaced.add(name)
                n_quant += 3 * E
            else:
                triples = [tuple(QuantLinearAdapter(qlinear(keys[(e, w)]), dtype) for w in ("w1", "w3", "w2"))
                           for e in range(E)]
                qe = QuantExperts(triples, mod.limit, weight_after_w2=fam.experts_weight_after_w2)
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
        owner_name, _, owner_leaf = pname.rpartition(".")
        sh = module_shard(model.get_submodule(owner_name) if owner_name else model, owner_leaf)
        if sh is not None:  # tensor parallel: this rank's part (embedding, head, attn_sink)
            t = sh.take(t, pname)
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
