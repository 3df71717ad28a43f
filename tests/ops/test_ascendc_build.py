"""The CANN side of atb_ops/ascendc without CANN: the build script refuses clearly, the loader reports the library
absent, the op schemas and fake (meta) implementations work, the kernel sources switch to the emulation by one
macro, and the host build is cached by source hash."""

from __future__ import annotations

import os
import re
import subprocess

import torch

from atb_ops.ascendc import loader
from atb_ops.ascendc.emu import build

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNELS = os.path.join(ROOT, "atb_ops", "ascendc", "kernels")


def test_build_script_without_cann_names_what_is_missing_and_fails():
    env = {k: v for k, v in os.environ.items() if k != "ASCEND_HOME_PATH"}
    res = subprocess.run(["bash", os.path.join(ROOT, "scripts", "build_ascendc.sh")], env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2
    assert "ASCEND_HOME_PATH is not set" in res.stderr and "missing" in res.stderr
    assert not os.path.exists(os.path.join(ROOT, "atb_ops", "ascendc", "build", "install"))
    env["ASCEND_HOME_PATH"] = "/nonexistent/cann"
    res = subprocess.run(["bash", os.path.join(ROOT, "scripts", "build_ascendc.sh")], env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "/nonexistent/cann is not a directory" in res.stderr


def test_loader_without_library(monkeypatch):
    monkeypatch.delenv("ASCEND_DSV4_ASCENDC_LIB", raising=False)
    monkeypatch.setitem(loader._state, "loaded", None)
    assert loader.library_path() is None
    assert loader.load_ascendc_ops() is False
    assert loader.register_npu_kernels() is False


def test_schemas_and_fake_implementations_on_meta():
    loader.register_schemas()
    loader.register_schemas()  # idempotent
    m = torch.device("meta")
    ops = torch.ops.ascend_dsv4
    out = ops.mla_decode(torch.empty(3, 128, 512, device=m, dtype=torch.bfloat16), torch.empty(3, 128, 64, device=m,
                         dtype=torch.bfloat16), torch.empty(100, 576, device=m, dtype=torch.bfloat16),
                         torch.empty(3, 40, dtype=torch.long, device=m), 0.04)
    assert out.shape == (3, 128, 512) and out.dtype == torch.bfloat16
    out = ops.sparse_attention(torch.empty(2, 64, 512, device=m), torch.empty(50, 512, device=m),
                               torch.empty(2, 128, dtype=torch.long, device=m), torch.empty(64, device=m), 0.04,
                               torch.empty(9, 512, device=m), torch.empty(2, 16, dtype=torch.long, device=m))
    assert out.shape == (2, 64, 512)
    out = ops.compressor_pool(torch.empty(64, 1024, device=m), torch.empty(64, 1024, device=m),
                              torch.empty(5, 8, dtype=torch.long, device=m), True)
    assert out.shape == (5, 512) and out.dtype == torch.float32
    assert set(loader.npu_impls()) == set(loader.SCHEMAS)


def test_kernel_sources_switch_by_one_macro():
    common = open(os.path.join(KERNELS, "kernel_common.h")).read()
    assert re.search(r'#ifdef ASCENDC_EMU\s+#include "\.\./emu/kernel_operator_emu\.h"\s+#include "\.\./emu/matmul_emu\.h"'
                     r'\s+#else\s+#include "kernel_operator\.h"', common)
    for name in ("compressor.cpp", "mla_decode.cpp", "mla_decode_cube.cpp"):
        src = open(os.path.join(KERNELS, name)).read()
        assert '#include "kernel_common.h"' in src and "emu" not in re.findall(r'#include "([^"]+)"', src)[0]
        assert "ASCENDC_EMU" not in src and '__global__ __aicore__' in src


def test_host_build_is_cached_by_source_hash():
    path = build.library_path()
    mtime = os.path.getmtime(path)
    assert build.library_path() == path and os.path.getmtime(path) == mtime  # no rebuild
    assert build.source_hash() in os.path.basename(path)


def test_register_npu_kernels_makes_ours_the_npu_implementation(monkeypatch):
    from atb_ops import _dispatch

    monkeypatch.setitem(_dispatch._registry, "npu", dict(_dispatch._registry["npu"]))
    monkeypatch.setattr(loader, "load_ascendc_ops", lambda: True)
    loader.register_schemas()
    assert loader.register_npu_kernels() is True
    for op in loader.SCHEMAS:
        assert _dispatch._registry["npu"][op].__name__ == op
    # the wrappers call torch.ops.ascend_dsv4 with the atb_ops argument order (fake kernels on meta tensors)
    m = torch.device("meta")
    out = _dispatch._registry["npu"]["sparse_attention"](torch.empty(1, 2, 8, device=m), torch.empty(4, 8, device=m),
                                                        torch.empty(1, 3, dtype=torch.long, device=m),
                                                        torch.empty(2, device=m), 0.5)
    assert out.shape == (1, 2, 8)
