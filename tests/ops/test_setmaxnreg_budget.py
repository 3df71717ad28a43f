"""The register hand-over of the warp-specialised CUDA C kernels (``setmaxnreg``), checked on their source text.

A block launched under ``__launch_bounds__(T, 1)`` gets L registers a thread (ptxas' cap: 65536 / T, rounded down to
a multiple of 8). A producer warpgroup that lowers itself to P with ``setmaxnreg.dec`` returns (L - P) x 128 to the
SM; consumer warpgroups that raise themselves to C with ``setmaxnreg.inc`` take (C - L) x their threads, and their
``setmaxnreg.inc`` waits until that many are free -- asked for more than the producer returned, it waits forever (a
hang seen on a lent H200 in session 34 with 64 / 224 at L = 168: scripts/bench_results/h200_session34.txt). PTX ISA
("setmaxnreg"): the counts are multiples of 8 in [24, 256].
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")

from atb_ops.cuda import attention_seesaw, attention_wgmma  # noqa: E402

# module -> (threads a block, producer threads): one producer warpgroup beside the consumers
KERNELS = {attention_wgmma: (attention_wgmma.NT, 128), attention_seesaw: (attention_wgmma.NT, 128)}


def _counts(src: str, kind: str) -> list[int]:
    return [int(v) for v in re.findall(rf"setmaxnreg\.{kind}\.sync\.aligned\.u32 (\d+);", src)]


def _violations(src: str, threads: int, producers: int) -> list[str]:
    """What is wrong with a kernel source's register hand-over ([] when it fits)."""
    launch = (65536 // threads) // 8 * 8
    dec, inc = _counts(src, "dec"), _counts(src, "inc")
    bad = [] if dec and inc else ["no setmaxnreg hand-over"]
    for p in dec:
        for c in inc:
            if not (p % 8 == 0 and c % 8 == 0 and 24 <= p <= launch <= c <= 256):
                bad.append(f"counts {p} / {c} outside the PTX ISA's rules at {launch} launch registers")
            if (launch - p) * producers < (c - launch) * (threads - producers):
                bad.append(f"consumers ask {c} registers, the producer frees down to {p} from {launch}: "
                           f"setmaxnreg.inc would wait forever")
    return bad


@pytest.mark.parametrize("mod", list(KERNELS), ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_setmaxnreg_hand_over_fits_the_register_file(mod):
    threads, producers = KERNELS[mod]
    src = mod.PROGRAM.source
    assert re.search(r"__launch_bounds__\((NT|384), 1\)", src), "one block per SM is what the budget assumes"
    assert _violations(src, threads, producers) == []


def test_the_check_refuses_the_hand_over_that_hung_in_session_34():
    """attention_wgmma's source with the 64 / 224 hand-over that hung at 168 launch registers fails the check;
    64 / 216 passes."""
    src = attention_wgmma.PROGRAM.source.replace("u32 40;", "u32 64;")
    assert _violations(src.replace("u32 232;", "u32 224;"), 384, 128)
    assert _violations(src.replace("u32 232;", "u32 216;"), 384, 128) == []
