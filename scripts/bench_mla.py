#!/usr/bin/env python3
"""MLA decode-step benchmark: four implementations of one DeepSeek-V2/V3 MLA attention layer.

Compares the cache layouts of MLA (DeepSeek-V2 paper, §2.1; the weight absorption of its appendix):

- ``CacheDecompressed``: cache the full per-head K [H, Dn+R] and V [H, Dv] of every token (the released
  HF code); a step decompresses only the new token, then standard MHA with concatenated q/k;
- ``CacheCompressed``: cache the latent [C+R]; every step decompresses the whole context with kv_b_proj;
- ``Absorbed``: cache the latent; W_UK is absorbed into q and W_UV applied after the attention; q and k are
  concatenated ([q_abs | q_pe], [c | k_pe] broadcast to every head) as in the study's first absorbed code;
- ``Absorbed+MoveElision``: as Absorbed, with the rope and nope scores computed separately and added: this is
  :func:`atb_ops.mla_decode` (called here over a paged latent pool with an index table).

A decode step is the whole layer for one new token per sequence: q_a_proj -> q_a_layernorm -> q_b_proj,
kv_a_proj_with_mqa -> kv_a_layernorm, RoPE, cache write at the new position, attention, o_proj.
Time = median of ``--repeat`` steps after warm-up (``torch.cuda.synchronize`` around each on a GPU). Cache
bytes per token per layer = bytes of the cache tensors allocated / (batch * cached tokens); the int64 index
table of the paged pool (8 B/token, a page table in a real server) is not counted.

All variants start from the same random past latents (the decompressed cache is computed from them), and
their outputs are checked against each other at every (batch, context) configuration.

Usage:
  python scripts/bench_mla.py                                   # CPU, small shapes, float32
  python scripts/bench_mla.py --device cuda --shapes seed       # GPU, V3 sizes, bfloat16
  python scripts/bench_mla.py --batches 1,32 --contexts 1024,4096 --repeat 20
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import atb_ops  # noqa: E402

VARIANTS = ("CacheDecompressed", "CacheCompressed", "Absorbed", "Absorbed+MoveElision")


@dataclass(frozen=True)
class Shapes:
    H: int  # heads
    C: int  # kv_lora_rank
    R: int  # qk_rope_head_dim
    Dn: int  # qk_nope_head_dim
    Dv: int  # v_head_dim
    q_lora: int  # q_lora_rank
    hidden: int  # hidden size
    contexts: tuple[int, ...]


SHAPES = {
    "small": Shapes(H=16, C=128, R=32, Dn=64, Dv=64, q_lora=256, hidden=1024, contexts=(256, 1024)),
    # DeepSeek-V3 (and V2) attention sizes; V2 has hidden 5120, which does not change the attention part
    "seed": Shapes(H=128, C=512, R=64, Dn=128, Dv=128, q_lora=1536, hidden=7168, contexts=(1024, 4096, 16384)),
}


# ------------------------------------------------------------------------------------------------ model
class MLALayer:
    """Random weights of one MLA attention layer (nn.Linear layout: weight [out, in])."""

    def __init__(self, sh: Shapes, dtype: torch.dtype, device: str, seed: int = 0):
        g = torch.Generator(device="cpu").manual_seed(seed)

        def w(out_f, in_f):
            return (torch.randn(out_f, in_f, generator=g) * in_f**-0.5).to(device=device, dtype=dtype)

        self.sh = sh
        self.q_a = w(sh.q_lora, sh.hidden)
        self.q_a_norm = torch.ones(sh.q_lora, device=device)
        self.q_b = w(sh.H * (sh.Dn + sh.R), sh.q_lora)
        self.kv_a = w(sh.C + sh.R, sh.hidden)
        self.kv_a_norm = torch.ones(sh.C, device=device)
        self.kv_b = w(sh.H * (sh.Dn + sh.Dv), sh.C)
        self.o = w(sh.hidden, sh.H * sh.Dv)
        kv_b = self.kv_b.view(sh.H, sh.Dn + sh.Dv, sh.C)
        self.w_uk = kv_b[:, : sh.Dn]  # [H, Dn, C]
        self.w_uv = kv_b[:, sh.Dn:]  # [H, Dv, C]
        self.inv_freq = atb_ops.rope_inv_freq(sh.R, 10000.0)
        self.scale = (sh.Dn + sh.R) ** -0.5

    def project(self, x: torch.Tensor, pos: torch.Tensor):
        """x [B, hidden] -> q [B, H, Dn+R] (rope on the last R), latent row [B, C+R] (normed c | roped k_pe)."""
        sh = self.sh
        q = F.linear(atb_ops.rms_norm(F.linear(x, self.q_a), self.q_a_norm, 1e-6), self.q_b)
        q = atb_ops.apply_rope(q.view(-1, sh.H, sh.Dn + sh.R), pos, self.inv_freq)
        kv = F.linear(x, self.kv_a)
        c = atb_ops.rms_norm(kv[:, : sh.C], self.kv_a_norm, 1e-6)
        k_pe = atb_ops.apply_rope(kv[:, sh.C:], pos, self.inv_freq)
        return q, torch.cat([c, k_pe], dim=-1)

    def decompress(self, c: torch.Tensor):
        """c [..., C] -> k_nope [..., H, Dn], v [..., H, Dv] (kv_b_proj)."""
        sh = self.sh
        kv = F.linear(c, self.kv_b).view(*c.shape[:-1], sh.H, sh.Dn + sh.Dv)
        return kv[..., : sh.Dn], kv[..., sh.Dn:]

    def out(self, o: torch.Tensor):
        """o [B, H, Dv] -> [B, hidden] (o_proj)."""
        return F.linear(o.reshape(o.shape[0], -1), self.o)


def _attend(query, key, value, scale):
    """Matmul attention of the study: q [B, H, 1, D] k [B, H, L, D] v [B, H, L, Dv]; softmax in float32."""
    s = torch.matmul(query, key.transpose(2, 3)) * scale
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(p, value)


# ------------------------------------------------------------------------------------------------ caches
def alloc_cache(variant: str, sh: Shapes, batch: int, cap: int, dtype, device) -> dict[str, torch.Tensor]:
    """The cache tensors a variant keeps for ``batch`` sequences of ``cap`` tokens (``device='meta'`` to size)."""
    if variant == "CacheDecompressed":
        return {
            "k": torch.empty(batch, sh.H, cap, sh.Dn + sh.R, dtype=dtype, device=device),
            "v": torch.empty(batch, sh.H, cap, sh.Dv, dtype=dtype, device=device),
        }
    if variant == "Absorbed+MoveElision":  # a paged pool of latent rows, [P, C+R]
        return {"latent": torch.empty(batch * cap, sh.C + sh.R, dtype=dtype, device=device)}
    return {"latent": torch.empty(batch, cap, sh.C + sh.R, dtype=dtype, device=device)}


def cache_bytes_per_token(variant: str, sh: Shapes, dtype) -> float:
    batch, cap = 2, 8
    cache = alloc_cache(variant, sh, batch, cap, dtype, "meta")
    return sum(t.numel() * t.element_size() for t in cache.values()) / (batch * cap)


def fill_cache(variant, layer: MLALayer, cache, past: torch.Tensor):
    """Write the past latent rows [B, n, C+R] (the same for every variant) into a variant's cache."""
    sh = layer.sh
    batch, n, _ = past.shape
    if variant == "CacheDecompressed":
        for b in range(batch):  # one sequence at a time: bounded temporaries
            k_nope, v = layer.decompress(past[b, :, : sh.C])  # [n, H, Dn], [n, H, Dv]
            cache["k"][b, :, :n, : sh.Dn] = k_nope.transpose(0, 1)
            cache["k"][b, :, :n, sh.Dn:] = past[b, :, sh.C:].unsqueeze(0)
            cache["v"][b, :, :n] = v.transpose(0, 1)
    elif variant == "Absorbed+MoveElision":
        cap = cache["latent"].shape[0] // batch
        cache["latent"].view(batch, cap, -1)[:, :n] = past
    else:
        cache["latent"][:, :n] = past


# ------------------------------------------------------------------------------------------------ steps
def make_step(variant: str, layer: MLALayer, cache, batch: int, n: int):
    """A closure running one decode step for the token at position n (cache holds positions 0..n-1)."""
    sh, scale = layer.sh, layer.scale
    dev = layer.q_a.device
    pos = torch.full((batch,), n, dtype=torch.int64, device=dev)
    L = n + 1

    if variant == "CacheDecompressed":
        def step(x):
            q, lat = layer.project(x, pos)
            k_nope, v = layer.decompress(lat[:, : sh.C])  # the new token only
            cache["k"][:, :, n, : sh.Dn] = k_nope
            cache["k"][:, :, n, sh.Dn:] = lat[:, None, sh.C:]
            cache["v"][:, :, n] = v
            o = _attend(q.unsqueeze(2), cache["k"][:, :, :L], cache["v"][:, :, :L], scale)
            return layer.out(o.squeeze(2))
        return step

    if variant == "CacheCompressed":
        def step(x):
            q, lat = layer.project(x, pos)
            cache["latent"][:, n] = lat
            latent = cache["latent"][:, :L]
            k_nope, v = layer.decompress(latent[..., : sh.C])  # the whole context, every step
            key = latent.new_empty(batch, sh.H, L, sh.Dn + sh.R)
            key[..., : sh.Dn] = k_nope.transpose(1, 2)
            key[..., sh.Dn:] = latent[:, None, :, sh.C:]
            o = _attend(q.unsqueeze(2), key, v.transpose(1, 2), scale)
            return layer.out(o.squeeze(2))
        return step

    if variant == "Absorbed":
        def step(x):
            q, lat = layer.project(x, pos)
            cache["latent"][:, n] = lat
            latent = cache["latent"][:, :L]
            query = q.new_empty(batch, sh.H, 1, sh.C + sh.R)
            query[:, :, 0, : sh.C] = torch.einsum("bhd,hdc->bhc", q[..., : sh.Dn], layer.w_uk)
            query[:, :, 0, sh.C:] = q[..., sh.Dn:]
            key = latent.new_empty(batch, sh.H, L, sh.C + sh.R)  # concatenated and broadcast to heads
            key[:] = latent.unsqueeze(1)
            s = torch.matmul(query, key.transpose(2, 3)) * scale
            p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
            o_latent = torch.einsum("bhql,blc->bhqc", p, latent[..., : sh.C])
            o = torch.einsum("bhqc,hdc->bhqd", o_latent, layer.w_uv)
            return layer.out(o.squeeze(2))
        return step

    if variant == "Absorbed+MoveElision":
        cap = cache["latent"].shape[0] // batch
        rows = torch.arange(batch, device=dev) * cap
        idx = rows[:, None] + torch.arange(L, device=dev)[None, :]  # [B, L] rows of the pool

        def step(x):
            q, lat = layer.project(x, pos)
            cache["latent"][rows + n] = lat
            q_abs = torch.einsum("bhd,hdc->bhc", q[..., : sh.Dn], layer.w_uk)
            o_latent = atb_ops.mla_decode(q_abs, q[..., sh.Dn:], cache["latent"], idx, scale)  # [B, H, C]
            o = torch.einsum("bhc,hdc->bhd", o_latent, layer.w_uv)
            return layer.out(o)
        return step

    raise ValueError(variant)


def estimate_bytes(variant: str, sh: Shapes, batch: int, L: int, es: int) -> int:
    """Peak working set of one configuration (cache + the step's largest temporaries), bytes."""
    cache = cache_bytes_per_token(variant, sh, {2: torch.bfloat16, 4: torch.float32}.get(es, torch.float64))
    total = cache * batch * L
    scores = batch * sh.H * L * (es + 4 * 3)  # s, float32 softmax and its temporaries
    if variant == "CacheDecompressed":
        total += scores + L * sh.H * (sh.Dn + sh.Dv) * es  # fill_cache temporaries (one sequence at a time)
    elif variant == "CacheCompressed":
        total += scores + batch * L * sh.H * (2 * (sh.Dn + sh.Dv) + sh.Dn + sh.R) * es  # kv, v copy, key
    elif variant == "Absorbed":
        total += scores + batch * L * sh.H * (sh.C + sh.R) * es  # key broadcast to heads
    else:
        total += scores + batch * L * (sh.C + sh.R) * 4 * 3 + batch * L * 8  # float32 gather + mask, idx
    return int(total)


def free_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info()[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_step(step, x, device, warmup, repeat):
    out = None
    for _ in range(warmup):
        out = step(x)
    sync(device)
    times = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        out = step(x)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, out


def check_seed_cache_bytes():
    """The study's cache sizes at V2/V3 attention sizes in BF16: 81.92 kB (decompressed) vs 1.152 kB (latent)."""
    sh = SHAPES["seed"]
    cd = cache_bytes_per_token("CacheDecompressed", sh, torch.bfloat16)
    lat = {v: cache_bytes_per_token(v, sh, torch.bfloat16) for v in VARIANTS[1:]}
    assert cd == 81920, cd
    assert all(b == 1152 for b in lat.values()), lat
    print(f"cache bytes check (seed sizes, bf16, per token per layer): CacheDecompressed {cd / 1e3:.2f} kB "
          f"vs latent {lat['CacheCompressed'] / 1e3:.3f} kB ({cd / lat['CacheCompressed']:.1f}x) -- OK")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default=None, help="default: small on CPU, seed on GPU")
    ap.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 (auto: float32 on CPU, else bf16)")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--contexts", default=None, help="comma list of cached tokens (default per --shapes)")
    ap.add_argument("--repeat", type=int, default=None, help="timed steps per configuration (median)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args(argv)

    device = args.device
    on_gpu = device.startswith("cuda")
    shapes_name = args.shapes or ("seed" if on_gpu else "small")
    sh = SHAPES[shapes_name]
    dtype = {"auto": torch.bfloat16 if on_gpu else torch.float32, "float32": torch.float32, "fp32": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "fp16": torch.float16}[args.dtype]
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else list(sh.contexts)
    repeat = args.repeat or (20 if on_gpu else 5)
    warmup = args.warmup if args.warmup is not None else (5 if on_gpu else 2)
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; expected {', '.join(VARIANTS)}")

    check_seed_cache_bytes()
    torch.set_grad_enabled(False)
    layer = MLALayer(sh, dtype, device)
    probe = torch.empty(1, device=device)
    backend = atb_ops.selected_backend(probe)
    impls = atb_ops.implementations("mla_decode")
    kernel = ("the specification" if backend == "reference"
              else "kernel" if backend in impls else "no kernel: reference implementation on this device")
    print(f"device={device} ({torch.cuda.get_device_name() if on_gpu else 'cpu, %d threads' % torch.get_num_threads()})"
          f" dtype={str(dtype).replace('torch.', '')} shapes={shapes_name} {sh} repeat={repeat} warmup={warmup}")
    print(f"atb_ops.mla_decode backend: {backend} ({kernel})\n")

    rows, agree = [], []
    es = torch.empty(0, dtype=dtype).element_size()
    for batch in batches:
        for n in contexts:
            g = torch.Generator(device="cpu").manual_seed(batch * 100003 + n)
            x = torch.randn(batch, sh.hidden, generator=g).to(device=device, dtype=dtype)
            past = torch.randn(batch, n, sh.C + sh.R, generator=g).to(device=device, dtype=dtype)
            results, outs = {}, {}
            for v in variants:
                kb = cache_bytes_per_token(v, sh, dtype) / 1e3
                need = estimate_bytes(v, sh, batch, n + 1, es)
                if need > 0.9 * free_bytes(device):
                    results[v] = (None, kb, f"OOM-skipped (needs ~{need / 2**30:.1f} GiB)")
                    continue
                cache = None
                try:
                    cache = alloc_cache(v, sh, batch, n + 1, dtype, device)
                    fill_cache(v, layer, cache, past)
                    ms, out = time_step(make_step(v, layer, cache, batch, n), x, device, warmup, repeat)
                    results[v] = (ms, kb, None)
                    outs[v] = out.float().cpu()
                except (torch.cuda.OutOfMemoryError, MemoryError):
                    results[v] = (None, kb, "OOM-skipped")
                finally:
                    del cache
                    gc.collect()
                    if on_gpu:
                        torch.cuda.empty_cache()
            fastest = min((r[0] for r in results.values() if r[0] is not None), default=None)
            for v in variants:
                ms, kb, note = results[v]
                if ms is None:
                    rows.append((v, batch, n, note, f"{kb:.3f}", "-"))
                else:
                    rows.append((v, batch, n, f"{ms:.3f}", f"{kb:.3f}", f"{ms / fastest:.2f}"))
            # every variant computes the same layer output from the same past
            if len(outs) > 1:
                ref = next(iter(outs.values()))
                err = max(float((o - ref).abs().max() / ref.abs().max()) for o in outs.values())
                agree.append(err)
                tol = 1e-3 if dtype == torch.float32 else 5e-2
                assert err < tol, f"variants disagree at batch={batch} context={n}: max rel diff {err:.2e}"
            del past, x

    print("| variant | batch | context | ms/step | cache KB/token/layer | ratio to fastest |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")
    if agree:
        print(f"\noutputs agree across variants: max relative difference {max(agree):.2e}")
    print("(KB = 1000 bytes; ratio = ms/step over the fastest variant at the same batch and context)")


if __name__ == "__main__":
    main()
