"""Compile the AscendC kernel sources against our host emulation into a shared library, once per source version.

The library is keyed by a hash of every source file, the compiler's version and the flags, and cached in
``$ASCEND_DSV4_ASCENDC_EMU_CACHE`` or else ``$XDG_CACHE_HOME/ascend_dsv4/ascendc_emu`` (``~/.cache/...``); when that
is not writable, a per-user folder under the system temp dir. A CI run therefore compiles once (about 5 s with
g++ -O2) and every later test or process loads the cached file. The write is atomic (compile to a temp name, then
rename), so concurrent processes at worst compile twice.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
SRC_DIRS = (HERE, os.path.join(os.path.dirname(HERE), "kernels"))
ENTRY = os.path.join(HERE, "launch_emu.cpp")
FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


class EmuBuildError(RuntimeError):
    """The host compiler is missing or rejected the kernel sources."""


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise EmuBuildError("ascendc_emu needs a C++17 compiler: no $CXX, g++ or c++ on PATH")
    return cxx


def _sources() -> list[str]:
    files = []
    for d in SRC_DIRS:
        files += [os.path.join(d, f) for f in sorted(os.listdir(d)) if f.endswith((".h", ".cpp"))]
    return files


def source_hash(cxx: str | None = None) -> str:
    """Hash of the kernel + emulation sources, the compiler identity and the flags (the cache key)."""
    cxx = cxx or _compiler()
    h = hashlib.sha256()
    for f in _sources():
        h.update(os.path.basename(f).encode())
        with open(f, "rb") as fh:
            h.update(fh.read())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    h.update(version.encode())
    h.update(" ".join(FLAGS).encode())
    return h.hexdigest()[:20]


def cache_dir() -> str:
    """The folder holding compiled libraries (created if needed)."""
    candidates = []
    if os.environ.get("ASCEND_DSV4_ASCENDC_EMU_CACHE"):
        candidates.append(os.environ["ASCEND_DSV4_ASCENDC_EMU_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    candidates.append(os.path.join(base, "ascend_dsv4", "ascendc_emu"))
    candidates.append(os.path.join(tempfile.gettempdir(), f"ascend_dsv4_ascendc_emu_{os.getuid()}"))
    for d in candidates:
        try:
            os.makedirs(d, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise EmuBuildError(f"no writable cache folder for the ascendc_emu library among {candidates}")


def library_path() -> str:
    """Path of the compiled library, compiling it first if the cache has no build of these sources."""
    cxx = _compiler()
    path = os.path.join(cache_dir(), f"libdsv4_ascendc_emu_{source_hash(cxx)}.so")
    if os.path.exists(path):
        return path
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        res = subprocess.run([cxx, *FLAGS, "-o", tmp, ENTRY], capture_output=True, text=True)
        if res.returncode != 0:
            raise EmuBuildError(f"compiling the AscendC kernels for the host emulation failed:\n{res.stderr[-4000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load() -> ctypes.CDLL:
    """The emulation library (compiled on first use, then cached for the process and on disk)."""
    global _lib
    with _lock:
        if _lib is None:
            _lib = ctypes.CDLL(library_path())
        return _lib
