"""An official-format checkpoint (FP8 block-scaled attention and shared expert, packed FP4 routed experts, E8M0
scales) through the CUDA backend's kernels against the reference backend on the same GPU."""

from __future__ import annotations

import pytest
import torch

from ascend_dsv4 import LLM
from ascend_dsv4.models import preset
from ascend_dsv4.weights.random_checkpoint import write_checkpoint
from v4_helpers import rel_err

pytestmark = pytest.mark.cuda

IDS = list(range(3, 200))


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    d = tmp_path_factory.mktemp("official_cuda")
    cfg = preset("toy-v4").replace(index_topk=128, vocab_size=512, n_routed_experts=8)
    write_checkpoint(cfg, str(d), "official", seed=5, shard_bytes=2 << 20, progress=False)
    return str(d)


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


def _pair(folder, **kw):
    cu = LLM(model=folder, device="cuda", backend="cuda", progress=False, **kw)
    ref = LLM(model=folder, device="cuda", backend="reference", progress=False, **kw)
    return cu, ref


def test_formats_are_kept_and_float32_matches(official):
    cu, ref = _pair(official, dtype="float32")
    layer = cu.model.layers[2]
    assert layer.attn.wq_a.fmt == "fp8_block" and layer.ffn.experts.fmt == "fp4"
    a, b = cu.logits(IDS, prefill_len=150), ref.logits(IDS, prefill_len=150)
    assert cu.runner.graphs is not None and cu.runner.graphs.replays > 0  # the decode steps replayed graphs
    assert rel_err(a, b) < 1e-4


def test_bfloat16_matches_by_cosine_and_top1(official):
    cu, ref = _pair(official, dtype="bfloat16")
    a, b = cu.logits(IDS, prefill_len=150), ref.logits(IDS, prefill_len=150)
    assert _cos(a, b) > 0.995
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_numerics_agree_as_well_as_the_reference_with_itself_across_devices(official, dtype):
    """With the official FP8/FP4 activation rounding, a last-bit difference can move a value across a rounding
    boundary (a 1/16 step for FP8) and then flip a routing choice, so the toy model is chaotic: the reference
    backend on the GPU and on the CPU already disagree (measured on an H100 in float32: max row error 0.62,
    top-1 0.92; CUDA kernels vs the reference on the GPU: 0.61, 0.91). The rule: the CUDA backend agrees with
    the reference on the GPU about as well as the reference agrees with itself across devices."""
    rc = LLM(model=official, device="cpu", backend="reference", dtype=dtype, numerics="reference", progress=False)
    cu, rg = _pair(official, dtype=dtype, numerics="reference")
    c, g, r = (m.logits(IDS, prefill_len=150) for m in (cu, rg, rc))

    def top1(x, y):
        return (x.argmax(-1) == y.argmax(-1)).float().mean().item()

    assert top1(c, g) >= top1(g, r) - 0.05
    assert _cos(c, g) >= _cos(g, r) - 0.02
