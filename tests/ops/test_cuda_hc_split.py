"""The CUDA hc_pre / hc_head split kernel's chunked grid (T, cdiv(d, BD) [+ 1 Sinkhorn program]) against the
reference ops: several tokens, several u chunks, a ragged last chunk and d smaller than the chunk.

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


def _check(t, d, dtype, seed):
    x, fn, base, scale = _inputs(seed, t, d, dtype)
    impl = atb_ops.implementations("hc_pre")
    (u1, p1, c1), (u2, p2, c2) = (impl[k](x, fn, base, scale, 20, 1e-6, 1e-6) for k in ("cuda", "reference"))
    assert u1.shape == u2.shape == (t, d) and u1.dtype == u2.dtype == dtype
    assert p1.shape == p2.shape == (t, N) and c1.shape == c2.shape == (t, N, N)
    assert _rel(u1, u2) < _tol(dtype) and _rel(p1, p2) < 1e-5 and _rel(c1, c2) < 1e-5
    # every token's every chunk written (u is torch.empty before the kernel): per-token relative error too
    for i in range(t):
        assert _rel(u1[i], u2[i]) < _tol(dtype)
    impl = atb_ops.implementations("hc_head")
    args = (x, fn[:N].contiguous(), base[:N].contiguous(), scale[:1].contiguous(), 1e-6, 1e-6)
    h1, h2 = impl["cuda"](*args), impl["reference"](*args)
    assert h1.shape == h2.shape == (t, d) and h1.dtype == h2.dtype
    for i in range(t):
        assert _rel(h1[i], h2[i]) < _tol(dtype)


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
