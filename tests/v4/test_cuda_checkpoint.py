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


def test_reference_numerics_float32_matches_before_rounding_flips_cascade(official):
    """With the official FP8/FP4 activation rounding, a last-bit difference can move a value across a rounding
    boundary (a 1/16 step for FP8) and then flip a routing choice, after which the toy model diverges: the
    reference backend on the GPU and on the CPU already disagree from token 41 of IDS on this checkpoint
    (measured on an H100, float32: max row error 0.62, top-1 0.92 over 197 tokens; CUDA kernels vs the
    reference on the GPU: first divergence at token 49, 0.61, 0.91). So the comparison runs over the first 36
    tokens (prefill of 28, then 8 graph-replayed decode steps), where both must agree to float32 rounding."""
    cu, ref = _pair(official, dtype="float32", numerics="reference")
    a, b = cu.logits(IDS[:36], prefill_len=28), ref.logits(IDS[:36], prefill_len=28)
    assert cu.runner.graphs.replays == 8
    assert rel_err(a, b) < 1e-4
