"""Programmatic dependent launch of the CUDA C kernels (atb_ops/cuda/nvrtc.py: ``launch``, ``PDL_DEVICE``).

A kernel launched with PDL may start while the kernel before it still runs; it is correct only if it waits
(``pdl_wait(pdl_early)``: ``griddepcontrol.wait``) before it reads what that kernel writes or writes anything.

- Every launch of a loaded CUDA C kernel in atb_ops/cuda goes through ``nvrtc.launch`` (the sources are read: no
  direct ``kernel(grid=...)`` call elsewhere), and every ``__global__`` kernel of every NVRTC program takes
  ``int pdl_early`` last and calls ``pdl_wait(pdl_early)`` once.
- The PTX of every instance of every kernel (NVRTC, no GPU needed: the test extras install it on Linux x86-64; skipped
  where no NVRTC library loads), which also checks that they all compile: no global or generic memory access comes
  before ``griddepcontrol.wait``, except read-only weight loads in fp8_gemv's ``PRE`` instances (its first weight
  steps before the wait, by design); ``griddepcontrol.launch_dependents`` only after the wait.
- On a GPU: chains of dependent launches (a Triton kernel with PDL and early launch, then the CUDA C kernel reading
  its output) captured in a CUDA graph with PDL equal the same chains launched eagerly without it: the FP4 MoE
  kernels (bf16 and f16 MMAs, unsplit and K split with its arrival counters), the wgmma / seesaw attention (split
  with the merge after it, and unsplit) and the indexer's top-k block (topk_radix after the score kernel), the last
  two with their early launch and without.
"""

from __future__ import annotations

import ast
import glob
import importlib
import os
import re

import pytest
import torch

pytest.importorskip("triton")

from atb_ops.cuda import nvrtc  # noqa: E402

from test_pdl import assert_pdl_graph_equals_plain  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CUDA_C = ["attention_seesaw", "attention_wgmma", "fp4_moe_f16", "fp4_moe_mma", "fp8_gemv", "topk_radix"]
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _programs():
    """{module name: nvrtc.Program} of every atb_ops/cuda module that has one."""
    out = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "atb_ops/cuda/*.py"))):
        name = os.path.splitext(os.path.basename(path))[0]
        prog = getattr(importlib.import_module(f"atb_ops.cuda.{name}"), "PROGRAM", None)
        if isinstance(prog, nvrtc.Program):
            out[name] = prog
    return out


def _braced(text: str, start: int) -> int:
    """The index just past the brace that closes the block whose opening brace ends at ``start``."""
    depth, i = 1, start
    while depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return i


def _kernels(source: str):
    """(name, parameter text, body text) of every ``__global__`` function of a CUDA source."""
    return [(m.group(1), m.group(2), source[m.end():_braced(source, m.end())])
            for m in re.finditer(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(([^{]*)\)\s*\{",
                                 source)]


def test_every_cuda_c_program_is_found():
    assert sorted(_programs()) == CUDA_C  # a new program joins the list (and these checks) explicitly


@pytest.mark.parametrize("module", CUDA_C)
def test_every_kernel_takes_pdl_early_last_and_waits_once(module):
    kernels = _kernels(_programs()[module].source)
    assert kernels, module
    for name, params, body in kernels:
        assert params.split(",")[-1].split() == ["int", "pdl_early"], f"{module}: {name} does not end in pdl_early"
        assert body.count("pdl_wait(pdl_early)") == 1, f"{module}: {name} does not call pdl_wait(pdl_early) once"
    assert "griddepcontrol" not in _programs()[module].source.replace(nvrtc.PDL_DEVICE, "")  # only through pdl_wait


def test_every_loaded_kernel_is_launched_through_nvrtc_launch():
    """No ``<kernel>(grid=..., ...)`` call in atb_ops/cuda but nvrtc.launch's own: a plain launch of a kernel that
    waits would still be correct, but would silently drop PDL on both sides of it."""
    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "atb_ops/cuda/*.py"))):
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Call) and any(k.arg == "grid" for k in node.keywords):
                found.append((os.path.basename(path), ast.unparse(node.func)))
    assert found == [("nvrtc.py", "kernel")], found
    calls = [os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "atb_ops/cuda/*.py"))
             if "nvrtc.launch(" in open(p).read()]
    assert sorted(calls) == sorted(f"{m}.py" for m in CUDA_C if m != "attention_seesaw")  # (seesaw: wgmma's run)


def test_launch_appends_pdl_early_and_picks_the_launch(monkeypatch):
    calls = []

    class Kernel:
        def __call__(self, grid, block, args, shared_mem):
            calls.append(("plain", grid, block, args, shared_mem))

    monkeypatch.setattr(nvrtc, "launch_pdl", lambda k, g, b, a, s: calls.append(("pdl", g, b, a, s)))
    monkeypatch.setattr(nvrtc, "_pdl_early", lambda: True)
    nvrtc.launch(Kernel(), (3, 1, 1), (128, 1, 1), [7], 1024, pdl=False)
    nvrtc.launch(Kernel(), (3, 1, 1), (128, 1, 1), [7], pdl=True)
    nvrtc.launch(Kernel(), (3, 1, 1), (128, 1, 1), [7], pdl=True, early=False)
    monkeypatch.setattr(nvrtc, "_pdl_early", lambda: False)  # ATB_CUDA_PDL_EARLY=0
    nvrtc.launch(Kernel(), (3, 1, 1), (128, 1, 1), [7], pdl=True)
    assert calls == [("plain", (3, 1, 1), (128, 1, 1), [7, 0], 1024),
                     ("pdl", (3, 1, 1), (128, 1, 1), [7, 1], 0),
                     ("pdl", (3, 1, 1), (128, 1, 1), [7, 0], 0),
                     ("pdl", (3, 1, 1), (128, 1, 1), [7, 0], 0)]


def test_fp4_moe_kernels_launch_without_the_early_launch():
    """The two FP4 MoE launch sites pass early=False (measured: the decode step slower at batch 32-64 with it)."""
    for name in ("fp4_moe_mma", "fp4_moe_f16"):
        tree = ast.parse(open(os.path.join(ROOT, "atb_ops/cuda", name + ".py")).read())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "nvrtc.launch"]
        assert len(calls) == 1 and any(k.arg == "early" and ast.unparse(k.value) == "False" for k in calls[0].keywords)


def test_topk_radix_keeps_one_block_an_sm_under_pdl(monkeypatch):
    """Over half an SM's shared memory reserved (with the static part: one block an SM), allowed once per kernel."""
    from atb_ops.cuda import topk_radix

    class Props:
        shared_memory_per_multiprocessor = 233472  # H100 / H200

    class Kernel:
        configured = []

        def set_shared_memory_config(self, n):
            self.configured.append(n)

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    monkeypatch.setattr(topk_radix, "_PAD", {})
    kern = Kernel()
    pad = topk_radix.one_block_per_sm(kern, torch.device("cuda", 0))
    assert pad > Props.shared_memory_per_multiprocessor // 2 and pad <= 227 * 1024 - 48 * 1024  # (static part)
    assert topk_radix.one_block_per_sm(kern, torch.device("cuda", 0)) == pad and Kernel.configured == [pad]


def test_nvrtc_pdl_switch(monkeypatch):
    monkeypatch.setattr(nvrtc, "pdl_enabled", lambda: True)
    monkeypatch.delenv("ATB_CUDA_NVRTC_PDL", raising=False)
    assert nvrtc.pdl_on()
    monkeypatch.setenv("ATB_CUDA_NVRTC_PDL", "0")
    assert not nvrtc.pdl_on()
    monkeypatch.setenv("ATB_CUDA_NVRTC_PDL", "early")
    with pytest.raises(ValueError, match="ATB_CUDA_NVRTC_PDL"):
        nvrtc.pdl_on()
    monkeypatch.setenv("ATB_CUDA_NVRTC_PDL", "1")
    monkeypatch.setattr(nvrtc, "pdl_enabled", lambda: False)  # ATB_CUDA_PDL=0 or no Hopper GPU: never
    assert not nvrtc.pdl_on()


def _nvrtc_or_skip():
    try:
        nvrtc._library()
    except (OSError, ValueError) as exc:
        pytest.skip(f"no NVRTC library here: {exc}")


# memory instructions that may touch global memory (generic addresses included); shared / local / param are private
_MEM = re.compile(r"^\s*(?:@!?%\w+\s+)?(ld|st|atom|red|cp\.async|cp\.reduce|prefetch)(\.[\w:]+)*\s")
_PRIVATE = (".shared", ".local", ".param", ".const")


def _entries(ptx: str):
    """{entry name: its body} of a PTX module."""
    out = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\(", ptx):
        start = ptx.index("{", ptx.index(")", m.end()))
        out[m.group(1)] = ptx[start:_braced(ptx, start + 1)]
    return out


def _template_args(name):
    return [a.strip() for a in name[name.index("<") + 1:-1].split(",")]


@pytest.mark.parametrize("module", CUDA_C)
def test_ptx_waits_before_any_global_access(module):
    """Every instance of every kernel (the PTX of the whole program: also a compile check of all of them)."""
    _nvrtc_or_skip()
    prog = _programs()[module]
    ptx, lowered = nvrtc.compile_ptx(prog.source, prog.filename, prog.names, "compute_90" + prog.arch_suffix)
    entries = _entries(ptx)
    assert len(prog.names) == len(lowered) and prog.names
    for name in prog.names:
        body = entries[lowered[name]].splitlines()
        waits = [i for i, ln in enumerate(body) if ln.strip().startswith("griddepcontrol.wait")]
        assert len(waits) == 1, f"{name}: {len(waits)} waits"
        early = [i for i, ln in enumerate(body) if ln.strip().startswith("griddepcontrol.launch_dependents")]
        assert len(early) == 1 and early[0] > waits[0], name
        before = [ln.strip() for ln in body[:waits[0]] if _MEM.match(ln)]
        before = [ln for ln in before if not any(p in ln.split()[0] for p in _PRIVATE)]
        if module == "fp8_gemv" and _template_args(name)[4] == "true":  # PRE: weights (+ scales), read-only, first
            assert before and all(ln.split()[0].startswith("ld.global.nc") for ln in before), (name, before)
        else:
            assert not before, (name, before)


# ---- on the GPU: chains captured with PDL equal the same chains without it --------------------------------------

def _early(monkeypatch, early: str):
    """The chain's CUDA C kernels with (1: as launched by default, the FP4 MoE ones without) or without (0) the early
    launch of the next kernel (``pdl_early``; the Triton kernels keep theirs, a constant of their build)."""
    if early == "0":
        monkeypatch.setattr(nvrtc, "_pdl_early", lambda: False)


def _norm():
    import atb_ops

    return atb_ops.implementations("rms_norm")["cuda"]


@pytest.mark.cuda
@pytest.mark.parametrize("kind,cfg", [("bf16", "ctas=1"), ("bf16", "ctas=64"), ("f16", "ctas=1"), ("f16", "ctas=64")])
def test_fp4_moe_chain_in_cuda_graph_equals_plain(monkeypatch, kind, cfg):
    """12 dependent launches of the FP4 MoE kernel, each reading the Triton RMSNorm's output (PDL, early launch)
    of the previous one's; ``ctas=1``: unsplit, ``ctas=64``: K split over blocks, partials added by the last to
    arrive (arrival counters shared with the other split kernels)."""
    from atb_ops.cuda import fp4_moe_f16 as ff
    from atb_ops.cuda import fp4_moe_mma as fm
    from test_gemm_decode import _ids, _weights

    mod = {"bf16": fm, "f16": ff}[kind]
    assert mod.available(torch.device("cuda")), mod.PROGRAM.error
    monkeypatch.setenv("ATB_CUDA_FP4_MMA_CFG", cfg)
    g = torch.Generator().manual_seed(5)
    w, s = _weights("fp4", 16, 1024, 1024, g)
    m = 24
    ids = _ids(m, 16, g).cuda()
    x = torch.randn(m, 1024, generator=g).cuda().bfloat16()
    norm = _norm()
    assert (fm.launch_plan(x, w, ids).split > 1) == (cfg == "ctas=64")  # (the plan both kernels launch by)

    def chain():
        y = x
        for _ in range(12):
            y = mod.grouped_matmul(norm(y, None, 1e-6), w, ids, s)
        return y

    gen = torch.Generator(device="cuda").manual_seed(1)
    assert_pdl_graph_equals_plain(chain, lambda: x.copy_(torch.randn(m, 1024, device="cuda", generator=gen)),
                                  monkeypatch)


@pytest.mark.cuda
@pytest.mark.skipif(not HOPPER, reason="wgmma needs compute capability 9.0")
@pytest.mark.parametrize("early", ["1", "0"])
@pytest.mark.parametrize("impl", ["wgmma", "seesaw"])
@pytest.mark.parametrize("t", [8, 128])
def test_attention_chain_in_cuda_graph_equals_plain(monkeypatch, impl, t, early):
    """8 dependent sparse-attention calls (T = 8: split key lists and the merge after the kernel; T = 128: unsplit),
    each query the RMSNorm of the previous output."""
    import atb_ops

    monkeypatch.setenv("ATB_CUDA_ATTN_IMPL", impl)
    _early(monkeypatch, early)
    att = atb_ops.implementations("sparse_attention")["cuda"]
    g = torch.Generator().manual_seed(t)
    q = torch.randn(t, 64, 512, generator=g).cuda().bfloat16()
    kv = torch.randn(700, 512, generator=g).cuda().bfloat16()
    ent = torch.randn(600, 512, generator=g).cuda().bfloat16()
    idx = torch.randint(0, 700, (t, 128), generator=g).int().cuda()
    ex = torch.randint(0, 600, (t, 512), generator=g).int().cuda()
    sink = torch.randn(64, generator=g).cuda()
    norm = _norm()

    def chain():
        y = q
        for _ in range(8):
            y = att(norm(y, None, 1e-6), kv, idx, sink, 0.05, ent, ex)
        return y

    gen = torch.Generator(device="cuda").manual_seed(2)
    assert_pdl_graph_equals_plain(chain, lambda: q.copy_(torch.randn(t, 64, 512, device="cuda", generator=gen)),
                                  monkeypatch)


@pytest.mark.cuda
@pytest.mark.parametrize("early", ["1", "0"])
def test_indexer_topk_chain_in_cuda_graph_equals_plain(monkeypatch, early):
    """8 indexer calls on the radix path (the score kernel, PDL with early launch, then topk_radix reading its keys
    and histograms), each query the previous query's RMSNorm plus a term of the previous selection."""
    import atb_ops
    from atb_ops.cuda import topk_radix

    monkeypatch.setenv("ATB_CUDA_INDEXER", "radix")
    _early(monkeypatch, early)
    op = atb_ops.implementations("indexer_topk")["cuda"]
    g = torch.Generator().manual_seed(9)
    t, n, heads, d = 4, 4096, 64, 128
    q = torch.randn(t, heads, d, generator=g).cuda().bfloat16()
    w = torch.randn(t, heads, generator=g).cuda()
    kc = torch.randn(n, d, generator=g).cuda().bfloat16()
    cand = torch.stack([torch.randperm(n, generator=g) for _ in range(t)]).cuda()
    cand[:, -100:] = -1  # the unfilled tail of a short context
    norm = _norm()
    assert topk_radix.eligible(cand, 512), topk_radix.PROGRAM.error

    def chain():
        y, s = q, None
        for _ in range(8):
            y = norm(y, None, 1e-6) if s is None else norm(y + (s[:, :1, None] % 7).bfloat16(), None, 1e-6)
            s = op(y, w, kc, cand, 512)
        return s

    gen = torch.Generator(device="cuda").manual_seed(3)
    assert_pdl_graph_equals_plain(chain, lambda: q.copy_(torch.randn(t, heads, d, device="cuda", generator=gen)),
                                  monkeypatch)
