"""Programmatic dependent launch (atb_ops/cuda/_util.py: ``pdl`` / ``pdl_wait``).

A kernel launched with PDL may start before the previous kernel in the stream has finished; it is correct only if
it waits (``pdl_wait(PDL)``) before it touches memory. These tests read the sources: every Triton kernel launched in
atb_ops/cuda passes ``**pdl()`` (the PDL switch and ``launch_pdl`` together), has the PDL parameter, and waits as its
first statement. On a GPU, a chain of dependent launches replayed from a CUDA graph with PDL equals the same chain
without it.
"""

from __future__ import annotations

import ast
import glob
import importlib
import inspect
import os
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from atb_ops.cuda import _util  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULES = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(ROOT, "atb_ops/cuda/*.py")))


def _launches():
    """(module name, kernel expression, has **pdl()) for every ``kernel[grid](...)`` call in atb_ops/cuda."""
    out = []
    for name in MODULES:
        tree = ast.parse(open(os.path.join(ROOT, "atb_ops/cuda", name + ".py")).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                target = node.func.value
                if not (isinstance(target, (ast.Name, ast.Attribute)) and ast.unparse(target).endswith("kernel")):
                    continue
                has = any(k.arg is None and isinstance(k.value, ast.Call) and ast.unparse(k.value.func) == "pdl"
                          for k in node.keywords)
                out.append((name, ast.unparse(target), has))
    return out


def _resolve(module, expr):
    obj = importlib.import_module(f"atb_ops.cuda.{module}")
    for part in expr.split("."):
        obj = getattr(obj, part)
    return obj


def test_every_launch_passes_pdl_to_a_kernel_that_waits_first():
    launches = _launches()
    assert len(launches) >= 40  # the scan found the launch sites
    for module, expr, has in launches:
        assert has, f"atb_ops/cuda/{module}.py: {expr}[...](...) does not pass **pdl()"
        fn = _resolve(module, expr).fn  # the Python function of the JITFunction (or the interpreter's wrapper)
        assert "PDL" in inspect.signature(fn).parameters, f"{expr} has no PDL parameter"
        body = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        assert ast.unparse(body[0]) == "pdl_wait(PDL)", f"{expr}: the first statement is not pdl_wait(PDL)"


def test_pdl_switch(monkeypatch):
    monkeypatch.setenv("ATB_CUDA_PDL", "0")
    assert _util.pdl() == {} and not _util.pdl_enabled()
    monkeypatch.setenv("ATB_CUDA_PDL", "yes")
    with pytest.raises(ValueError, match="ATB_CUDA_PDL"):
        _util.pdl()
    monkeypatch.setenv("ATB_CUDA_PDL", "1")
    if _util.INTERPRET or not torch.cuda.is_available():
        assert _util.pdl() == {}  # the interpreter and CPU-only machines never use it
    else:
        on = torch.cuda.get_device_capability()[0] >= 9
        assert _util.pdl() == ({"PDL": True, "launch_pdl": True} if on else {})


def test_pdl_on_by_default(monkeypatch):
    """``ATB_CUDA_PDL`` unset or 1: every launch site uses PDL (where it can run at all: here made to look like a
    Hopper GPU with Triton's gdc_wait); 0: none; an older GPU or a torch without CUDA: never."""
    monkeypatch.setattr(_util, "INTERPRET", False)
    monkeypatch.setattr(_util, "_gdc_wait", lambda: None)
    monkeypatch.setattr(_util, "_PDL_DEVICE", {0: True})
    monkeypatch.setattr(_util, "_CUDA", [True])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    on = {"PDL": True, "launch_pdl": True}
    monkeypatch.delenv("ATB_CUDA_PDL", raising=False)
    assert _util.pdl() == on
    monkeypatch.setattr(_util, "_CUDA", [False])  # a CPU-only torch: off, and no CUDA call (it would raise)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1 / 0)
    assert _util.pdl() == {}
    monkeypatch.setattr(_util, "_CUDA", [True])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("ATB_CUDA_PDL", "0")
    assert _util.pdl() == {}
    monkeypatch.setenv("ATB_CUDA_PDL", "1")
    assert _util.pdl() == on
    monkeypatch.setattr(_util, "_PDL_DEVICE", {0: False})  # an older GPU: never
    assert _util.pdl() == {}


_PTX_SCRIPT = r"""
import sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from atb_ops.cuda import _util

if _util._gdc_wait is None or _util._gdc_launch is None:
    print("SKIP this Triton has no griddepcontrol intrinsics")
    sys.exit(0)


@triton.jit
def kernel(x_ptr, PDL: tl.constexpr):
    _util.pdl_wait(PDL)
    tl.store(x_ptr, tl.load(x_ptr) + 1.0)


for pdl in (True, False):
    try:
        c = triton.compile(ASTSource(fn=kernel, signature={"x_ptr": "*fp32", "PDL": "constexpr"},
                                     constexprs={"PDL": pdl}), target=GPUTarget("cuda", 90, 32))
    except Exception as exc:  # a Triton without its NVIDIA backend / ptxas on this machine
        print(f"SKIP cannot compile for sm_90 here: {type(exc).__name__}: {exc}")
        sys.exit(0)
    print(f"=== PDL={pdl}")
    print(c.asm["ptx"])
"""


@pytest.mark.parametrize("early", ["1", "0"])
def test_pdl_wait_then_early_launch_in_ptx(early, tmp_path):
    # compiled for sm_90 by Triton's own toolchain (no GPU needed; a subprocess, since this suite runs Triton's
    # interpreter): with PDL the kernel waits (griddepcontrol.wait) before its first load and, by default, lets its
    # dependents launch right after (griddepcontrol.launch_dependents); ATB_CUDA_PDL_EARLY=0 keeps only the wait;
    # without PDL, neither
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0", ATB_CUDA_PDL_EARLY=early, PYTHONPATH=ROOT)
    script = tmp_path / "pdl_ptx.py"  # a file: Triton reads a kernel's source from it
    script.write_text(_PTX_SCRIPT)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    if run.stdout.startswith("SKIP"):
        pytest.skip(run.stdout[5:].strip())
    on, off = run.stdout.split("=== PDL=False")
    lines = [ln.strip() for ln in on.splitlines()]
    wait = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait")]
    launch = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.launch_dependents")]
    load = [i for i, ln in enumerate(lines) if ln.startswith("ld.global")]
    assert len(wait) == 1 and load and wait[0] < load[0]
    assert len(launch) == (early == "1") and (early == "0" or wait[0] < launch[0] < load[0])
    assert "griddepcontrol" not in off


@pytest.mark.cuda
def test_pdl_chain_in_cuda_graph_equals_plain(monkeypatch):
    # 64 dependent launches of the norm kernel (each reads what the previous launch wrote; half of them follow the
    # previous norm directly), captured with PDL and replayed on new inputs: a read before the predecessor finished
    # would change the bits against the same chain launched eagerly without PDL
    import atb_ops

    norm = atb_ops.implementations("rms_norm")["cuda"]
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(4096, device="cuda", generator=g)
    x = torch.randn(64, 4096, device="cuda", generator=g)

    def chain():
        y = x
        for _ in range(32):
            y = norm(y, w, 1e-6) * 1.5 + x
            y = norm(y, None, 1e-6)
        return y

    assert_pdl_graph_equals_plain(chain, lambda: x.copy_(torch.randn(64, 4096, device="cuda", generator=g)),
                                  monkeypatch)


def assert_pdl_graph_equals_plain(chain, new_input, monkeypatch, replays: int = 3):
    """``chain()`` captured in a CUDA graph with PDL on, then ``replays`` times: ``new_input()`` refills the chain's
    static input, the graph replays, and its output must equal the same chain launched eagerly with PDL off (a read
    before the predecessor finished would change the bits)."""
    monkeypatch.setenv("ATB_CUDA_PDL", "1")
    chain()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    monkeypatch.setenv("ATB_CUDA_PDL", "0")
    for _ in range(replays):
        new_input()
        graph.replay()
        assert torch.equal(out, chain())
