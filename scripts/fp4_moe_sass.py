"""Instruction counts of the FP4 MoE kernel's main loop (atb_ops/cuda/gemm_fp4_moe.py) per variant, from the
SASS that Triton compiles for sm_90 (no GPU needed: triton's bundled ptxas and cuobjdump; use the device's Triton
version, 3.6, e.g. a wheel unpacked into a folder put first on PYTHONPATH: codegen differs between versions).

    python scripts/fp4_moe_sass.py "" "persist=1" "nacc=4,regs=168" ...

Prints, per variant: registers, spills, and the opcode histogram of the innermost loop that holds the wgmma
(HGMMA) instructions (one K step of BK codes per thread). Shapes: E=64 experts of 2048 x 4096, T=8 x 6 rows."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from atb_ops.cuda import gemm_fp4_moe as fm  # noqa: E402


def compile_variant(cfg: dict):
    names = ("x_ptr w_ptr s_ptr out_ptr part_ptr ctr_ptr ids_ptr act_ptr M N K E stride_we stride_se k_split "
             "n_slots n_split max_pass max_chunks overhead").split()
    types = ["*bf16", "*i16", "*u8", "*bf16", "*fp32", "*i32", "*i64", "*i64"] + ["i32"] * 12
    sig = dict(zip(names, types))
    cx = dict(ASM=True, MUL1=bool(cfg.get("mul1", 1)), EVEN_K=True, EVEN_N=True, EP=64, MP=64,
              PERSIST=bool(cfg["persist"]),
              NACC=cfg["nacc"], BW=cfg["bw"], BT=cfg["bt"], BK=cfg["bk"])
    sig.update({k: "constexpr" for k in cx})
    div = [0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14]  # pointers, N, K, E, strides, k_split: multiples of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i in div}
    opts = {"num_warps": cfg["warps"], "num_stages": cfg["stages"]}
    if cfg["regs"]:
        opts["maxnreg"] = cfg["regs"]
    return triton.compile(ASTSource(fn=fm._moe_fp4_kernel, signature=sig, constexprs=cx, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)


def loop_histogram(sass: str):
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best = None
    for a, t in ins:
        m = re.search(r"BRA\s.*?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a:
            body = [u for b, u in ins if int(m.group(1), 16) <= b <= a]
            if any("GMMA" in u for u in body) and (best is None or len(body) < len(best)):
                best = body
    if best is None:
        return 0, {}
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", u).split()[0].split(".")[0] for u in best)
    return len(best), dict(sorted(ops.items(), key=lambda kv: -kv[1]))


def main() -> None:
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for spec in sys.argv[1:] or [""]:
        cfg = fm._config(8 * 6 / 34)
        for kv in filter(None, spec.split(",")):
            k, v = kv.split("=")
            cfg[k] = int(v)
        ck = compile_variant(cfg)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(ck.asm["cubin"])
            f.flush()
            sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", f.name], capture_output=True,
                                  text=True).stdout
            res = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                                 text=True).stdout
        regs = re.search(r"REG:(\d+)", res)
        stack = re.search(r"STACK:(\d+)", res)
        n, ops = loop_histogram(sass)
        md = ck.metadata
        print(f"[{spec or 'default'}] regs={regs and regs.group(1)} stack={stack and stack.group(1)} "
              f"local ld/st={len(re.findall(r'LDL|STL', sass))} smem={md.shared} "
              f"loop={n} instr per {cfg['bk']}-code step: {ops}", flush=True)


if __name__ == "__main__":
    main()
