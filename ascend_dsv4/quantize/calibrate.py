"""Calibration for static W8A8: input ranges of every statically quantised linear, from random tokens run through
the runner's float model (routed experts per expert; see :mod:`ascend_dsv4.quantize` for the method)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

import atb_ops
from parallel.linear import Linear

from ..errors import AscendDSV4Error
from ..layers.experts import Experts
from .checkpoint import W8A8, CheckpointNames, runner_of

CALIB_CHUNK = 512  # tokens per calibration forward


@dataclass
class _Range:
    lo: float = float("inf")
    hi: float = float("-inf")
    n: int = 0

    def add(self, t: torch.Tensor) -> None:
        if t.numel():
            t = t.detach()
            self.lo = min(self.lo, float(t.min()))
            self.hi = max(self.hi, float(t.max()))
            self.n += int(t.shape[0]) if t.dim() > 1 else 1

    def merge(self, o: "_Range") -> None:
        if o.n:
            self.lo, self.hi, self.n = min(self.lo, o.lo), max(self.hi, o.hi), self.n + o.n


@dataclass
class Calibration:
    """Input ranges (min, max) per output linear prefix, and the experts that fell back to a layer-wide range."""

    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)
    tokens: int = 0


def calibrate(runner, names: CheckpointNames, qtype_of: Callable[[str], str], n_tokens: int, seed: int
              ) -> Calibration:
    """Run ``n_tokens`` random tokens through the runner's float model (and its MTP layers) recording the input
    ranges of every linear ``qtype_of`` calls static W8A8 (``runner``: a ModelRunner or an ``LLM``)."""
    runner = runner_of(runner)
    model = runner.model
    # w2's input: V4 multiplies the routing weight into the expert hidden before w2 (our Experts);
    # DeepSeek-V3 (official / transformers, hence msModelSlim and vllm-ascend) weights the expert *output*
    weighted_w2 = not names.family.experts_weight_after_w2
    lin_ranges: dict[str, _Range] = {}
    moe_in: dict[str, _Range] = {}
    exp_ranges: dict[tuple[str, int, str], _Range] = {}
    hooks = []

    def lin_hook(prefix):
        def f(_mod, args):
            lin_ranges.setdefault(prefix, _Range()).add(args[0].reshape(-1, args[0].shape[-1]))
        return f

    def exp_hook(mod_name):
        def f(mod, args):
            x, weights, ids = args[0], args[1], args[2]
            moe_in.setdefault(mod_name, _Range()).add(x)
            if mod.fmt != "dense":
                raise AscendDSV4Error("calibration needs dense expert weights (load with dequantize=True)")
            xf = x.float()
            for e in torch.unique(ids).tolist():
                tok, slot = (ids == e).nonzero(as_tuple=True)
                xs = xf[tok]
                exp_ranges.setdefault((mod_name, e, "w1"), _Range()).add(xs)
                g = xs @ mod.w1[e].float().T
                u = xs @ mod.w3[e].float().T
                h = atb_ops.swiglu(g, u, mod.limit)
                if weighted_w2:
                    h = h * weights[tok, slot].float().unsqueeze(-1)
                exp_ranges.setdefault((mod_name, e, "w2"), _Range()).add(h.to(x.dtype))
        return f

    for name, mod in model.named_modules():
        if isinstance(mod, Linear):
            prefix = names.out(name + ".weight")[: -len(".weight")]
            if qtype_of(prefix) == W8A8:
                hooks.append(mod.register_forward_pre_hook(lin_hook(prefix)))
        elif isinstance(mod, Experts):
            if qtype_of(names.expert(name, 0, "w1")) == W8A8:
                hooks.append(mod.register_forward_pre_hook(exp_hook(name)))

    g = torch.Generator().manual_seed(seed)
    vocab = runner.cfg.vocab_size
    n_mtp = len(getattr(model, "mtp", None) or [])
    limit = max(1, min(CALIB_CHUNK, runner.max_num_batched_tokens or CALIB_CHUNK,
                       (runner.max_model_len or CALIB_CHUNK + 1) - 1))
    left = n_tokens
    try:
        while left > 0:
            L = min(left, limit)
            toks = torch.randint(0, vocab, (L + 1,), generator=g).tolist()
            seq = runner.new_sequence()
            try:  # the main model, then each MTP layer on its output with the true next tokens
                _logits, hidden = runner.execute([seq], [toks[:L]], [L - 1])
                for k in range(n_mtp):
                    runner.draft([seq], [L], toks[1:], hidden, torch.arange(L), k)
            finally:
                runner.release(seq)
            left -= L
    finally:
        for h in hooks:
            h.remove()

    cal = Calibration(tokens=n_tokens)
    for prefix, r in lin_ranges.items():
        cal.ranges[prefix] = (r.lo, r.hi)
    for mod_name in {k[0] for k in exp_ranges} | set(moe_in):
        E = getattr(dict(model.named_modules())[mod_name], "w1").shape[0]
        w2_all = _Range()
        for (m, _e, w), r in exp_ranges.items():
            if m == mod_name and w == "w2":
                w2_all.merge(r)
        for e in range(E):
            for w in ("w1", "w2"):
                r = exp_ranges.get((mod_name, e, w))
                if r is None or not r.n:
                    r = moe_in.get(mod_name, _Range()) if w == "w1" else w2_all
                    cal.fallbacks.append(f"{names.expert(mod_name, e, w)}")
                if not r.n:
                    continue
                cal.ranges[names.expert(mod_name, e, w)] = (r.lo, r.hi)
                if w == "w1":
                    cal.ranges[names.expert(mod_name, e, "w3")] = (r.lo, r.hi)
    return cal
