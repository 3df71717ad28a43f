"""The torch_npu wheel's own op contracts on a CPU machine: its schemas (YAML) and its Meta kernels.

The torch_npu wheel cannot be imported without CANN (and installing it breaks ``import torch``), but it ships
two pure-Python artefacts that state each op's contract exactly:

* ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``: every op schema (argument names, types,
  defaults, keyword-only markers);
* ``torch_npu/op_plugin/meta/_meta_registrations.py``: Meta kernels (output shapes / dtypes and many argument
  checks) registered on ``torch.library.Library("npu", "IMPL", "Meta")``.

:func:`load_oracle` reads both from the downloaded wheel *as files* (zipfile; never installed), defines each
schema on a ``torch.library.Library("npu", "DEF")`` and executes the meta file with small stand-in modules for
the four torch_npu internals it imports (dtype enum ints, error-code strings, CANN version, SoC version).
Afterwards ``torch.ops.npu.<op>(meta tensors, ...)`` parses the arguments against the wheel's schema and
returns the wheel's output contract.

:func:`fetch_wheel` downloads the wheel with ``pip download --no-deps torch-npu==<version>`` into a cache
directory (``$ASCEND_DSV4_CACHE`` or ``~/.cache/ascend_dsv4``) once.
"""

from __future__ import annotations

import glob
import logging
import os
import subprocess
import sys
import types
import zipfile
from typing import Optional

import torch

log = logging.getLogger("atb_ops")

TORCH_NPU_VERSION = "2.13.0"  # matches the torch 2.13 CPU build this project pins
SCHEMA_YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
META_PY = "torch_npu/op_plugin/meta/_meta_registrations.py"
#: torch_npu-private dtype enum ints (wheel ``TORCH_NPU_DTYPE_TO_STRING_MAP``), needed by the meta file
NPU_DTYPE_ENUMS = {"int4": 285, "hifloat8": 290, "float8_e5m2": 291, "float8_e4m3fn": 292, "float8_e8m0fnu": 293,
                   "float4_e2m1fn_x2": 296, "float4_e1m2fn_x2": 297, "uint8": 4}
#: what the stand-in modules claim: a CANN >= 8.5 and a 910B/A3-class SoC
CANN_VERSION = "8.5.0"
SOC_VERSION = 250


class OracleUnavailable(RuntimeError):
    """The torch_npu wheel could not be downloaded or read."""


def cache_dir() -> str:
    return os.environ.get("ASCEND_DSV4_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ascend_dsv4")


def fetch_wheel(version: str = TORCH_NPU_VERSION, dest: Optional[str] = None, timeout: float = 300) -> str:
    """Path of the torch_npu wheel, downloading it (``pip download --no-deps``) into the cache on first use."""
    dest = dest or os.path.join(cache_dir(), "wheels")
    pattern = os.path.join(dest, f"torch_npu-{version}-*.whl")
    found = sorted(glob.glob(pattern))
    if found:
        return found[0]
    os.makedirs(dest, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"torch-npu=={version}",
           "-d", dest, "--quiet"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise OracleUnavailable(f"pip download torch-npu=={version} failed: {e}") from e
    found = sorted(glob.glob(pattern))
    if r.returncode != 0 or not found:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise OracleUnavailable(f"pip download torch-npu=={version} failed (exit {r.returncode}): {' | '.join(tail)}")
    return found[0]


def _collect_funcs(node, out: list[str]) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "func" and isinstance(v, str):
                out.append(v)
            else:
                _collect_funcs(v, out)
    elif isinstance(node, list):
        for v in node:
            _collect_funcs(v, out)


def _stub_modules() -> dict[str, types.ModuleType]:
    """Stand-ins for the torch_npu internals ``_meta_registrations.py`` imports (no torch_npu code)."""
    root = types.ModuleType("torch_npu")
    root.__path__ = []  # type: ignore[attr-defined]
    for k, v in NPU_DTYPE_ENUMS.items():
        setattr(root, k, v)
    utils = types.ModuleType("torch_npu.utils")
    utils.__path__ = []  # type: ignore[attr-defined]
    err = types.ModuleType("torch_npu.utils._error_code")

    class ErrCode:
        PARAM = VALUE = TYPE = NOT_SUPPORT = INTERNAL = UNAVAIL = NOT_FOUND = PTR = SYSCALL = ACL = ""

    err.ErrCode = ErrCode
    err.ops_error = lambda *a, **k: ""
    npu = types.ModuleType("torch_npu.npu")
    npu.__path__ = []  # type: ignore[attr-defined]
    npu_utils = types.ModuleType("torch_npu.npu.utils")
    npu_utils.get_cann_version = lambda *a, **k: CANN_VERSION
    npu_utils._is_gte_cann_version = lambda *a, **k: True
    backends = types.ModuleType("torch_npu.npu._backends")
    backends.get_soc_version = lambda *a, **k: SOC_VERSION
    root.utils, root.npu = utils, npu
    utils._error_code = err
    npu.utils, npu._backends = npu_utils, backends
    return {"torch_npu": root, "torch_npu.utils": utils, "torch_npu.utils._error_code": err, "torch_npu.npu": npu,
            "torch_npu.npu.utils": npu_utils, "torch_npu.npu._backends": backends}


class Oracle:
    """The loaded wheel contracts: ``schemas`` (op name -> schema text) and ``call(op, *args, **kwargs)``."""

    def __init__(self, wheel: str):
        import yaml

        self.wheel = wheel
        with zipfile.ZipFile(wheel) as z:
            names = set(z.namelist())
            for need in (SCHEMA_YAML, META_PY):
                if need not in names:
                    raise OracleUnavailable(f"{wheel} has no {need}")
            schema_text = z.read(SCHEMA_YAML).decode()
            meta_src = z.read(META_PY).decode()
        funcs: list[str] = []
        _collect_funcs(yaml.safe_load(schema_text), funcs)
        self.schemas: dict[str, str] = {}
        self._lib = torch.library.Library("npu", "DEF")  # kept alive: the definitions live as long as it does
        self.rejected: list[str] = []
        for f in funcs:
            name = f.split("(", 1)[0].strip()
            if name in self.schemas:
                continue
            try:
                self._lib.define(f)
            except Exception:  # a few schemas use syntax this torch's parser refuses; none is used here
                self.rejected.append(name)
                continue
            self.schemas[name] = f
        self._exec_meta(meta_src)

    def _exec_meta(self, src: str) -> None:
        stubs = _stub_modules()
        saved = {k: sys.modules.get(k) for k in stubs}
        sys.modules.update(stubs)
        try:
            mod = types.ModuleType("_torch_npu_wheel_meta_registrations")
            mod.__file__ = f"{self.wheel}!/{META_PY}"
            code = compile(src, mod.__file__, "exec")
            exec(code, mod.__dict__)  # registers the Meta kernels on the "npu" namespace
            self._meta_module = mod
        finally:
            for k, v in saved.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v

    def has(self, op: str) -> bool:
        return op in self.schemas

    def call(self, op: str, *args, **kwargs):
        """Run the wheel's schema parsing and Meta kernel of ``op`` (arguments: meta tensors and Python values)."""
        overload = "default"
        base = op
        if "." in op:
            base, overload = op.split(".", 1)
        packet = getattr(torch.ops.npu, base)
        return getattr(packet, overload)(*args, **kwargs)


_oracle: Optional[Oracle] = None
_oracle_error: Optional[str] = None


def load_oracle(version: str = TORCH_NPU_VERSION) -> Oracle:
    """The process-wide :class:`Oracle` (downloaded and loaded once). Raises :class:`OracleUnavailable`."""
    global _oracle, _oracle_error
    if _oracle is not None:
        return _oracle
    if _oracle_error is not None:
        raise OracleUnavailable(_oracle_error)
    try:
        _oracle = Oracle(fetch_wheel(version))
    except OracleUnavailable as e:
        _oracle_error = str(e)
        raise
    except Exception as e:  # a wheel we cannot read is reported, not crashed on
        _oracle_error = f"cannot load the torch_npu {version} wheel contracts: {type(e).__name__}: {e}"
        raise OracleUnavailable(_oracle_error) from e
    log.info("torch_npu %s contracts loaded from %s: %d schemas", version, _oracle.wheel, len(_oracle.schemas))
    return _oracle
