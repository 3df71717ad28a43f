"""The whole V4 toy model through the CUDA backend's kernels on the CPU (Triton's interpreter: tests/conftest.py sets
TRITON_INTERPRET=1) against the reference backend: two prompts prefilled and one decode step of both (a three-layer
toy: SWA, CSA, HCA), float32 logits within the issue's float32 rule (1e-4 relative). It checks how the model calls
the kernels (the fused forms the model reaches for, the streams and shapes it hands them, the dispatch) where the op
tests check each kernel alone; the GPU run of the same comparison is tests/v4/test_cuda.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ascend_dsv4.models.deepseek_v4.model import DeepseekV4Model  # noqa: E402
from ascend_dsv4.weights.random_init import init_random_  # noqa: E402
from atb_ops.cuda._util import INTERPRET  # noqa: E402
from v4_helpers import rel_err, toy_cfg, two_sequence_logits  # noqa: E402


@pytest.mark.slow
@pytest.mark.skipif(not INTERPRET, reason="runs the CUDA backend's kernels on CPU tensors through Triton's interpreter")
def test_toy_v4_cuda_backend_equals_reference_on_cpu():
    # three layers: sliding window only, CSA (ratio 4, with the indexer), HCA (ratio 128)
    cfg = toy_cfg(n_layers=3, compress_ratios=(0, 4, 128), n_mtp_layers=0)
    model = init_random_(DeepseekV4Model(cfg, torch.float32, "exact"), 0).eval()
    ref = two_sequence_logits(model, "cpu", backend="reference")
    got = two_sequence_logits(model, "cpu", backend="cuda")
    assert got.shape == ref.shape == (4, cfg.vocab_size)  # each prefill's last row, then the decode step's two
    assert torch.isfinite(got).all()
    assert rel_err(got, ref) < 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
