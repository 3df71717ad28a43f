"""atb_ops.dequantize_weight: the public dequantise op, against a naive transcription of the formats of
atb_ops.linear (FP8 128x128 blocks with float32 or E8M0 scales, packed FP4 with E8M0 per 32 inputs)."""

from __future__ import annotations

import pytest
import torch

import atb_ops

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _naive_fp8_block(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    s = s.float() if s.dtype == torch.float32 else torch.exp2(s.view(torch.uint8).float() - 127)
    out = torch.empty(w.shape, dtype=torch.float32)
    for i in range(w.shape[0]):
        for j in range(w.shape[1]):
            out[i, j] = float(w[i, j].float()) * float(s[i // 128, j // 128])
    return out


def _naive_fp4(packed: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    b = packed.view(torch.uint8)
    n, half = b.shape
    out = torch.empty(n, 2 * half, dtype=torch.float32)
    for i in range(n):
        for c in range(half):
            for k, code in enumerate((int(b[i, c]) & 0xF, int(b[i, c]) >> 4)):
                v = E2M1[code & 7] * (-1 if code & 8 else 1)
                j = 2 * c + k
                out[i, j] = v * 2.0 ** (int(s[i, j // 32]) - 127)
    return out


@pytest.mark.parametrize("shape", [(3, 5), (130, 200), (0, 128), (1, 1)])
@pytest.mark.parametrize("scale_kind", ["f32", "e8m0"])
def test_fp8_block(shape, scale_kind):
    g = torch.Generator().manual_seed(0)
    n, k = shape
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = (-(-n // 128), -(-k // 128))
    if scale_kind == "f32":
        s = torch.rand(grid, generator=g) + 0.1
    else:
        s = torch.randint(120, 134, grid, generator=g, dtype=torch.uint8)
    got = atb_ops.dequantize_weight(w, s, "fp8_block")
    assert got.dtype == torch.float32 and got.shape == (n, k)
    assert torch.equal(got, _naive_fp8_block(w, s))


@pytest.mark.parametrize("shape", [(4, 64), (2, 32), (0, 64)])
def test_fp4(shape):
    g = torch.Generator().manual_seed(1)
    n, k = shape
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8).view(torch.int8)
    s = torch.randint(117, 137, (n, k // 32), generator=g, dtype=torch.uint8)
    got = atb_ops.dequantize_weight(packed, s, "fp4")
    assert got.dtype == torch.float32 and got.shape == (n, k)
    assert torch.equal(got, _naive_fp4(packed, s))


def test_dense_and_linear_agree():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(6, 130, generator=g).to(torch.bfloat16)
    assert torch.equal(atb_ops.dequantize_weight(w), w.float())
    w8 = torch.randn(6, 130, generator=g).to(torch.float8_e4m3fn)
    s = torch.rand(1, 2, generator=g) + 0.5
    x = torch.randn(3, 130, generator=g)
    torch.testing.assert_close(atb_ops.linear(x, w8, s, "fp8_block"), x @ atb_ops.dequantize_weight(w8, s, "fp8_block").t())


def test_unknown_format():
    with pytest.raises(ValueError, match="unknown weight format"):
        atb_ops.dequantize_weight(torch.zeros(2, 2), None, "int3")
