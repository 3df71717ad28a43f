"""The quantised checkpoint's names and contents: which linears the recipe quantises (asked of the family record),
our module names -> checkpoint names, and the walk over the float model's tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from quant.msmodelslim.description import FLOAT, W4A8_DYNAMIC, W8A8, W8A8_DYNAMIC

from ..errors import AscendDSV4Error
from ..layers.experts import Experts
from ..models import ModelFamily, family_of

__all__ = ["FLOAT", "W4A8_DYNAMIC", "W8A8", "W8A8_DYNAMIC", "CheckpointNames", "checkpoint_tensors",
           "expected_tensor_names", "inventory_dtypes", "names_for", "runner_of"]


def runner_of(source):
    """The :class:`~ascend_dsv4.engine.model_runner.ModelRunner` of ``source`` (a runner, or an object holding one
    as ``.runner``, such as ``LLM``)."""
    return getattr(source, "runner", source)


@dataclass
class CheckpointNames:
    """Our module names <-> the output (checkpoint) names of one model family (asked of its family record)."""

    family: ModelFamily
    n_layers: int
    n_mtp_layers: int = 0

    def out(self, ours: str) -> str:
        """Output name of one of our (non-stacked) parameter / buffer names."""
        return self.family.checkpoint_name(ours, self.n_layers)

    def expert(self, module: str, e: int, w: str) -> str:
        """Output prefix (no ``.weight``) of expert ``e`` weight ``w`` (w1/w2/w3) of the stacked ``module``."""
        return self.family.expert_checkpoint_name(module, e, w, self.n_layers)

    def qtype_of(self, prefix: str, qtype: str) -> str:
        """Description type of the linear ``prefix`` (output name without ``.weight``) for ``--type qtype``."""
        routed = bool(self.family.routed_expert_re.match(prefix))
        if not routed and not self.family.quant_linear_re.match(prefix):
            return FLOAT
        if qtype == "w8a8":
            return W8A8
        if qtype == "w4a8_dynamic" and routed:
            return W4A8_DYNAMIC
        return W8A8_DYNAMIC


def names_for(cfg) -> CheckpointNames:
    """The name map of ``cfg``'s family."""
    return CheckpointNames(family_of(cfg), cfg.n_layers, cfg.n_mtp_layers)


def inventory_dtypes(cfg) -> dict[str, str]:
    """Checkpoint tensor name -> checkpoint dtype string, experts expanded, scales dropped."""
    out: dict[str, str] = {}
    for s in family_of(cfg).tensor_inventory(cfg):
        if getattr(s, "scale", False):
            continue
        names = [s.name.format(e=e) for e in range(s.count)] if "{e}" in s.name else [s.name]
        for n in names:
            out[n] = s.dtype
    return out


def expected_tensor_names(cfg) -> set[str]:
    """The (non-scale) tensor names of the published checkpoint of ``cfg`` (what the output must hold)."""
    return set(inventory_dtypes(cfg))


def checkpoint_tensors(runner, names: Optional[CheckpointNames] = None
                       ) -> Iterator[tuple[str, torch.Tensor, Optional[tuple[str, int, str]]]]:
    """(output name, tensor, expert key or None) of every checkpoint tensor of the runner's float model, in module
    order (``runner``: a :class:`~ascend_dsv4.engine.model_runner.ModelRunner`, or anything holding one as
    ``.runner``). Output names are the family's checkpoint names (:func:`names_for`); routed experts come one
    slice per expert."""
    runner = runner_of(runner)
    names = names or names_for(runner.cfg)
    model = runner.model
    mods = dict(model.named_modules())
    for name, p in model.named_parameters():
        mod_name, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        mod = mods.get(mod_name)
        if isinstance(mod, Experts):
            if leaf not in ("w1", "w2", "w3"):
                raise AscendDSV4Error(f"{name}: experts must be dense to quantise (load with dequantize=True)")
            for e in range(p.shape[0]):
                yield names.expert(mod_name, e, leaf) + ".weight", p[e], (mod_name, e, leaf)
            continue
        if getattr(mod, "fmt", "dense") != "dense" or leaf == "scale":
            raise AscendDSV4Error(f"{name}: weights must be dense to quantise (load with dequantize=True)")
        yield names.out(name), p, None
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            yield names.out(name), b, None
    # tensors the checkpoint format stores twice (DeepSeek-V3 HF: the MTP layer's copies of embed and head)
    for ck, ours in names.family.stored_copies(names.n_layers, len(getattr(model, "mtp", None) or [])):
        yield ck, model.get_parameter(ours), None
