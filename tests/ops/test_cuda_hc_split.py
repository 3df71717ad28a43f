"""The CUDA hc_pre / hc_head split kernel's chunked grid (T, cdiv(d, BD) [+ 1 Sinkhorn program]) against the
reference ops: several tokens, several u chunks, a ragged last chunk and d smaller than the chunk; its NORM form
(hc_pre_norm / hc_head_norm: the row and its RMSNorm in one program, as one tile or chunk by chunk) against the
reference ops in sequence.

Without a GPU the kernels run on CPU tensors through Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), at small shapes; on a GPU machine the same tests run on the device.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import atb_ops  # noqa: E402
from atb_ops.cuda import hc as hc_mod  # noqa: E402
from atb_ops.cuda._util import pow2  # noqa: E402

from test_triton_kernels import DEV, rel as _rel, tol as _tol  # noqa: E402

N = 4

def _inputs(seed, t, d, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, N, d, generator=g).to(DEV, dtype)
    fn = (torch.randn((2 + N) * N, N * d, generator=g) * 0.05).to(DEV)
    base = (torch.randn((2 + N) * N, generator=g) * 0.5).to(DEV)
    scale = (torch.rand(3, generator=g) + 0.5).to(DEV)
    return x, fn, base, scale


def _head_args(x, fn, base, scale):
    """hc_head's arguments from hc_pre's inputs (the first N mixes)."""
    return x, fn[:N].contiguous(), base[:N].contiguous(), scale[:1].contiguous(), 1e-6, 1e-6


def _rows_close(a, b, t, dtype):
    """Every token's row written (the outputs are torch.empty before the kernel): per-token relative error."""
    for i in range(t):
        assert _rel(a[i], b[i]) < _tol(dtype)


def _check(t, d, dtype, seed):
    x, fn, base, scale = _inputs(seed, t, d, dtype)
    impl = atb_ops.implementations("hc_pre")
    (u1, p1, c1), (u2, p2, c2) = (impl[k](x, fn, base, scale, 20, 1e-6, 1e-6) for k in ("cuda", "reference"))
    assert u1.shape == u2.shape == (t, d) and u1.dtype == u2.dtype == dtype
    assert p1.shape == p2.shape == (t, N) and c1.shape == c2.shape == (t, N, N)
    assert _rel(u1, u2) < _tol(dtype) and _rel(p1, p2) < 1e-5 and _rel(c1, c2) < 1e-5
    _rows_close(u1, u2, t, dtype)
    impl = atb_ops.implementations("hc_head")
    args = _head_args(x, fn, base, scale)
    h1, h2 = impl["cuda"](*args), impl["reference"](*args)
    assert h1.shape == h2.shape == (t, d) and h1.dtype == h2.dtype
    _rows_close(h1, h2, t, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, d", [(3, 1100), (2, 2048), (5, 200)])
def test_hc_split_default_chunk(dtype, t, d):
    # the default chunk (1024): d = 1100 -> 2 chunks, the last 76 wide; 2048 -> 2 full chunks; 200 -> 1 short chunk
    _check(t, d, dtype, seed=100 + d + t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, d", [(3, 100), (4, 128), (1, 20)])
def test_hc_split_small_chunk(monkeypatch, dtype, t, d):
    # a 32-wide chunk: d = 100 -> 4 chunks (the last 4 wide), 128 -> 4 full chunks, 20 -> one chunk of 32 (d < BD)
    monkeypatch.setattr(hc_mod, "_split_bd", lambda dd: min(pow2(dd), 32))
    _check(t, d, dtype, seed=200 + d + t)


def _check_norm(t, d, dtype, seed):
    """hc_pre_norm / hc_head_norm (the split kernel with the norm over each whole row, hc_cuda.hc_pre_norm) against
    the reference ops in sequence: hc_pre (hc_head) then rms_norm."""
    x, fn, base, scale = _inputs(seed, t, d, dtype)
    w = (torch.rand(d, generator=torch.Generator().manual_seed(seed)) + 0.5).to(DEV)
    ref_pre, ref_head = (atb_ops.implementations(k)["reference"] for k in ("hc_pre", "hc_head"))
    ref_norm = atb_ops.implementations("rms_norm")["reference"]
    y1, p1, c1 = hc_mod.hc_pre_norm(x, fn, base, scale, 20, 1e-6, 1e-6, w, 1e-5)
    u2, p2, c2 = ref_pre(x, fn, base, scale, 20, 1e-6, 1e-6)
    y2 = ref_norm(u2, w, 1e-5)
    assert y1.shape == y2.shape == (t, d) and y1.dtype == y2.dtype == dtype
    assert _rel(p1, p2) < 1e-5 and _rel(c1, c2) < 1e-5
    _rows_close(y1, y2, t, dtype)
    args = _head_args(x, fn, base, scale)
    h1 = hc_mod.hc_head_norm(*args, w, 1e-5)
    h2 = ref_norm(ref_head(*args), w, 1e-5)
    assert h1.shape == h2.shape == (t, d) and h1.dtype == dtype
    _rows_close(h1, h2, t, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, d", [(3, 1100), (2, 2048), (5, 200)])
def test_hc_norm_fused_default_chunk(dtype, t, d):
    _check_norm(t, d, dtype, seed=300 + d + t)


@pytest.mark.parametrize("t, d", [(3, 100), (1, 20), (2, 1100)])
def test_hc_norm_fused_by_chunks(monkeypatch, t, d):
    # the row chunk by chunk (rows wider than NORM_ONE_MAX): 32-wide chunks (d = 100 -> 4, the last 4 wide; 20 -> one
    # chunk wider than d) and the default 1024 (d = 1100 -> 2 chunks, the last 76 wide)
    monkeypatch.setattr(hc_mod, "NORM_ONE_MAX", 0)
    if d < 1024:
        monkeypatch.setattr(hc_mod, "_split_bd", lambda dd: min(pow2(dd), 32))
    _check_norm(t, d, torch.bfloat16, seed=400 + d + t)


def test_fused_entry_points_dispatch():
    """atb_ops.hc_pre_norm / hc_head_norm: the CUDA kernels' fused form where the backend has it, the ops in
    sequence elsewhere (the reference backend), the same values; no token -> empty results."""
    x, fn, base, scale = _inputs(7, 3, 200, torch.float32)
    w = torch.full((200,), 1.5, device=DEV)
    outs = {}
    for backend in ("cuda", "reference"):
        with atb_ops.use_backend(backend):
            outs[backend] = (atb_ops.hc_pre_norm(x, fn, base, scale, 20, 1e-6, 1e-6, w, 1e-5),
                             atb_ops.hc_head_norm(*_head_args(x, fn, base, scale), w, 1e-5))
    (a, ah), (b, bh) = outs["cuda"], outs["reference"]
    for u, v in zip(a, b):
        assert _rel(u, v) < 1e-5
    assert _rel(ah, bh) < 1e-5
    assert hc_mod.hc_pre_norm(x[:0], fn, base, scale, 20, 1e-6, 1e-6, w, 1e-5)[0].shape == (0, 200)
    assert hc_mod.hc_head_norm(x[:0], fn[:N], base[:N], scale[:1], 1e-6, 1e-6, w, 1e-5).shape == (0, 200)


def test_fused_entry_points_refuse_a_wrong_norm_weight():
    x, fn, base, scale = _inputs(8, 2, 200, torch.float32)
    with pytest.raises(ValueError, match=r"hc_pre_norm: weight \(100,\) must be \[d\] = \[200\]"):
        atb_ops.hc_pre_norm(x, fn, base, scale, 20, 1e-6, 1e-6, torch.ones(100, device=DEV), 1e-5)
    with pytest.raises(ValueError, match=r"hc_head_norm: weight \(1, 200\) must be \[d\] = \[200\]"):
        atb_ops.hc_head_norm(*_head_args(x, fn, base, scale), torch.ones(1, 200, device=DEV), 1e-5)
