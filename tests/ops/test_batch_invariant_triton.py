"""The batch-invariant Triton kernels (atb_ops/cuda/invariant_kernels.py) and the batch-invariant ops on the
CUDA backend: close to the reference ops and bitwise invariant to the batch.

On a GPU machine they run on the device; without one, on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, which must be set before triton is first imported: this module sets it when the
process has no GPU; small shapes keep the interpreter fast).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

import atb_ops  # noqa: E402
from atb_ops.invariant import primitives as P  # noqa: E402
from bi_cases import cases, padded_key_cases  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("triton was imported without TRITON_INTERPRET=1 and there is no GPU", allow_module_level=True)
# The interpreter runs tl.dot as a NumPy product of the whole tile, whose per-row result depends on the row's
# place in the tile (NumPy's BLAS blocks rows); on a GPU each row is reduced alike wherever it sits. Without
# a GPU, row selections therefore keep every row in its place within its tile (prefixes); the GPU run checks
# arbitrary ones.
STRICT = DEV == "cuda"


def selections(t: int):
    if STRICT:
        return [torch.tensor([0]), torch.tensor([t - 1]), torch.tensor([3, 1, 7]), torch.arange(2, t - 1)]
    return [torch.tensor([0]), torch.arange(0, 3), torch.arange(0, t - 2)]


def _kernels():
    from atb_ops.cuda import invariant_kernels as K

    return K


def _flat(out):
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_kernel(dtype):
    K = _kernels()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 96, generator=g).to(DEV, dtype)
    w = torch.randn(40, 96, generator=g).to(DEV, dtype)
    full = K.matmul(x, w)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(full.float(), x.float() @ w.float().t(), rtol=tol, atol=tol)
    for m, off in ((1, 0), (1, 69), (3, 5), (17, 50), (64, 6)) if STRICT else ((1, 0), (3, 0), (1, 64), (6, 64)):
        assert torch.equal(K.matmul(x[off:off + m], w), full[off:off + m]), (m, off)
    assert K.matmul(x[:0], w).shape == (0, 40)


def test_bmm_kernel_invariance():
    K = _kernels()
    g = torch.Generator().manual_seed(1)
    a = torch.randn(5, 4, 80, generator=g).to(DEV)
    b = torch.randn(5, 70, 80, generator=g).to(DEV)
    full = K.bmm(a, b)
    torch.testing.assert_close(full, a @ b.transpose(1, 2), rtol=1e-5, atol=1e-5)
    assert torch.equal(K.bmm(a[2:3], b[2:3]), full[2:3])
    assert torch.equal(K.bmm(a, b[:, :9]), full[:, :, :9])
    p, v = torch.rand(5, 4, 37, generator=g).to(DEV), torch.randn(5, 37, 48, generator=g).to(DEV)
    base = K.bmm(p, v.transpose(1, 2))
    for kp in (38, 64, 100):
        pp = torch.nn.functional.pad(p, (0, kp - 37))
        vp = torch.nn.functional.pad(v, (0, 0, 0, kp - 37))
        assert torch.equal(K.bmm(pp, vp.transpose(1, 2)), base), kp


def test_row_sum_kernel():
    K = _kernels()
    g = torch.Generator().manual_seed(2)
    x = torch.rand(9, 300, generator=g).to(DEV)
    base = K.row_sum(x)
    torch.testing.assert_close(base, x.sum(-1), rtol=1e-5, atol=1e-5)
    assert torch.equal(K.row_sum(torch.nn.functional.pad(x, (0, 333))), base)
    assert torch.equal(K.row_sum(x[4:5]), base[4:5])


CASES, T = cases(DEV, T=11)
# one interpreted program per row or per (token, head): minutes under the interpreter, milliseconds on a GPU
_SLOW_INTERPRETED = {"compressor_pool", "compressor_pool_overlap", "indexer_topk", "mla_decode", "mla_prefill",
                     "sparse_attention_extra"}


# the reference's int64 product does not run on CUDA tensors (these ops' GPU kernels are separate)
_NO_CUDA_REFERENCE = {"quant_linear_dynamic", "quant_linear_static", "quant_grouped_matmul"}


def _params(cs):
    return [pytest.param(c, id=c[0], marks=[pytest.mark.slow] if not STRICT and c[0] in _SLOW_INTERPRETED else [])
            for c in cs]


@pytest.mark.parametrize("case", _params(CASES))
def test_ops_on_cuda_backend(case):
    """Every op in batch-invariant mode on the CUDA backend: close to the reference, rows bitwise invariant."""
    name, call = case
    everything = torch.arange(T)
    ref = None
    if not (STRICT and name in _NO_CUDA_REFERENCE):
        with atb_ops.use_backend("reference"):
            ref = _flat(call(everything))
    with atb_ops.use_backend("cuda"), atb_ops.batch_invariant():
        full = _flat(call(everything))
        for sel in selections(T):
            for f, p in zip(full, _flat(call(sel))):
                assert torch.equal(f[sel.to(f.device)], p), f"{name}: rows {sel.tolist()} differ"
    for a, b in zip(full, ref or full):
        assert a.shape == b.shape and a.dtype == b.dtype
        if a.dtype == torch.int64:
            assert (a == b).float().mean().item() > 0.9, name
        else:
            tol = 3e-2 if a.dtype == torch.bfloat16 else 2e-3
            torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", _params(padded_key_cases(DEV, T=4)))
def test_key_padding_on_cuda_backend(case):
    name, call = case
    with atb_ops.use_backend("cuda"), atb_ops.batch_invariant():
        base = call(0)
        for n in (1, 16, 45):
            assert torch.equal(call(n), base), f"{name}: {n} padding columns changed the result"

