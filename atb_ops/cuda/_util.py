"""Small helpers shared by the Triton kernel modules."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

try:  # programmatic dependent launch (present in Triton 3.6 and 3.9; sm_90+); without it, kernels launch as before
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
except ImportError:  # pragma: no cover - older Triton
    _gdc_wait = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch
except ImportError:  # pragma: no cover - older Triton
    _gdc_launch = None


def env_choice(var: str, default: str, choices: tuple[str, ...]) -> str:
    """The value of the path switch ``var`` (``default`` when unset or empty); one outside ``choices`` is a ValueError
    naming the variable and what it takes (a typo must not quietly pick another kernel)."""
    v = os.environ.get(var, "") or default
    if v not in choices:
        raise ValueError(f"{var}={v!r}: expected one of {', '.join(choices)}")
    return v


def env_overrides(var: str, cfg: dict, choices: dict | None = None) -> dict:
    """Apply the benchmark override ``var="key=value,..."`` (integers) to the kernel settings ``cfg`` in place and
    return it. An entry that is not ``key=integer``, a key ``cfg`` does not have, or a value outside ``choices[key]``
    (the keys that pick code paths, where any other value would run a wrong one) is a ValueError naming the
    variable, the entry and what it takes."""
    choices = choices or {}
    for kv in filter(None, (t.strip() for t in os.environ.get(var, "").split(","))):
        key, sep, val = (t.strip() for t in kv.partition("="))
        try:
            v = int(val)
        except ValueError:
            v = None
        if not sep or key not in cfg or v is None or (key in choices and v not in choices[key]):
            takes = ", ".join(f"{k}={'|'.join(map(str, choices[k]))}" if k in choices else f"{k}=<int>" for k in cfg)
            raise ValueError(f"{var}: {kv!r} is not one of {takes}")
        cfg[key] = v
    return cfg


def pow2(n: int, lo: int = 1) -> int:
    """The smallest power of two >= max(n, lo)."""
    return max(lo, triton.next_power_of_2(max(int(n), 1)))


def tl_dtype(dtype: torch.dtype):
    """The triton element type of a torch float dtype (for in-kernel casts)."""
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def dot_precision(*dtypes: torch.dtype) -> str:
    """``ieee`` when any operand is float32 (exact float32 products, matching the reference numerics),
    else ``tf32`` (ignored for 16-bit operands, which multiply exactly into the float32 accumulator)."""
    return "ieee" if torch.float32 in dtypes else "tf32"


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a fixed 8 on the CPU interpreter)."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


# Triton's CPU interpreter multiplies 16-bit dot operands wrongly (seen with triton 3.6 and 3.9): there,
# dots run on float32 copies of the operands (exact for bf16/fp16 inputs, so the results are unchanged).
DOT_F32 = tl.constexpr(INTERPRET)


@triton.jit
def mma(a, b, PREC: tl.constexpr):
    """tl.dot(a, b) with float32 accumulation (float32 operands under the interpreter)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


# ------------------------------------------------------------------------------------ programmatic dependent launch
# A CUDA graph (or stream) starts kernel B once kernel A has completed and its writes are flushed; B's launch and
# its programs' set-up then sit between the two. With programmatic dependent launch (PDL, sm_90+) B is launched as
# A's programs exit and waits, first thing, on ``griddepcontrol.wait`` (which returns once A has completed and its
# writes are visible), so that gap overlaps A's tail. Measured on an H200 (scripts/bench_results/h200_session19.txt,
# a graph of 128 dependent launches): 1.28 -> 0.84 us a launch for 0.5 MB kernels, 3.61 -> 3.21 us for 8.7 MB ones.
# Correctness rests on every kernel launched with PDL waiting before it reads or writes anything: the wait is the
# kernel's first statement (``pdl_wait(PDL)``, tests/ops/test_pdl.py checks each kernel) and both the wait and the
# launch attribute come from one dict, :func:`pdl`. A kernel that waits, completes after its predecessor, so the
# order is transitive along the stream; kernels launched without PDL (torch's) wait as always. The CUDA C kernels
# (NVRTC) wait the same way since session 39 (:func:`.nvrtc.launch`; the FP4 MoE ones without the early launch below).
# Right after its wait, a kernel lets its own dependents launch (``griddepcontrol.launch_dependents``): the next
# PDL kernel's programs become resident while this one still runs and sit in their own wait, so the next launch is
# off the critical path entirely instead of overlapping only this kernel's tail. (Issuing it was measured slower in
# session 19 on a synthetic chain of multi-wave copies, 3.61 -> 5.63 us a launch; in the decode step it is faster.)
# On by default since session 35, every launch site (``ATB_CUDA_PDL=0`` turns it off; ``ATB_CUDA_PDL_EARLY=0`` keeps
# the waits and drops the early launch): the FP8 + FP4 decode step of scripts/bench_decode.py (H200, graph replay,
# Flash-shaped 3 layers, ctx 2048; default and PDL alternated three times in one call,
# scripts/bench_results/h200_session35.txt) at batch 1 / 8 / 32 / 64 0.81-0.82 / 1.06-1.08 / 1.51-1.52 / 1.80-1.81 ->
# 0.78 / 1.04 / 1.48-1.49 / 1.80-1.81 ms. PDL without the early launch had not moved the step (session 19: batch 8
# 1.15 / 1.16 ms; session 35: 1.09 against 1.08), most launches following a torch op, a CUDA C kernel or another
# stream's event rather than a Triton kernel. The wgmma attention's split merge had it by default since session 28
# (h200_session28.txt, call 13: 0.3-1.0 us of 13-27 us a call at T = 8-64).
PDL_EARLY = tl.constexpr(env_choice("ATB_CUDA_PDL_EARLY", "1", ("0", "1")) == "1" and _gdc_launch is not None)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """The first statement of every kernel launched with :func:`pdl`: with PDL, wait until the previous kernel in the
    stream has completed and its writes are visible, then let the next kernel's programs launch (they wait in turn);
    nothing without."""
    if PDL:
        _gdc_wait()
        if PDL_EARLY:
            _gdc_launch()


_PDL_DEVICE: dict = {}  # device index -> compute capability >= 9.0
_CUDA: list = []  # [torch.cuda.is_available()], asked once (a CPU-only torch: no PDL, no CUDA call)


def _cuda_available() -> bool:
    if not _CUDA:
        _CUDA.append(torch.cuda.is_available())
    return _CUDA[0]


def pdl_enabled() -> bool:
    """Whether a launch uses PDL: ``ATB_CUDA_PDL`` unset or 1 (``=0``: never), a CUDA device of compute capability
    >= 9.0 (Hopper) current, not the CPU interpreter, and a Triton that has ``gdc_wait``."""
    v = os.environ.get("ATB_CUDA_PDL")
    if v not in (None, "0", "1"):
        raise ValueError(f"ATB_CUDA_PDL={v!r}: expected 0 or 1")
    if v == "0" or INTERPRET or _gdc_wait is None or not _cuda_available():
        return False
    dev = torch.cuda.current_device()
    ok = _PDL_DEVICE.get(dev)
    if ok is None:
        ok = _PDL_DEVICE[dev] = torch.cuda.get_device_capability(dev)[0] >= 9
    return ok


def pdl() -> dict:
    """Launch keywords of a kernel that starts with ``pdl_wait(PDL)``: the kernel's PDL switch and Triton's
    ``launch_pdl`` together (both or neither), ``{}`` where PDL is off (:func:`pdl_enabled`)."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled() else {}
