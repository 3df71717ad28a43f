"""Split-K arrival counters of the tensor-core GEMMs (atb_ops/cuda/gemm_tc.py ``_counters``) under two streams.

The model runs independent work on a side stream (ascend_dsv4/layers/overlap.py): two split-K launches with the
in-kernel fix-up may then run at once. With one counter set per device they counted arrivals in the same slots
(a tile's last arrival misjudged: a tile left unwritten or summed early, a counter left non-zero for every later
launch); each stream now has its own set. GPU only (the interpreter runs launches one after another).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from atb_ops.cuda import gemm_tc as tc  # noqa: E402

from test_gemm_decode import _weights  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.mark.cuda
@cuda
def test_split_k_launches_on_two_streams_at_once(monkeypatch):
    """Many split-K FP8 linears (4 weight tiles x 16 K splits with the in-kernel fix-up: 64 programs, under half the
    SMs) queued alternately on two streams behind a device sleep, so that both queues are full when it ends and the
    two streams' kernels run side by side: every output bitwise equal to the same call made alone, both streams'
    counters zero afterwards. (Queued without the sleep, Python issues the calls slower than the GPU runs them and
    the kernels never meet: one counter set per device passed that way.)"""
    monkeypatch.setattr(tc, "_splits", lambda *a: 16)
    g = torch.Generator().manual_seed(5)
    n, k, m, calls = 256, 8192, 8, 48
    w, s = _weights("fp8_block", 1, n, k, g)
    w, s = w[0].cuda(), s[0].cuda()
    xs = [torch.randn(m, k, generator=g).to("cuda", torch.bfloat16) for _ in range(2 * calls)]
    want = [tc.linear(x, w, s, "fp8_block") for x in xs]  # one at a time on the current stream
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for st in streams:  # each stream takes its counter set before the timed part
        with torch.cuda.stream(st):
            tc.linear(xs[0], w, s, "fp8_block")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device time on the current stream while the calls are queued
    for st in streams:
        st.wait_stream(torch.cuda.current_stream())
    got = [None] * len(xs)
    for i, x in enumerate(xs):  # a, b, a, b, ...
        with torch.cuda.stream(streams[i % 2]):
            got[i] = tc.linear(x, w, s, "fp8_block")
    torch.cuda.synchronize()
    bad = [i for i in range(len(xs)) if not torch.equal(got[i], want[i])]
    assert not bad, f"{len(bad)} of {len(xs)} outputs differ from the one-stream call (first: call {bad[0]})"
    for st in streams:
        with torch.cuda.stream(st):
            ctr = tc._counters(w.device)
            assert ctr is not None and int(ctr.abs().sum()) == 0
