"""The FP4 word decoder of the CUDA C MoE kernel (atb_ops/cuda/ptx_fp4.py), run on the CPU by the PTX emulator of
test_gemm_decode.py over every pair of 16-bit words, against quant's dequantisation; the GPU runs it inside
fp4_moe_mma (tests/ops/test_fp4_moe_mma.py, ``cuda``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from atb_ops.cuda import gemm_decode as gd  # noqa: E402
from atb_ops.cuda import gemm_tc as tc  # noqa: E402
from atb_ops.cuda.ptx_fp4 import FP4X8_PTX  # noqa: E402
from quant.fp4 import dequant_fp4  # noqa: E402

from test_gemm_decode import _bf16_bits_to_f32, run_ptx  # noqa: E402

WORDS16 = np.arange(65536, dtype=np.uint32)
REGS = WORDS16[0::2] | (WORDS16[1::2] << 16)  # every 16-bit word once, two per register; then the halves swapped
REGS = np.concatenate([REGS, (REGS >> 16) | (REGS << 16) & 0xFFFFFFFF]).astype(np.uint32)


def _decode(asm: str, sc: int, one_mul: bool) -> list[np.ndarray]:
    sbits = np.uint32((sc + 126) << 7 if one_mul else (0x40 if sc == 0 else sc << 7))
    return run_ptx(asm, [REGS, np.full(REGS.shape, sbits | (sbits << 16), dtype=np.uint32)], 4)


@pytest.mark.parametrize("one_mul", [False, True])
@pytest.mark.parametrize("sc", [0, 1, 100, 127, 128, 129, 254])
def test_fp4x8_ptx_decodes_every_word(sc, one_mul):
    """Output j = (code j, code j + 4) of each register (8 codes, code i in nibble i), under E8M0 scale byte sc,
    exactly as quant.fp4 dequantises the same bytes; the one-multiply form for sc <= 128."""
    if one_mul and sc > 128:
        pytest.skip("one multiply only for scale bytes <= 128")
    outs = _decode(gd.one_multiply(FP4X8_PTX) if one_mul else FP4X8_PTX, sc, one_mul)
    lo = torch.stack([_bf16_bits_to_f32(q & 0xFFFF) for q in outs], 1)  # [words, 4]: codes 0..3
    hi = torch.stack([_bf16_bits_to_f32(q >> 16) for q in outs], 1)  # codes 4..7
    got = torch.cat([lo, hi], 1)  # [words, 8] in code order
    packed = torch.from_numpy(REGS.view(np.int32).copy()).view(torch.int8).view(1, -1)  # little-endian bytes
    want = dequant_fp4(packed, torch.full((1, packed.shape[1] // 16), sc, dtype=torch.uint8), dtype=torch.float32)
    assert torch.equal(got.flatten(), want[0])


def test_fp4x8_ptx_equals_the_gemm_tc_decoder():
    """Bit for bit the outputs of gemm_tc's decoder (which fp4_moe_mma used before) on every word."""
    sc = 127
    assert all(np.array_equal(a, b) for a, b in zip(_decode(FP4X8_PTX, sc, False), _decode(tc.FP4X4_PTX, sc, False)))
