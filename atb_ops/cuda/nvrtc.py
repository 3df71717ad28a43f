"""CUDA C kernels built at first use by NVRTC, the runtime compiler that torch's CUDA wheels ship (no CUDA toolkit
needed), cached on disk and loaded through torch's own module loader (``torch.cuda._utils._cuda_load_module``).

Used by the hand-written kernels (:mod:`.fp4_moe_mma`, :mod:`.fp4_moe_f16`, :mod:`.topk_radix`, :mod:`.attention_wgmma`,
the last built for sm_90a: ``arch_suffix``). Each module keeps one
:class:`Program`: its source, the template instances to build (C++ name expressions) and a file name for NVRTC's
messages. A build failure is kept (``Program.error``) and the caller's Triton path serves from then on.

Kernel arguments go through the loader's call: tensors as pointers, Python ints as 32-bit ``int``, Python floats as
``double``. A kernel parameter of another type (``float``, ``long long``) would read the wrong bytes: declare them
as ``int`` / ``double`` (session 25's first attention kernel read its float scale as garbage).

Measured on these kernels (H200, scripts/bench_results/h200_session26.txt), worth applying to the next: outputs held
in MMA accumulator fragments go out through shared memory as 16-byte, row-contiguous stores (attention_wgmma's 4-byte
fragment stores, 8 rows a warp instruction, cost ~6 of its 41 us); a producer warpgroup that copies into stages
released by mbarriers beat copies issued by the compute warps behind a CTA barrier. CUDA's ``compute-sanitizer``
(racecheck, synccheck, memcheck) runs on them as on any kernel: ``--kernel-name kns=<name>`` selects one.

:func:`launch` starts every one of them, with programmatic dependent launch where it is on (:func:`launch_pdl`:
``cuLaunchKernelEx`` through ctypes, torch's loader taking no launch attributes): each kernel's first statement is
``pdl_wait(pdl_early)`` (:data:`PDL_DEVICE`). :mod:`.fp8_gemv` since session 38; the MoE, attention and top-k kernels
since session 39 (before, each broke the chain of PDL launches on both sides). The FP4 MoE kernels launch theirs
without the early launch of the next kernel: with it the FP8 + FP4 decode step was 0.5-1 % slower at batch 32-64
(H200, scripts/bench_results/h200_session39.txt). A block launched early becomes resident wherever the kernel before
it leaves room, several to an SM if they fit: :mod:`.topk_radix` (issue-bound, one block a token) reserves shared
memory so that its blocks stay one an SM (:func:`.topk_radix.one_block_per_sm`).

Cache: ``$ATB_CUDA_CACHE_DIR`` or ``~/.cache/ascend_dsv4``, one cubin + one JSON of lowered names per (source,
architecture, torch's CUDA version, instance list); a cache that cannot be written costs a rebuild next time.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import json
import os

import torch

from ._util import PDL_EARLY, env_choice, pdl_enabled


def _library() -> ctypes.CDLL:
    """NVRTC of torch's CUDA major version (a CPU-only torch: 13 or 12, for the PTX checks of the tests), from the
    loader's path or the pip CUDA wheels (nvidia/*/lib)."""
    majors = [int(str(torch.version.cuda).split(".")[0])] if torch.version.cuda else [13, 12]
    names = [f"libnvrtc.so.{m}" for m in majors] + ["libnvrtc.so"]
    try:
        import nvidia
    except ImportError:
        nvidia = None
    for root in getattr(nvidia, "__path__", []):
        for m in majors:
            names += sorted(glob.glob(os.path.join(root, "*", "lib", f"libnvrtc.so.{m}*")))
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("no NVRTC library (libnvrtc.so) found")


def compile_cubin(source: str, filename: str, names: list[str], arch: str) -> tuple[bytes, dict]:
    """One NVRTC program instantiating every name expression: (cubin, {name expression: lowered name}). A compile
    error is a RuntimeError carrying NVRTC's log (file name ``filename``)."""
    return _compile(source, filename, names, arch, ptx=False)


def compile_ptx(source: str, filename: str, names: list[str], arch: str) -> tuple[str, dict]:
    """As :func:`compile_cubin`, the PTX text instead (tests read the order of its instructions)."""
    text, lowered = _compile(source, filename, names, arch, ptx=True)
    return text.rstrip(b"\0").decode(), lowered


def _compile(source: str, filename: str, names: list[str], arch: str, ptx: bool) -> tuple[bytes, dict]:
    lib = _library()
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    prog = ctypes.c_void_p()

    def ok(res, what):
        if res != 0:
            raise RuntimeError(f"NVRTC {what} ({filename}): {lib.nvrtcGetErrorString(res)!r}")

    ok(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), filename.encode(), 0, None, None), "create")
    for name in names:
        ok(lib.nvrtcAddNameExpression(prog, name.encode()), "name")
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    res = lib.nvrtcCompileProgram(prog, len(opts), arr)
    if res != 0:
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"NVRTC compile of {filename} failed:\n{log.value.decode(errors='replace')}")
    size = ctypes.c_size_t()
    kind = "PTX" if ptx else "CUBIN"
    ok(getattr(lib, f"nvrtcGet{kind}Size")(prog, ctypes.byref(size)), f"{kind} size")
    binary = ctypes.create_string_buffer(size.value)
    ok(getattr(lib, f"nvrtcGet{kind}")(prog, binary), kind)
    lowered = {}
    for name in names:
        low = ctypes.c_char_p()
        ok(lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(low)), "lowered name")
        lowered[name] = low.value.decode()
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return binary.raw, lowered


# ---- programmatic dependent launch for a loaded kernel (cuLaunchKernelEx through ctypes; torch's loader has no
# launch attributes). The kernel itself must execute ``griddepcontrol.wait`` before it reads anything the previous
# kernel writes.
class _LaunchAttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("align", ctypes.c_void_p), ("value", ctypes.c_int)]


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttrValue)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig (CUDA driver API, cuda.h)
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("n_attrs", ctypes.c_uint)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def kernel_args(args: list) -> tuple:
    """(void* array, kept values) of a kernel's arguments packed as torch's module loader packs them: tensors as
    device pointers, Python ints as 32-bit ``int``, floats as ``double``."""
    keep = []
    for a in args:
        if isinstance(a, torch.Tensor):
            keep.append(ctypes.c_void_p(a.data_ptr()))
        elif isinstance(a, (int, float)):  # (a bool is an int, as for torch's loader)
            keep.append(ctypes.c_int(a) if isinstance(a, int) else ctypes.c_double(a))
        else:
            raise TypeError(f"unsupported kernel argument type: {type(a).__name__}")
    arr = (ctypes.c_void_p * max(1, len(keep)))()
    for i, v in enumerate(keep):
        arr[i] = ctypes.cast(ctypes.byref(v), ctypes.c_void_p)
    return arr, keep


# The device side of :func:`launch`: the first statement of every CUDA C kernel here (``pdl_wait(pdl_early)``, its
# last parameter), before it reads or writes anything a previous kernel may still touch (model parameters may be read
# before it: :mod:`.fp8_gemv` loads its first weight steps there).
PDL_DEVICE = r"""
// programmatic dependent launch (sm_90+): wait until the previous kernel in the stream has completed and its writes
// are visible (at once when this grid was launched without the attribute), then, with `early`, let the next kernel's
// blocks launch (they wait in turn)
__device__ __forceinline__ void pdl_wait(int early) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (early) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
"""


def pdl_on() -> bool:
    """Whether the CUDA C kernels launch with PDL: :func:`._util.pdl_enabled` (``ATB_CUDA_PDL``, a Hopper GPU) and
    ``ATB_CUDA_NVRTC_PDL`` unset or 1 (``0``: plain launches for them, the Triton kernels keeping theirs;
    benchmarks)."""
    return env_choice("ATB_CUDA_NVRTC_PDL", "1", ("0", "1")) == "1" and pdl_enabled()


def _pdl_early() -> bool:
    """``ATB_CUDA_PDL_EARLY`` (read once, with the Triton kernels' own constant)."""
    return bool(PDL_EARLY.value)


def launch(kernel, grid: tuple, block: tuple, args: list, shared_mem: int = 0, pdl: bool | None = None,
           early: bool = True) -> None:
    """Launch a loaded kernel whose last parameter is ``int pdl_early`` and whose first statement is
    ``pdl_wait(pdl_early)`` (:data:`PDL_DEVICE`): with programmatic dependent launch where :func:`pdl_on` (``pdl``
    overrides), ``pdl_early`` 1 -- the next kernel may launch right after this one's wait, as after a Triton kernel
    -- unless ``early`` is False or ``ATB_CUDA_PDL_EARLY=0``; else a plain launch (``pdl_early`` 0)."""
    on = pdl_on() if pdl is None else pdl
    args = list(args) + [int(on and early and _pdl_early())]
    if on:
        launch_pdl(kernel, grid, block, args, shared_mem)
    else:
        kernel(grid=grid, block=block, args=args, shared_mem=shared_mem)


def launch_pdl(kernel, grid: tuple, block: tuple, args: list, shared_mem: int = 0) -> None:
    """Launch a loaded kernel (torch's ``_CudaKernel``) on the current stream with the programmatic stream
    serialisation attribute (sm_90+): it may start while the previous kernel runs."""
    from torch.cuda._utils import _check_cuda, _get_gpu_runtime_library

    arr, _keep = kernel_args(args)
    attr = _LaunchAttr(id=PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value.value = 1
    cfg = _LaunchConfig(*grid, *block, shared_mem, torch.cuda.current_stream().cuda_stream, ctypes.pointer(attr), 1)
    _check_cuda(_get_gpu_runtime_library().cuLaunchKernelEx(ctypes.byref(cfg), kernel.func, arr, None))


class Program:
    """A CUDA C source and the template instances it is built for; kernels loaded once per device."""

    def __init__(self, source: str, filename: str, names: list[str], arch_suffix: str = ""):
        """``arch_suffix`` "a": built for the architecture-specific target (sm_90a: wgmma), which runs on that
        architecture only (see :meth:`available`'s ``max_cc``)."""
        self.source, self.filename, self.names = source, filename, list(names)
        self.arch_suffix = arch_suffix
        self.error: str | None = None  # the first build failure: callers take their Triton path from then on
        self._loaded: dict = {}

    def cache_path(self, arch: str) -> str:
        key = hashlib.sha256((self.source + arch + str(torch.version.cuda) + repr(self.names)).encode()).hexdigest()
        root = os.environ.get("ATB_CUDA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ascend_dsv4")
        return os.path.join(root, f"{os.path.splitext(self.filename)[0]}_{arch}_{key[:16]}")

    def _build(self, arch: str) -> tuple[bytes, dict]:
        path = self.cache_path(arch)
        try:
            with open(path + ".cubin", "rb") as f:
                cubin = f.read()
            with open(path + ".json") as f:
                return cubin, json.load(f)
        except (OSError, ValueError):
            pass
        cubin, lowered = compile_cubin(self.source, self.filename, self.names, arch)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}"
            with open(tmp + ".cubin", "wb") as f:
                f.write(cubin)
            with open(tmp + ".json", "w") as f:
                json.dump(lowered, f)
            os.replace(tmp + ".cubin", path + ".cubin")
            os.replace(tmp + ".json", path + ".json")
        except OSError:
            pass
        return cubin, lowered

    def kernels(self, device: torch.device) -> dict:
        """{name expression: kernel} on ``device``, built (or read from the cache) and loaded once per device."""
        key = str(device)
        if key not in self._loaded:
            from torch.cuda._utils import _cuda_load_module

            major, minor = torch.cuda.get_device_capability(device)
            cubin, lowered = self._build(f"sm_{major}{minor}{self.arch_suffix}")
            with torch.cuda.device(device):
                loaded = _cuda_load_module(cubin, list(lowered.values()))
            self._loaded[key] = {name: loaded[lowered[name]] for name in self.names}
        return self._loaded[key]

    def by_variant(self, device: torch.device, variants: list, name) -> dict:
        """{variant: kernel} on ``device`` for the instances ``name(*variant)`` (the mapping made once per device)."""
        key = ("by_variant", str(device))
        if key not in self._loaded:
            loaded = self.kernels(device)
            self._loaded[key] = {v: loaded[name(*v)] for v in variants}
        return self._loaded[key]

    def available(self, device: torch.device, min_cc: tuple[int, int] = (8, 0),
                  max_cc: tuple[int, int] = (99, 9)) -> bool:
        """Whether the kernels are loaded on ``device`` (compute capability ``min_cc`` .. ``max_cc``, NVRTC present).
        Built at the first ask outside CUDA-graph capture (under capture: not available until then); the first failure
        is kept in :attr:`error` and the answer is False from then on."""
        if device.type != "cuda" or self.error:
            return False
        if str(device) in self._loaded:
            return True
        cc = torch.cuda.get_device_capability(device)
        if not min_cc <= cc <= max_cc or torch.cuda.is_current_stream_capturing():
            return False
        try:
            self.kernels(device)
        except Exception as exc:  # noqa: BLE001 -- any build failure means: use the Triton path
            self.error = f"{type(exc).__name__}: {exc}"
            return False
        return True
