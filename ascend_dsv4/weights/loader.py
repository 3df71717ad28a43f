"""Materialise a model from a checkpoint folder: allocate each parameter in its final format, stream the shards.

:func:`load_weights` plans the load from the headers (:mod:`.checkpoint`: all format problems at once), allocates
every parameter on the target device in its kept format (quantised linears and experts stay FP8 / FP4 unless
``dequantize``), then streams tensor by tensor (memory-mapped, with a progress bar) straight into that storage:
peak memory is the loaded model plus the tensor in flight. Data problems (NaN scales, tid2eid out of range) are
collected during the stream and reported together before the model is returned.
"""

from __future__ import annotations

import logging
import math
import os

import torch
from torch import nn

import atb_ops
from parallel.linear import Linear

from ..errors import CheckpointError
from ..layers.experts import Experts
from .checkpoint import Plan, plan_load
from .weight_check import checkable, count_nonfinite, nonfinite_flag

log = logging.getLogger("ascend_dsv4")

_CHUNK_BYTES = 32 << 20  # one preadv call
_BATCH_BYTES = 256 << 20  # tensors read concurrently before their (rare) conversions are applied


def _scale_storage_dtype(dtype: str) -> torch.dtype:
    return torch.float32 if dtype == "F32" else torch.uint8


def _as_storable(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e8m0fnu else t


def _read_part(h, info, dim: int, start: int, stop: int) -> torch.Tensor:
    """Rows / columns ``start:stop`` of dimension ``dim`` of one stored tensor, read through a memory map (only
    the pages holding the part are touched; a dim-0 part is one contiguous range)."""
    import numpy as np

    shape = tuple(info.shape)
    es = info.nbytes // max(1, math.prod(shape))
    outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1:]) * es
    mm = np.memmap(h.path, dtype=np.uint8, mode="r", offset=h.data_start + info.begin, shape=(info.nbytes,))
    part = np.array(mm.reshape(outer, shape[dim], inner)[:, start:stop, :], copy=True, order="C")
    del mm
    t = torch.from_numpy(part).view(info.torch_dtype if info.torch_dtype != torch.float8_e8m0fnu else torch.uint8)
    return t.reshape(shape[:dim] + (stop - start,) + shape[dim + 1:])


def _check_scale(t: torch.Tensor, where: str, problems: list[str]) -> None:
    if t.dtype == torch.uint8:
        bad = int((t == 255).sum())
        if bad:
            problems.append(f"{where}: {bad} E8M0 scale(s) are 255 (NaN)")
    elif not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
        problems.append(f"{where}: scale has NaN, infinite or non-positive values")


class _Loader:
    def __init__(self, model: nn.Module, plan: Plan, dtype: torch.dtype, device, dequantize: bool,
                 check_weights: bool = True):
        self.model, self.plan, self.dtype, self.device, self.deq = model, plan, dtype, torch.device(device), dequantize
        self.check_weights = check_weights
        self.counts: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (where, stored, device flag) per batch
        self.problems: list[str] = []
        self.routes: dict[str, list[tuple]] = {}  # checkpoint name -> [(kind, target key)]
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # dequant-at-load pairs waiting for a partner
        self.storage: dict[str, torch.Tensor] = {}
        self.slices: dict[str, tuple[int, int, int]] = {}  # checkpoint name -> (dim, start, stop) this rank reads
        self.bytes_read = 0

    def empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    # ---- allocation ------------------------------------------------------------------------------------
    def allocate(self) -> None:
        targets, found = self.plan.targets, self.plan.found
        mods = dict(self.model.named_modules())
        by_param: dict[str, list[str]] = {}
        for key, t in targets.items():
            if self.plan.skip_mtp and key.startswith("mtp."):
                continue
            by_param.setdefault(t.param, []).append(key)
        for param, keys in by_param.items():
            t0, f0 = targets[keys[0]], found[keys[0]]
            mod_name, leaf = param.rsplit(".", 1) if "." in param else ("", param)
            mod = mods[mod_name]
            if isinstance(mod, Linear):
                self._alloc_linear(mod, keys[0], t0, f0)
            elif isinstance(mod, Experts):
                pass  # allocated once per Experts module below
            else:
                old = getattr(mod, leaf)
                dtype = torch.long if t0.index else old.dtype
                st = self.empty(tuple(old.shape) if t0.shard else t0.shape, dtype)
                if t0.shard:
                    self._slice(f0.weight, t0.shard)
                if leaf in mod._parameters:
                    mod._parameters[leaf] = nn.Parameter(st, requires_grad=False)
                else:
                    mod._buffers[leaf] = st
                self.storage[keys[0]] = st
                self._route(f0.weight[1], ("copy", keys[0]))
        for mod_name, mod in mods.items():
            if isinstance(mod, Experts) and not (self.plan.skip_mtp and mod_name.startswith("mtp.")):
                self._alloc_experts(mod_name, mod)

    def _route(self, ck_name: str, action: tuple) -> None:
        self.routes.setdefault(ck_name, []).append(action)

    def _slice(self, found_entry, shard) -> tuple[int, ...]:
        """Record that this rank reads only its part of a checkpoint tensor (split proportionally on
        ``shard.dim``: also right for packed FP4 columns and 128-block / 32-group scale grids, whose splits the
        layout validation checked); returns the stored shape of that part."""
        _shard_file, ck, info = found_entry
        shape = tuple(info.shape)
        try:
            a, b = shard.bounds(shape[shard.dim], ck)
        except ValueError as e:
            raise CheckpointError(f"{os.path.basename(_shard_file)}: {e} (tensor-parallel size {shard.size})") from e
        self.slices[ck] = (shard.dim, a, b)
        return shape[: shard.dim] + (b - a,) + shape[shard.dim + 1:]

    def _alloc_linear(self, mod: Linear, key: str, t, f) -> None:
        keep = f.fmt != "dense" and t.keep_quant and not self.deq
        if t.shard:
            w_shape = self._slice(f.weight, t.shard)
            s_shape = self._slice(f.scale, t.shard) if f.scale is not None else None
        else:
            w_shape = tuple(f.weight[2].shape)
            s_shape = tuple(f.scale[2].shape) if f.scale is not None else None
        if keep:
            w = self.empty(w_shape, f.weight[2].torch_dtype)
            s = self.empty(s_shape, _scale_storage_dtype(f.scale[2].dtype_str))
            mod.set_weight(w, s, f.fmt)
            self.storage[key], self.storage[key + "#scale"] = w, s
            self._route(f.weight[1], ("copy", key))
            self._route(f.scale[1], ("copy_scale", key + "#scale"))
        else:
            shape = tuple(mod.weight.shape) if t.shard else t.shape
            w = self.empty(shape, torch.float32 if mod.compute_fp32 else mod.weight.dtype)
            mod.set_weight(w)
            self.storage[key] = w
            if f.fmt == "dense":
                self._route(f.weight[1], ("copy", key))
            else:
                self._route(f.weight[1], ("deq_w", key))
                self._route(f.scale[1], ("deq_s", key))

    def _alloc_experts(self, mod_name: str, mod: Experts) -> None:
        found, E, first = self.plan.found, mod.w1.shape[0], mod.first_expert
        fmt = found[f"{mod_name}.{first}.w1.weight"].fmt
        if fmt == "fused":
            fmt = "dense"
        keep = fmt != "dense" and not self.deq
        tensors = {}
        for w in ("w1", "w2", "w3"):
            key0 = f"{mod_name}.{first}.{w}.weight"
            f0, sh = found[key0], self.plan.targets[key0].shard
            logical = tuple(getattr(mod, w).shape)
            if keep:
                w_shape = self._slice(f0.weight, sh) if sh else tuple(f0.weight[2].shape)
                s_shape = self._slice(f0.scale, sh) if sh else tuple(f0.scale[2].shape)
                tensors[w] = self.empty((E,) + w_shape, f0.weight[2].torch_dtype)
                tensors[w + "_scale"] = self.empty((E,) + s_shape, _scale_storage_dtype(f0.scale[2].dtype_str))
            else:
                tensors[w] = self.empty(logical, getattr(mod, w).dtype)
            for e in range(E):
                key = f"{mod_name}.{first + e}.{w}.weight"
                f = found[key]
                self.storage[key] = tensors[w][e]
                if f.fmt == "fused":
                    continue
                if sh:
                    self._slice(f.weight, sh)
                    if f.scale is not None:
                        self._slice(f.scale, sh)
                if keep or f.fmt == "dense":
                    self._route(f.weight[1], ("copy", key))
                    if keep:
                        self.storage[key + "#scale"] = tensors[w + "_scale"][e]
                        self._route(f.scale[1], ("copy_scale", key + "#scale"))
                else:
                    self._route(f.weight[1], ("deq_w", key))
                    self._route(f.scale[1], ("deq_s", key))
        for off, (_s, ck, _i) in self.plan.fused.items():
            if off.startswith(mod_name.rsplit(".", 1)[0] + "."):
                self._route(ck, ("fused", mod_name, "w1w3" if off.endswith("gate_up_proj") else "w2"))
        mod.set_weights(fmt if keep else "dense", tensors)

    # ---- streaming -------------------------------------------------------------------------------------
    def _direct_target(self, actions: list[tuple], info) -> torch.Tensor | None:
        """The storage a tensor can be read straight into (same dtype, contiguous, on the CPU), if any."""
        if len(actions) != 1 or actions[0][0] not in ("copy", "copy_scale"):
            return None
        st = self.storage[actions[0][1]]
        want = torch.uint8 if info.torch_dtype == torch.float8_e8m0fnu else info.torch_dtype
        ok = st.device.type == "cpu" and st.dtype == want and st.is_contiguous() and st.numel() * st.element_size() == info.nbytes
        return st if ok else None

    def fill(self, folder: str, progress: bool) -> None:
        """Read every routed tensor once, shard by shard in file order, with a few reader threads (page-faulting
        fresh memory is the bottleneck on one core). A tensor whose storage has its dtype is read with
        ``preadv`` straight into that storage (no intermediate copy); others go through one temporary tensor,
        at most a batch (~256 MB) of them at a time."""
        from concurrent.futures import ThreadPoolExecutor

        from tqdm import tqdm

        from quant.safetensors_io import _progress_enabled, find_shards, read_header

        plan = []
        for path in find_shards(folder):
            h = read_header(path)
            sel = sorted((i for n, i in h.tensors.items() if n in self.routes), key=lambda i: i.begin)
            if sel:
                plan.append((h, sel))
        total = sum(i.nbytes for _, sel in plan for i in sel)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading", disable=not _progress_enabled(progress))
        fmts = {k: f.fmt for k, f in self.plan.found.items()}
        workers = max(1, min(4, os.cpu_count() or 1))
        try:
            with ThreadPoolExecutor(workers) as pool:
                for h, sel in plan:
                    fd = os.open(h.path, os.O_RDONLY)
                    try:
                        batch, size = [], 0
                        for info in sel:
                            batch.append(info)
                            size += info.nbytes
                            if size >= _BATCH_BYTES:
                                self._read_batch(pool, fd, h, batch, fmts, bar)
                                batch, size = [], 0
                        self._read_batch(pool, fd, h, batch, fmts, bar)
                    finally:
                        os.close(fd)
        finally:
            bar.close()

    def _read_batch(self, pool, fd: int, h, batch: list, fmts: dict, bar) -> None:
        items, futures = [], []
        for info in batch:
            actions = self.routes[info.name]
            if info.name in self.slices:  # this rank's part only, applied at once (no batch of temporaries)
                t = _read_part(h, info, *self.slices[info.name])
                self.bytes_read += t.numel() * t.element_size()
                self._apply(actions, _as_storable(t), f"{os.path.basename(h.path)}: {info.name}", fmts, False)
                bar.update(info.nbytes)
                continue
            self.bytes_read += info.nbytes
            direct = self._direct_target(actions, info)
            dst = direct if direct is not None else torch.empty(info.shape, dtype=info.torch_dtype)
            items.append((info, actions, dst, direct is not None))
            if not info.nbytes:
                continue
            view = memoryview(dst.reshape(-1).view(torch.uint8).numpy())
            for a in range(0, info.nbytes, _CHUNK_BYTES):
                b = min(a + _CHUNK_BYTES, info.nbytes)
                futures.append((info, b - a, pool.submit(os.preadv, fd, [view[a:b]], h.data_start + info.begin + a)))
        for info, want, fut in futures:
            if fut.result() != want:
                raise CheckpointError(f"{os.path.basename(h.path)}: {info.name}: short read (truncated shard?)")
        for info, actions, dst, in_place in items:
            self._apply(actions, _as_storable(dst), f"{os.path.basename(h.path)}: {info.name}", fmts, in_place)
            bar.update(info.nbytes)
        self._collect_counts()

    def _count(self, where: str, stored: torch.Tensor) -> None:
        """Queue the non-finite check of ``stored`` (the tensor where it lands, on its device)."""
        if self.check_weights and checkable(stored):
            self.counts.append((where, stored, nonfinite_flag(stored)))

    def _collect_counts(self) -> None:
        """One synchronisation per batch; a flagged tensor is counted exactly and becomes a problem naming shard,
        tensor and count."""
        if not self.counts:
            return
        flags = torch.stack([f for *_, f in self.counts]).tolist()  # one sync for the whole batch
        for (where, stored, _), bad in zip(self.counts, flags):
            if bad:
                n = int(count_nonfinite(stored))
                self.problems.append(f"{where}: {n} non-finite value(s) (NaN or Inf) in the weight")
        self.counts = []

    def _apply(self, actions, t: torch.Tensor, where: str, fmts: dict, in_place: bool) -> None:
        for action in actions:
            kind = action[0]
            if kind == "copy":
                key = action[1]
                if self.plan.targets[key].index:
                    self._check_tid2eid(key, t, where)
                if not in_place:
                    self.storage[key].copy_(t)
                self._count(where, self.storage[key])
            elif kind == "copy_scale":
                _check_scale(t, where, self.problems)
                if not in_place:
                    self.storage[action[1]].copy_(t)
            elif kind in ("deq_w", "deq_s"):
                key = action[1]
                if kind == "deq_s":
                    _check_scale(t, where, self.problems)
                part = self.pending.setdefault(key, {})
                part[kind] = t
                if len(part) == 2:
                    self._dequant_into(key, part.pop("deq_w"), part.pop("deq_s"), fmts[key])
                    shard, ck, _ = self.plan.found[key].weight
                    self._count(f"{os.path.basename(shard)}: {ck} (dequantised with its scale)", self.storage[key])
                    del self.pending[key]
            elif kind == "fused":
                mod = self.model.get_submodule(action[1])
                if action[2] == "w1w3":
                    inter = t.shape[1] // 2
                    mod.w1.copy_(t[:, :inter])
                    mod.w3.copy_(t[:, inter:])
                    self._count(where + " (w1)", mod.w1)
                    self._count(where + " (w3)", mod.w3)
                else:
                    mod.w2.copy_(t)
                    self._count(where, mod.w2)

    def _dequant_into(self, key: str, w: torch.Tensor, s: torch.Tensor, fmt: str) -> None:
        try:
            self.storage[key].copy_(atb_ops.dequantize_weight(w, s, fmt))
        except ValueError as e:  # QuantFormatError from the codecs
            self.problems.append(f"{key}: {e}")

    def _check_tid2eid(self, key: str, t: torch.Tensor, where: str) -> None:
        n_exp = self.model.cfg.n_routed_experts
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= n_exp):
            self.problems.append(f"{where}: expert ids must be in [0, {n_exp}), found [{int(t.min())}, {int(t.max())}]")


@torch.no_grad()
def load_weights(model: nn.Module, folder: str, device: str | torch.device = "cpu", dequantize: bool = False,
                 progress: bool = True, check_weights: bool = True) -> Plan:
    """Fill ``model`` (built on any device, e.g. ``meta``) from the checkpoint in ``folder``; returns the plan.

    Raises :class:`CheckpointError` listing every problem. MTP weights absent from the checkpoint are zeroed.
    ``check_weights``: count NaN / Inf values of every floating-point tensor where it lands (on ``device``; FP8
    NaN codes included, see :mod:`.weight_check`) and report each offending shard, tensor and count.
    """
    plan = plan_load(model, folder)
    ld = _Loader(model, plan, getattr(model, "dtype", torch.bfloat16), device, dequantize, check_weights)
    ld.allocate()
    ld.fill(folder, progress)
    plan.bytes_read = ld.bytes_read
    if ld.pending:
        ld.problems += [f"{k}: weight or scale never arrived" for k in ld.pending]
    if ld.problems:
        raise CheckpointError(f"checkpoint {folder} has bad tensor data ({len(ld.problems)} problem(s)):\n  "
                              + "\n  ".join(ld.problems[:60]))
    if plan.skip_mtp and getattr(model, "mtp", None) is not None and len(model.mtp):
        log.warning("%s has no MTP weights: the MTP module is zeroed, draft logits are meaningless", folder)
        for name, p in list(model.mtp.named_parameters()):
            mod_name, leaf = name.rsplit(".", 1)
            mod = model.mtp.get_submodule(mod_name)
            mod._parameters[leaf] = nn.Parameter(torch.zeros(p.shape, dtype=p.dtype, device=device),
                                                 requires_grad=False)
        for name, b in list(model.mtp.named_buffers()):
            if b.is_meta:
                mod_name, leaf = name.rsplit(".", 1)
                model.mtp.get_submodule(mod_name)._buffers[leaf] = torch.zeros(b.shape, dtype=b.dtype, device=device)
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if left:
        raise CheckpointError(f"checkpoint {folder}: parameters left unloaded: {', '.join(left[:10])}")
    return plan
