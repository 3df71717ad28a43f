"""Batch-invariant mode (``atb_ops.batch_invariant()``): every op against its reference (close) and for
invariance (bitwise: a row's result does not depend on the rest of the batch, nor on key-list padding), plus
the CPU primitives it is built on, at 1, 2 and 4 threads (the primitives: their invariance rests on the
BLAS behaving alike for identical calls, which these tests check on the machine they run on)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import atb_ops
from atb_ops.invariant import primitives as P
from bi_cases import cases, padded_key_cases

CASES, T = cases()
NAMES = [c[0] for c in CASES]


def _flat(out):
    return list(out) if isinstance(out, tuple) else [out]


def _selections(t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.tensor([0]), torch.tensor([t - 1]), torch.tensor([5]), torch.arange(3, 11),
            torch.randperm(t, generator=g), torch.randperm(t, generator=g)[:13], torch.tensor([4, 4, 2])]


@contextlib.contextmanager
def threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _close(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    if a.dtype in (torch.int64, torch.int32):
        # selections can legitimately differ where two scores tie to within rounding: require >= 90% overlap
        same = (a == b).float().mean().item()
        assert same > 0.9, f"{name}: only {same:.2f} of the selected ids agree with the reference"
        return
    tol = 3e-2 if a.dtype in (torch.bfloat16, torch.float16) else 1e-4
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("name", NAMES)
def test_close_to_reference(name):
    call = dict((c[0], c[1]) for c in CASES)[name]
    everything = torch.arange(T)
    ref = _flat(call(everything))
    with atb_ops.batch_invariant():
        got = _flat(call(everything))
    assert len(ref) == len(got)
    for a, b in zip(got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        _close(a, b, name)


@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_rows_bitwise_invariant(name, nthreads):
    call = dict((c[0], c[1]) for c in CASES)[name]
    with threads(nthreads), atb_ops.batch_invariant():
        full = _flat(call(torch.arange(T)))
        for sel in _selections(T):
            part = _flat(call(sel))
            for f, p in zip(full, part):
                assert torch.equal(f[sel], p), f"{name}: rows {sel.tolist()[:8]} differ from the full batch's"


@pytest.mark.parametrize("name", NAMES)
def test_empty_batch(name):
    call = dict((c[0], c[1]) for c in CASES)[name]
    with atb_ops.batch_invariant():
        for o in _flat(call(torch.zeros(0, dtype=torch.long))):
            assert o.shape[0] == 0


@pytest.mark.parametrize("case", padded_key_cases(), ids=lambda c: c[0])
def test_key_padding_bitwise_invariant(case):
    name, call = case
    with atb_ops.batch_invariant():
        base = call(0)
        for n in (1, 5, 16, 23, 70):
            assert torch.equal(call(n), base), f"{name}: {n} padding columns changed the result"
    _close(base, call(0), name)  # and the same math as the reference op (outside the mode)


def test_every_op_has_a_batch_invariant_variant():
    from atb_ops import _dispatch

    with atb_ops.batch_invariant():
        for op in atb_ops.OPS:
            assert _dispatch.resolve(op, torch.zeros(1)) is _dispatch._bi_registry["reference"][op], op
    untested = [op for op in atb_ops.OPS if not any(n == op or n.startswith(op + "_") for n in NAMES)]
    assert not untested, f"ops without a batch-invariance case in bi_cases.py: {untested}"


def test_group_linear_reference():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(6, 3, 16, generator=g), torch.randn(3, 5, 16, generator=g)
    want = torch.stack([x[:, i] @ w[i].t() for i in range(3)], 1)
    torch.testing.assert_close(atb_ops.group_linear(x, w), want)
    xb = x.bfloat16()
    want_b = torch.stack([xb[:, i].float() @ w[i].t() for i in range(3)], 1)
    torch.testing.assert_close(atb_ops.group_linear(xb, w).float(), want_b, rtol=1e-2, atol=1e-2)
    wt = w.transpose(1, 2).contiguous().transpose(1, 2)  # a transposed view of a [G, K, N] weight
    torch.testing.assert_close(atb_ops.group_linear(x, wt), want)
    assert atb_ops.group_linear(x[:0], w).shape == (0, 3, 5)


def test_mode_switch(monkeypatch):
    monkeypatch.setenv("ATB_OPS_BATCH_INVARIANT", "1")
    assert atb_ops.is_batch_invariant()
    with atb_ops.batch_invariant(False):
        assert not atb_ops.is_batch_invariant()
    monkeypatch.delenv("ATB_OPS_BATCH_INVARIANT")
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    assert not atb_ops.is_batch_invariant()
    with atb_ops.batch_invariant():
        assert atb_ops.is_batch_invariant()
        with atb_ops.batch_invariant(False):
            assert not atb_ops.is_batch_invariant()
        torch.testing.assert_close(atb_ops.linear(x, w), x @ w.t())
    atb_ops.set_batch_invariant(True)
    try:
        assert atb_ops.is_batch_invariant()
    finally:
        atb_ops.set_batch_invariant(False)
    assert not atb_ops.is_batch_invariant()


# ---- primitives ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("nthreads", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kn", [(64, 48), (256, 128), (1024, 96), (100, 7)])
def test_matmul_rows_independent_of_m(kn, dtype, nthreads):
    k, n = kn
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(70, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    with threads(nthreads):
        alone = torch.cat([P.matmul(x[i:i + 1], w) for i in range(70)])
        for m in (1, 2, 3, 4, 5, 9, 15, 16, 17, 33, 70):
            for off in (0, 70 - m):
                assert torch.equal(P.matmul(x[off:off + m], w), alone[off:off + m]), (m, off)
    torch.testing.assert_close(alone.float(), x.float() @ w.float().t(), rtol=2e-2, atol=2e-2)
    assert P.matmul(x[:0], w).shape == (0, n)


@pytest.mark.parametrize("nthreads", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 3, 4, 16, 64])
def test_bmm_invariant_to_batch_columns_and_k_padding(m, nthreads):
    g = torch.Generator().manual_seed(m)
    b_, k, n = 9, 128, 90
    a = torch.randn(b_, m, k, generator=g)
    b = torch.randn(b_, n, k, generator=g)
    with threads(nthreads):
        full = P.bmm(a, b)
        torch.testing.assert_close(full, a @ b.transpose(1, 2), rtol=1e-4, atol=1e-4)
        for nn in (1, 3, 11, 12, 16, 40, 89):
            assert torch.equal(P.bmm(a, b[:, :nn]), full[:, :, :nn]), nn
        for i, cnt in ((0, 1), (3, 2), (1, 8)):
            assert torch.equal(P.bmm(a[i:i + cnt], b[i:i + cnt]), full[i:i + cnt])
        # reduction over keys padded with zeros at the end (values passed transposed, as attention does)
        p, v = torch.rand(b_, m, 37, generator=g), torch.randn(b_, 37, 128, generator=g)
        base = P.bmm(p, v.transpose(1, 2))
        for kp in (38, 48, 64, 200, 640, 1100):
            pp = torch.nn.functional.pad(p, (0, kp - 37))
            vp = torch.nn.functional.pad(v, (0, 0, 0, kp - 37))
            assert torch.equal(P.bmm(pp, vp.transpose(1, 2)), base), kp


@pytest.mark.parametrize("nthreads", [1, 2])
def test_row_sum_invariant_to_rows_and_zero_padding(nthreads):
    g = torch.Generator().manual_seed(3)
    for n in (1, 5, 63, 64, 100, 300):
        x = torch.rand(40, n, generator=g)
        with threads(nthreads):
            base = P.row_sum(x)
            torch.testing.assert_close(base, x.sum(-1), rtol=1e-5, atol=1e-5)
            for extra in (1, 7, 64, 500):
                assert torch.equal(P.row_sum(torch.nn.functional.pad(x, (0, extra))), base), (n, extra)
            for i, cnt in ((0, 1), (7, 3), (39, 1)):
                assert torch.equal(P.row_sum(x[i:i + cnt]), base[i:i + cnt])
    assert P.row_sum(torch.zeros(0, 5)).shape == (0,)
