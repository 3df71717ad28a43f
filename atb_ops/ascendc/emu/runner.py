"""ctypes bridge to the emulated AscendC kernels: tiling, launch, and the UB peak the emulation measured.

``run_compressor`` / ``run_mla`` take torch CPU tensors, compute the host tiling (the same C++ function the CANN
binding uses), launch the kernel over every block index and return the output with the tiling and the UB bytes
the kernel reserved (the emulation raises :class:`EmuKernelError` if that ever exceeds the SoC's UB).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from . import build

# mirrors dsv4::Soc() in kernels/tiling.h
SOCS = {"ascend910b2": 0, "ascend910b4": 1, "ascend910c": 2}
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_U32 = ctypes.c_uint32


class EmuKernelError(RuntimeError):
    """An emulation check failed inside a kernel (UB overflow, misaligned copy, out-of-bounds access, ...)."""


class CompressorTiling(ctypes.Structure):
    _fields_ = [(n, _U32) for n in ("numEntries", "numCand", "numRows", "width", "c", "half", "overlap", "cTile", "nCTiles",
                                    "numItems", "blockDim", "dtype", "ubBytes", "socUb", "epilogue", "ropeDim")] + [
        ("eps", ctypes.c_float)]


class MlaTiling(ctypes.Structure):
    _fields_ = [(n, _U32) for n in ("numTokens", "numHeads", "dimC", "dimR", "numIdx0", "numIdx1", "rows0", "rows1", "hasSink",
                                    "headGroup", "numGroups", "blockRows", "idxChunk", "numItems", "blockDim", "qDtype",
                                    "kvDtype", "ubBytes", "socUb")] + [("scale", ctypes.c_float)]


@dataclass
class Launch:
    out: torch.Tensor
    tiling: ctypes.Structure
    ub_peak: int  # UB bytes reserved by the kernel's InitBuffer calls, as the emulation measured them


def default_soc() -> str:
    soc = os.environ.get("ASCEND_DSV4_ASCENDC_SOC", "ascend910b2")
    if soc not in SOCS:
        raise ValueError(f"ASCEND_DSV4_ASCENDC_SOC={soc!r}: expected one of {', '.join(SOCS)}")
    return soc


def _lib() -> ctypes.CDLL:
    lib = build.load()
    if not getattr(lib, "_dsv4_typed", False):
        p, u = ctypes.c_void_p, _U32
        lib.dsv4_emu_last_error.restype = ctypes.c_char_p
        lib.dsv4_emu_last_ub_peak.restype = u
        lib.dsv4_emu_tiling_sizes.restype = u
        lib.dsv4_emu_tiling_sizes.argtypes = [u]
        lib.dsv4_emu_compressor_tiling.argtypes = [u] * 11 + [ctypes.c_float, ctypes.POINTER(CompressorTiling)]
        lib.dsv4_emu_mla_tiling.argtypes = [u] * 9 + [ctypes.c_float] + [u] * 6 + [ctypes.POINTER(MlaTiling)]
        lib.dsv4_emu_compressor.argtypes = [p] * 7 + [ctypes.POINTER(CompressorTiling)]
        lib.dsv4_emu_mla_decode.argtypes = [p] * 8 + [ctypes.POINTER(MlaTiling)]
        lib.dsv4_emu_mla_cube_tiling.argtypes = lib.dsv4_emu_mla_tiling.argtypes
        lib.dsv4_emu_mla_decode_cube.argtypes = lib.dsv4_emu_mla_decode.argtypes
        lib.dsv4_emu_selftest.argtypes = [ctypes.c_int]
        for f in ("dsv4_emu_selftest", "dsv4_emu_compressor_tiling", "dsv4_emu_mla_tiling", "dsv4_emu_compressor",
                  "dsv4_emu_mla_decode", "dsv4_emu_mla_cube_tiling", "dsv4_emu_mla_decode_cube"):
            getattr(lib, f).restype = ctypes.c_int
        if lib.dsv4_emu_tiling_sizes(0) != ctypes.sizeof(CompressorTiling) or lib.dsv4_emu_tiling_sizes(1) != ctypes.sizeof(MlaTiling):
            raise build.EmuBuildError("tiling struct layout differs between kernels/tiling_data.h and emu/runner.py")
        lib._dsv4_typed = True
    return lib


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        raise EmuKernelError(f"{what}: {lib.dsv4_emu_last_error().decode()}")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None or t.numel() == 0 else t.data_ptr()


def selftest(which: int) -> str | None:
    """Run deliberately wrong API use number ``which`` (emu/selftest_emu.cpp): the emulation's message, or None."""
    lib = _lib()
    return lib.dsv4_emu_last_error().decode() if lib.dsv4_emu_selftest(which) else None


def compressor_tiling(M: int, K: int, S: int, W: int, overlap: bool, dtype: torch.dtype, soc: str | None = None,
                      force_ctile: int = 0, force_ub: int = 0, rope_dim: int | None = None, eps: float = 0.0) -> CompressorTiling:
    """``rope_dim`` not None selects the fused RMSNorm + RoPE epilogue."""
    lib, t = _lib(), CompressorTiling()
    rc = lib.dsv4_emu_compressor_tiling(M, K, S, W, int(overlap), DTYPES[dtype], SOCS[soc or default_soc()], force_ctile,
                                        force_ub, int(rope_dim is not None), rope_dim or 0, float(eps), ctypes.byref(t))
    _check(lib, rc, "compressor tiling")
    return t


def cube_supported(C: int, R: int) -> bool:
    """Whether the cube variant of the attention kernel takes these channel dims (multiples of 16)."""
    return C > 0 and C % 16 == 0 and R % 16 == 0


def mla_tiling(T: int, H: int, C: int, R: int, L0: int, L1: int, P0: int, P1: int, has_sink: bool, scale: float,
               q_dtype: torch.dtype, kv_dtype: torch.dtype, soc: str | None = None, force_hg: int = 0, force_nb: int = 0,
               force_ub: int = 0, cube: bool = False) -> MlaTiling:
    lib, t = _lib(), MlaTiling()
    fn = lib.dsv4_emu_mla_cube_tiling if cube else lib.dsv4_emu_mla_tiling
    rc = fn(T, H, C, R, L0, L1, P0, P1, int(has_sink), float(scale), DTYPES[q_dtype], DTYPES[kv_dtype],
                                 SOCS[soc or default_soc()], force_hg, force_nb, force_ub, ctypes.byref(t))
    _check(lib, rc, "mla tiling")
    return t


def run_compressor(kv: torch.Tensor, score: torch.Tensor, cand: torch.Tensor, overlap: bool,
                   norm_weight: torch.Tensor | None = None, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                   eps: float = 0.0, **tiling_kw) -> Launch:
    """kv, score: [S, W] contiguous float32 / bfloat16 (same dtype); cand: [M, K] int64 contiguous, rows < S.
    With ``norm_weight`` ([c] float32) the fused epilogue runs: RMSNorm(eps) then RoPE with cos / sin [M, R/2] float32."""
    (S, W), (M, K) = kv.shape, cand.shape
    rope_dim = None if norm_weight is None else (0 if cos is None else 2 * cos.shape[-1])
    t = compressor_tiling(M, K, S, W, overlap, kv.dtype, rope_dim=rope_dim, eps=eps, **tiling_kw)
    out = torch.empty(M, t.c, dtype=torch.float32)
    lib = _lib()
    rc = lib.dsv4_emu_compressor(_ptr(kv), _ptr(score), _ptr(cand), _ptr(norm_weight), _ptr(cos), _ptr(sin), _ptr(out),
                                 ctypes.byref(t))
    _check(lib, rc, "compressor kernel")
    return Launch(out, t, lib.dsv4_emu_last_ub_peak())


def run_mla(q: torch.Tensor, qpe: torch.Tensor | None, pool0: torch.Tensor, idx0: torch.Tensor, pool1: torch.Tensor | None,
            idx1: torch.Tensor | None, sink: torch.Tensor | None, scale: float, cube: bool = False, **tiling_kw) -> Launch:
    """q: [T, H, C], qpe: [T, H, R] or None (same dtype as q); pools [P, C + R] (one dtype); idx int64 [T, L];
    sink [H] float32 or None. All contiguous CPU tensors, indices < their pool's rows. ``cube`` runs the Matmul-API
    variant (dsv4_mla_decode_cube; C and R multiples of 16)."""
    T, H, C = q.shape
    R = 0 if qpe is None else qpe.shape[-1]
    L1 = 0 if idx1 is None else idx1.shape[-1]
    P1 = 0 if pool1 is None else pool1.shape[0]
    t = mla_tiling(T, H, C, R, idx0.shape[-1], L1, pool0.shape[0], P1, sink is not None, scale, q.dtype, pool0.dtype,
                   cube=cube, **tiling_kw)
    out = torch.empty(T, H, C, dtype=q.dtype)
    lib = _lib()
    rc = (lib.dsv4_emu_mla_decode_cube if cube else lib.dsv4_emu_mla_decode)(_ptr(q), _ptr(qpe), _ptr(pool0), _ptr(idx0), _ptr(pool1) if L1 else None,
                                 _ptr(idx1) if L1 else None, _ptr(sink), _ptr(out), ctypes.byref(t))
    _check(lib, rc, "mla_decode kernel")
    return Launch(out, t, lib.dsv4_emu_last_ub_peak())
