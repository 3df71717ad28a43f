"""atb_ops.rms_norm_rope: RMSNorm then RoPE (then the KV row write) as one CUDA launch, against the ops in sequence.

The CUDA kernel runs on CPU tensors through Triton's interpreter without a GPU (tests/conftest.py), on the device
with one. The specification is the reference ops in sequence: rms_norm (rounded to x's dtype), apply_rope, and
``out.index_copy_(0, out_rows, y.to(out.dtype))``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import atb_ops  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def fused():
    return atb_ops.implementations("rms_norm")["cuda"].rope_epilogue


def composed(x, w, eps, pos, inv, out=None, rows=None):
    ref = atb_ops.implementations
    y = ref("apply_rope")["reference"](ref("rms_norm")["reference"](x, w, eps), pos, inv, False)
    if out is None:
        return y
    out = out.clone()
    out.index_copy_(0, rows, y.to(out.dtype))
    return out


def data(shape, dtype, seed, with_w=True, rope=16):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 3).to(DEV, dtype)
    w = torch.randn(shape[-1], generator=g).to(DEV) if with_w else None
    pos = torch.randint(0, 70000, (shape[0],), generator=g).to(DEV)
    inv = atb_ops.rope_inv_freq(rope, 160000.0, 16.0, 65536).to(DEV)
    return x, w, pos, inv


def close(a, b, dtype):
    """float32: ~1e-6 elementwise; bfloat16: to the rounding of bf16 outputs, 1e-2 relative (Frobenius) as in
    test_triton_kernels.py: Triton's interpreter rounds float32 -> bfloat16 toward zero where the reference rounds
    to nearest, and the norm's rounding feeds the rotation."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
    else:
        a, b = a.double().cpu(), b.double().cpu()
        assert float((a - b).norm() / b.norm()) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,with_w,rope", [((3, 4, 64), False, 16), ((5, 48), True, 16), ((1, 2, 40), True, 8),
                                               ((2, 64), True, 64)])
def test_matches_norm_then_rope(dtype, shape, with_w, rope):
    x, w, pos, inv = data(shape, dtype, 0, with_w, rope)
    got = fused()(x, w, 1e-6, pos, inv)
    close(got, composed(x, w, 1e-6, pos, inv), dtype)
    assert torch.equal(fused()(x[:1], w, 1e-6, pos[:1], inv), got[:1])  # a token alone: bitwise as in the batch


@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.float32, torch.bfloat16)])
def test_writes_the_rows_of_the_pool(dtype, out_dtype):
    x, w, pos, inv = data((4, 32), dtype, 1)
    wide = torch.cat([torch.zeros(4, 8, device=DEV, dtype=dtype), x], 1)[:, 8:]  # a column slice: row-strided
    pool = torch.full((9, 32), 7.0, device=DEV, dtype=out_dtype)
    rows = torch.tensor([6, 0, 3, 8], device=DEV)
    expect = composed(x, w, 1e-6, pos, inv, pool, rows)
    assert fused()(wide, w, 1e-6, pos, inv, pool, rows) is None
    close(pool, expect, out_dtype)
    untouched = torch.ones(9, dtype=torch.bool)
    untouched[rows.cpu()] = False
    assert (pool[untouched.to(DEV)] == 7.0).all()


def test_pool_rows_of_several_heads_and_a_strided_pool():
    x, w, pos, inv = data((3, 2, 16), torch.float32, 2, with_w=False, rope=8)
    base = torch.full((5, 40), -1.0, device=DEV)
    pool = base[:, :32].view(5, 2, 16)  # rows 40 apart, each row's heads contiguous
    rows = torch.tensor([4, 1, 2], device=DEV)
    expect = composed(x, None, 1e-6, pos, inv, pool.clone(), rows)
    fused()(x, None, 1e-6, pos, inv, pool, rows)
    close(pool, expect, torch.float32)
    assert (base[:, 32:] == -1.0).all()


def test_layouts_the_kernel_does_not_take_run_the_ops_in_sequence():
    x, w, pos, inv = data((3, 21), torch.float32, 3, rope=8)  # 21 - 8 channels pass through: pairs misaligned
    close(fused()(x, w, 1e-6, pos, inv), composed(x, w, 1e-6, pos, inv), torch.float32)
    x, w, pos, inv = data((3, 24), torch.float32, 3, rope=8)
    pool = torch.zeros(6, 24, 2, device=DEV)[..., 0]  # a pool whose rows are not contiguous
    rows = torch.tensor([5, 0, 2], device=DEV)
    expect = composed(x, w, 1e-6, pos, inv, pool.clone(), rows)
    fused()(x, w, 1e-6, pos, inv, pool, rows)
    close(pool, expect, torch.float32)


def test_no_tokens():
    x, w, pos, inv = data((0, 32), torch.float32, 4)
    assert fused()(x, w, 1e-6, pos, inv).shape == (0, 32)
    pool = torch.zeros(3, 32, device=DEV)
    assert fused()(x, w, 1e-6, pos, inv, pool, pos) is None and not pool.any()


def test_public_op_composes_without_a_fused_kernel_and_checks_its_arguments():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(4, 2, 32, generator=g, dtype=torch.bfloat16), torch.randn(32, generator=g)
    pos, inv = torch.arange(4) * 1000, atb_ops.rope_inv_freq(16, 10000.0)
    assert torch.equal(atb_ops.rms_norm_rope(x, w, 1e-6, pos, inv),
                       atb_ops.apply_rope(atb_ops.rms_norm(x, w, 1e-6), pos, inv))
    pool = torch.zeros(6, 2, 32)
    atb_ops.rms_norm_rope(x, w, 1e-6, pos, inv, pool, torch.tensor([1, 5, 0, 2]))
    assert torch.equal(pool[[1, 5, 0, 2]], atb_ops.rms_norm_rope(x, w, 1e-6, pos, inv).float())
    with pytest.raises(ValueError, match="out and out_rows"):
        atb_ops.rms_norm_rope(x, w, 1e-6, pos, inv, pool)
    with pytest.raises(ValueError, match=r"positions \(3,\) must be \[T\] = \[4\]"):
        atb_ops.rms_norm_rope(x, w, 1e-6, pos[:3], inv)
    with pytest.raises(ValueError, match=r"out_rows \(2,\)"):
        atb_ops.rms_norm_rope(x, w, 1e-6, pos, inv, pool, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"out rows \(32,\) must have x's row shape \(2, 32\)"):
        atb_ops.rms_norm_rope(x, w, 1e-6, pos, inv, torch.zeros(6, 32), torch.arange(4))
