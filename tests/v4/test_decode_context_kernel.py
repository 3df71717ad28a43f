"""The one-launch Triton derivation of a decode step's context (atb_ops/cuda/decode_context.py) equals the torch
ops of kv/decode_inputs.py (its specification) exactly: same values, dtypes, shapes, contiguity.

Random raw buffers (padding rows, positions at window / ratio / page boundaries and past the tables, -1 pages,
widths larger and smaller than needed, one and several chunks of visible entries) and real pools (through
derive_decode_context, against build_step_context). On CPU the kernel runs through Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1); the cuda-marked tests run the same on the GPU."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from ascend_dsv4.kv.context import build_step_context  # noqa: E402
from ascend_dsv4.kv.decode_inputs import (DecodeInputs, DecodeLayout, decode_context_path,  # noqa: E402
                                          derive_decode_context, derive_decode_tensors_torch,
                                          derive_decode_tensors_triton)
from test_decode_inputs import (GEOMETRIES, TRASH_ENTRY, TRASH_TOKEN, _derive, _pools, _seq,  # noqa: E402
                               assert_same_context)


def _layout(b, B, W, widths: dict, pages: dict) -> DecodeLayout:
    S = max(W - 1, 7 if 4 in widths else 0, 127 if 128 in widths else 0)
    rs = sorted(widths)
    return DecodeLayout(b, B, W, S, tuple((r, widths[r]) for r in rs), tuple((r, pages[r]) for r in rs))


# (batch, token page B, window W, {r: visible width N}, {r: entries per page P})
LAYOUTS = [
    (1, 64, 128, {4: 16, 128: 16}, {4: 64, 128: 8}),
    (3, 16, 128, {4: 40, 128: 16}, {4: 16, 128: 2}),
    (8, 8, 32, {4: 600}, {4: 2}),  # CSA only, two chunks of visible entries
    (5, 32, 128, {128: 24}, {128: 1}),  # HCA only
    (4, 8, 16, {}, {}),  # window only
    (2, 16, 128, {4: 1100, 128: 40}, {4: 64, 128: 8}),  # three chunks for ratio 4, one for ratio 128
    (6, 4, 8, {4: 16, 128: 16}, {4: 1, 128: 1}),  # window 8 < span 127: tiny pages
]


def _specials(L: DecodeLayout) -> list[int]:
    W, B, S = L.window, L.block_size, L.token_span
    out = [0, 1, 2, 3, 4, 7, 8, W - 2, W - 1, W, W + 1, S, S + 1, B - 1, B, 2 * B - 1, 2 * B, S + B, S + B + 1]
    for r, n in L.widths:
        out += [r - 2, r - 1, r, r * n - 1, r * n, r * n + r - 1, r * (n + 3) - 1]  # up to and past the width
        out += [r * k - 1 for k in (1, 2, 5, 9)]
    for r, page in L.entry_pages:
        out += [r * page - 1, r * page, 2 * r * page - 1]
    return [x for x in out if x >= 0]


def random_inputs(L: DecodeLayout, device, seed: int, pad_frac: float = 0.25, hole_frac: float = 0.15):
    """A DecodeInputs whose device buffer holds random data: positions (-1 on padding rows, often at a
    boundary), page tables of random pages with -1 holes (not necessarily consistent with the positions: the
    derivation is a fixed function of the buffer and both paths must agree on any buffer)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    inp = DecodeInputs(L, device)
    sp = _specials(L)
    pos = [-1 if rng.random() < pad_frac else (rng.choice(sp) if rng.random() < 0.6 else rng.randint(0, 5000))
           for _ in range(L.batch)]
    inp.positions.copy_(torch.tensor(pos))

    def table(shape):
        x = torch.randint(0, 3000, shape, generator=g)
        return x.masked_fill(torch.rand(shape, generator=g) < hole_frac, -1)

    inp.token_table.copy_(table(tuple(inp.token_table.shape)))
    for r, tab in inp.tables.items():
        tab.copy_(table(tuple(tab.shape)))
    return inp


def assert_equal_tensors(a, b) -> None:
    """(t, rows, swa_slot, window, {r: CompressCtx}) of the two paths: equal values, dtypes, shapes, contiguous."""
    for x, y in zip(a[:4], b[:4]):
        assert x.dtype == y.dtype == torch.long and x.shape == y.shape and x.is_contiguous()
        assert torch.equal(x, y)
    assert sorted(a[4]) == sorted(b[4])
    for r, cb in b[4].items():
        ca = a[4][r]
        assert ca.ratio == r
        for f in ("new_cand", "new_pos", "new_slot", "visible"):
            x, y = getattr(ca, f), getattr(cb, f)
            assert x.dtype == y.dtype == torch.long and x.shape == y.shape and x.is_contiguous(), (r, f)
            assert torch.equal(x, y), (r, f, x, y)


def _check_random(device: str, seeds) -> None:
    for layout in LAYOUTS:
        L = _layout(*layout)
        for seed in seeds:
            for pad in (0.0, 0.3, 1.0):
                inp = random_inputs(L, device, seed, pad_frac=pad)
                a = derive_decode_tensors_triton(inp, TRASH_TOKEN, TRASH_ENTRY)
                b = derive_decode_tensors_torch(inp, TRASH_TOKEN, TRASH_ENTRY)
                assert_equal_tensors(a, b)


# the kernel needs tensors of the device Triton runs on: CPU tensors through the interpreter without a GPU, CUDA
# tensors on a GPU machine (where conftest leaves the interpreter off)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_kernel_equals_torch_on_random_buffers():
    _check_random(DEV, seeds=[0, 1])


def test_kernel_equals_torch_at_every_position_through_boundaries():
    """One row stepping through t = 0 .. 300 (window 32, ratio-4 and ratio-128 entries, pages of 16 / 4 / 1) next
    to a padding row and a row at a fixed position."""
    L = _layout(3, 16, 32, {4: 96, 128: 16}, {4: 4, 128: 1})
    inp = random_inputs(L, DEV, 5, hole_frac=0.05)
    for t in list(range(0, 40)) + list(range(120, 136)) + list(range(250, 300)):
        inp.positions.copy_(torch.tensor([t, -1, 200]))
        assert_equal_tensors(derive_decode_tensors_triton(inp, TRASH_TOKEN, TRASH_ENTRY),
                             derive_decode_tensors_torch(inp, TRASH_TOKEN, TRASH_ENTRY))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU pools through the interpreter; on the GPU the kernel runs "
                    "in the cuda twins and in test_cuda_graphs' graph-vs-eager decode")
@pytest.mark.parametrize("window,ratios,pages", GEOMETRIES)
def test_kernel_path_equals_build_step_context(window, ratios, pages, monkeypatch):
    """Real pools and sequences (test_decode_inputs' geometries), through derive_decode_context forced onto the
    kernel: equal to build_step_context, and to the torch path tensor for tensor."""
    monkeypatch.setenv("ASCEND_DSV4_DECODE_CTX", "triton")
    assert decode_context_path(torch.device("cpu")) == "triton"
    pools = _pools(window, ratios, pages)
    rng = random.Random(3)
    n = 7
    ts = [0, window - 1, window, 127, 128, 1023] + [rng.randint(0, 3000)]
    seqs = [_seq(pools, t, extra=rng.choice([0, 3, 70])) for t in ts[:n]]
    for bucket, extra in ((n, 0), (n + 3, 16)):
        inp, d = _derive(pools, seqs, bucket, extra_width=extra)
        assert_same_context(d, build_step_context(pools, seqs, [1] * n, "last", "cpu"), n, bucket)
        t = derive_decode_tensors_torch(inp, TRASH_TOKEN, TRASH_ENTRY)
        assert_equal_tensors((d.positions, d.seq_index, d.swa_slot, d.window, d.compress), t)
        assert d.logits_index is d.seq_index


def test_path_selection(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("ASCEND_DSV4_DECODE_CTX", raising=False)
    assert decode_context_path(cpu) == "torch" and decode_context_path(cuda) == "triton"
    monkeypatch.setenv("ASCEND_DSV4_DECODE_CTX", "torch")
    assert decode_context_path(cuda) == "torch"
    monkeypatch.setenv("ASCEND_DSV4_DECODE_CTX", "triton")
    assert decode_context_path(cpu) == "triton"
    monkeypatch.setenv("ASCEND_DSV4_DECODE_CTX", "fast")
    with pytest.raises(ValueError):
        decode_context_path(cuda)


@pytest.mark.cuda
def test_kernel_equals_torch_on_random_buffers_cuda():
    _check_random("cuda", seeds=[0, 1, 2, 3])


@pytest.mark.cuda
@torch.inference_mode()
def test_captured_kernel_follows_the_buffer_cuda(monkeypatch):
    """The kernel captured in a CUDA graph once, replayed after new random buffers: equal to the torch ops."""
    monkeypatch.delenv("ASCEND_DSV4_DECODE_CTX", raising=False)
    assert decode_context_path(torch.device("cuda")) == "triton"
    L = _layout(16, 64, 128, {4: 1100, 128: 40}, {4: 64, 128: 8})
    inp = random_inputs(L, "cuda", 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        derive_decode_context(inp, None, TRASH_TOKEN, TRASH_ENTRY)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        d = derive_decode_context(inp, None, TRASH_TOKEN, TRASH_ENTRY)
    for seed in range(1, 6):
        inp.buf.copy_(random_inputs(L, "cuda", seed).buf)
        graph.replay()
        assert_equal_tensors((d.positions, d.seq_index, d.swa_slot, d.window, d.compress),
                             derive_decode_tensors_torch(inp, TRASH_TOKEN, TRASH_ENTRY))


def test_bad_input_names_the_tensor():
    from atb_ops.cuda.decode_context import decode_context

    pos = torch.zeros(2, dtype=torch.long)
    kw = dict(block_size=16, window=4, token_span=7, ratios=[(4, 8, 4)], trash_token=0, trash_entry=[0])
    with pytest.raises(ValueError, match="token_table must be int64"):
        decode_context(pos, torch.zeros(2, 3, dtype=torch.int32), [torch.zeros(2, 2, dtype=torch.long)], **kw)
    with pytest.raises(ValueError, match=r"tables\[0\] \(ratio 4\)"):
        decode_context(pos, torch.zeros(2, 3, dtype=torch.long), [torch.zeros(3, 2, dtype=torch.long).t()], **kw)
