"""PTX that decodes a 32-bit word of 8 e2m1 (FP4) codes into 4 bfloat16 pairs, for CUDA C kernels
(:mod:`.fp4_moe_mma`). Same result as :data:`.gemm_tc.FP4X4_PTX` on the same word, with fewer operations on
the SM's integer (ALU) pipe.

Input ``$4``: 8 codes, code i in bits 4i..4i+3 (magnitude bits 4i..4i+2, sign bit 4i+3), i.e. bytes as
``quant.fp4`` packs them (element 2c in the low nibble of byte c). Input ``$5``: a bfloat16 pair, the scale.
Output ``$j`` (j = 0..3): the bfloat16 pair (code j, code j + 4) times 2^126 times the scale.

Pair j in four steps:

- shift the word by 6 - 4j (left for j = 0, 1; right for j = 2, 3): the magnitude bits (e1 e0 m) of codes j and
  j + 4 land on bits 6..8 and 22..24, the low exponent bits and the top mantissa bit of each bfloat16 half.
  Those bits alone read as e2m1 x 2^-126: 2^(e-127) (1 + m/2) for e > 0, and the subnormal m x 2^-127 for e = 0;
- mask the sign bits of codes j and j + 4 (bits 4j + 3 and 4j + 19) and shift them left by 12 - 4j onto bits
  15 and 31;
- one ``lop3`` computes (shifted & 0x01C001C0) | signs;
- multiply by 2^126 (0x7E80 in each half) and by the scale (exact: powers of two;
  :func:`.gemm_decode.one_multiply` folds the two into one multiply by 2^126 x scale).

Per word this is 4 ``and`` + 4 ``lop3`` + 2 right shifts on the ALU pipe. ptxas issues the 5 left shifts as
``IMAD.SHL`` on the FMA pipe. The ``gemm_tc`` decoder takes 2 ``prmt`` + 6 shifts + 6 ``lop3`` / ``and``
(ptxas moves 2 of those shifts to the FMA pipe). In :mod:`.fp4_moe_mma`, once its activations came from shared
memory, this decoder made the kernel 3-5 % faster at 8-32 tokens x top-6 and left it as fast at 64, on a lent H200
(scripts/bench_results/h200_session17.txt). Before that change, while the kernel waited on its activation loads, it
made no difference at 8-32 tokens. Checked over every word on the CPU by the PTX emulator of
tests/ops/test_gemm_decode.py (tests/ops/test_ptx_fp4.py).
"""

from __future__ import annotations


def _pair(j: int) -> str:
    """The bfloat16 pair (code j, code j + 4) of word $4 into $j, unscaled (the steps above)."""
    mag = f"shl.b32 p, $4, {6 - 4 * j};" if j < 2 else f"shr.u32 p, $4, {4 * j - 6};"
    sign = f"and.b32 q, $4, {0x00080008 << (4 * j):#010x};\n" + (f"shl.b32 q, q, {12 - 4 * j};\n" if j < 3 else "")
    return f"{mag}\n{sign}lop3.b32 ${j}, p, q, 0x01C001C0, 0xEC;\n"


FP4X8_PTX = ("{\n.reg .b32 p, q, k, z;\nmov.b32 k, 0x7E807E80;\nmov.b32 z, 0x80008000;\n"
             + "".join(_pair(j) for j in range(4))
             + "".join(f"fma.rn.bf16x2 ${j}, ${j}, k, z;\n" for j in range(4))  # x 2^126
             + "".join(f"fma.rn.bf16x2 ${j}, ${j}, $5, z;\n" for j in range(4))  # x scale
             + "}")
