"""Command line: ``ascend-dsv4 generate``, ``info``, ``make-random-checkpoint``, ``serve`` and ``bench serve``.

Every failure the user can cause (bad model name, malformed config, prompt too long, invalid sampling
parameters, ...) prints one ``error: ...`` line and exits with status 2: no stack trace.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..errors import AscendDSV4Error


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="toy-v4", help="preset name (toy-v4, deepseek-v4-flash, ...) or model folder")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ascend-dsv4", description="DeepSeek-V4 / V3 serving for Ascend NPUs")
    ap.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt, streaming tokens as they come")
    _add_model_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--device", default=None, help="cpu | cuda | npu (default: cuda when available, else cpu)")
    g.add_argument("--backend", default="auto", help="auto | reference | cuda | npu")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    g.add_argument("--numerics", default="exact", help="exact | reference (official FP8/FP4 activation rounding)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--weights-seed", type=int, default=0, help="seed of the random weights of a preset")
    g.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant ops: output bitwise independent of the batch (slower)")

    i = sub.add_parser("info", help="print the config, parameter count, KV bytes per token and memory needs")
    _add_model_args(i)
    i.add_argument("--context-len", type=int, default=None, help="context length for the memory estimate")
    i.add_argument("--batch", type=int, default=1, help="number of sequences for the memory estimate")
    m = sub.add_parser("make-random-checkpoint",
                       help="write a random-weight checkpoint in the real format (FP8 blocks, FP4 experts, shards)")
    m.add_argument("--preset", default="toy-v4", help="toy-v4 | deepseek-v4-flash | deepseek-v4-pro | toy-v3 | deepseek-v3")
    m.add_argument("--layers", type=int, default=None, help="keep only the first N backbone layers")
    m.add_argument("--format", choices=("official", "hf"), default="official")
    m.add_argument("--out", required=True)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--shard-gb", type=float, default=4.0)

    q = sub.add_parser("quantize", help="write msModelSlim-format quantised weights (DeepSeek-V4 Ascend recipe; "
                                        "V4 and V3)")
    _add_model_args(q)
    q.add_argument("--type", required=True, choices=("w8a8_dynamic", "w8a8", "w4a8_dynamic"),
                   help="w8a8_dynamic | w8a8 (static, calibrated) | w4a8_dynamic (routed experts W4A8)")
    q.add_argument("--out", required=True)
    q.add_argument("--calib-tokens", type=int, default=64, help="random calibration tokens (w8a8 only)")
    q.add_argument("--seed", type=int, default=0, help="seed of the calibration tokens and of a preset's weights")
    q.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="serving dtype in config.json; float32 writes int64 deq_scale and float32 tensors")
    q.add_argument("--shard-gb", type=float, default=4.0)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                     "/v1/models, /health, /metrics)")
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on /v1/* (default: $ASCEND_DSV4_API_KEY, else none)")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model' (default: the --model argument)")
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--max-num-seqs", type=int, default=8, help="requests decoded together")
    s.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per engine step")
    s.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    s.add_argument("--max-queue", type=int, default=256, help="waiting requests before answering 429")
    s.add_argument("--enable-prefix-caching", action="store_true", help="reuse KV pages of shared prompt prefixes")
    s.add_argument("--num-speculative-tokens", type=int, default=0, help="MTP draft tokens per step (0 or 1)")
    s.add_argument("--chat-template", default=None, help="Jinja2 chat template (file or string) overriding the "
                   "model folder's; default: tokenizer_config.json's, else DeepSeek's chat format")
    s.add_argument("--device", default=None, help="cpu | cuda | npu (default: cuda when available, else cpu)")
    s.add_argument("--backend", default="auto", help="auto | reference | cuda | npu")
    s.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    s.add_argument("--numerics", default="exact", help="exact | reference (official FP8/FP4 activation rounding)")
    s.add_argument("--weights-seed", type=int, default=0, help="seed of the random weights of a preset")
    s.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant ops: each request's output bitwise independent of the other requests "
                        "batched with it (slower)")
    s.add_argument("--uvicorn-log-level", default="info", help="critical | error | warning | info | debug")

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    from .bench_serve import add_arguments as _add_bench_serve_args

    _add_bench_serve_args(bsub.add_parser("serve", help="load-test a running OpenAI-compatible server "
                                                         "(streaming completions; TTFT/TPOT percentiles)"))
    return ap


def _make_random_checkpoint(a: argparse.Namespace) -> int:
    import os

    from ..config import preset
    from ..weights.random_checkpoint import reduced_config, write_checkpoint, write_checkpoint_v3

    cfg = preset(a.preset)
    if a.layers is not None and not 1 <= a.layers <= cfg.n_layers:
        raise AscendDSV4Error(f"--layers must be in [1, {cfg.n_layers}] for {a.preset}, got {a.layers}")
    if os.path.isdir(a.out) and os.listdir(a.out):
        raise AscendDSV4Error(f"--out {a.out} exists and is not empty; refusing to overwrite")
    if cfg.model_type == "deepseek_v3":
        if a.format != "hf":
            raise AscendDSV4Error("DeepSeek-V3 checkpoints are written in DeepSeek's HF format: use --format hf")
        if a.layers is not None:
            cfg = cfg.replace(n_layers=a.layers, n_dense_layers=min(cfg.n_dense_layers, a.layers),
                              name=f"{cfg.name}-{a.layers}l")
        shards = write_checkpoint_v3(cfg, a.out, a.seed, int(a.shard_gb * (1 << 30)))
    else:
        cfg = reduced_config(cfg, a.layers)
        shards = write_checkpoint(cfg, a.out, a.format, a.seed, int(a.shard_gb * (1 << 30)))
    print(f"wrote {cfg.name} ({a.format} layout, {cfg.n_layers} layers + {cfg.n_mtp_layers} MTP) to {a.out}: "
          f"{len(shards)} shard(s)")
    return 0


def _generate(a: argparse.Namespace) -> int:
    from .. import LLM, SamplingParams

    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.seed)
    llm = LLM(model=a.model, backend=a.backend, dtype=a.dtype, numerics=a.numerics, device=a.device,
              seed=a.weights_seed, max_model_len=a.max_model_len, batch_invariant=a.batch_invariant)

    def emit(_rid: int, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    out = llm.generate(a.prompt, params, on_text=emit)[0]
    sys.stdout.write("\n")
    print(f"[{len(out.prompt_token_ids)} prompt tokens, {len(out.token_ids)} generated, "
          f"finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def _serve(a: argparse.Namespace) -> int:
    import os

    from .. import LLM
    from .server import run_server

    if not 0 <= a.port < 65536:
        raise AscendDSV4Error(f"--port must be in [0, 65535], got {a.port}")
    if a.max_queue < 1:
        raise AscendDSV4Error(f"--max-queue must be >= 1, got {a.max_queue}")
    llm = LLM(model=a.model, backend=a.backend, dtype=a.dtype, numerics=a.numerics, device=a.device,
              seed=a.weights_seed, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, block_size=a.block_size,
              enable_prefix_caching=a.enable_prefix_caching, num_speculative_tokens=a.num_speculative_tokens,
              batch_invariant=a.batch_invariant)
    run_server(llm, host=a.host, port=a.port, api_key=a.api_key or os.environ.get("ASCEND_DSV4_API_KEY"),
               served_model_name=a.served_model_name or a.model, max_queue=a.max_queue,
               model_dir=a.model if os.path.isdir(a.model) else None, chat_template=a.chat_template,
               log_level=a.uvicorn_log_level)
    return 0


def _quantize(a: argparse.Namespace) -> int:
    from ..quantize import quantize_model

    quantize_model(a.model, a.type, a.out, calib_tokens=a.calib_tokens, seed=a.seed, dtype=a.dtype,
                   shard_gb=a.shard_gb)
    return 0


def _bench(a: argparse.Namespace) -> int:
    from . import bench_serve

    return {"serve": bench_serve.main}[a.bench_command](a)


def _info(a: argparse.Namespace) -> int:
    from ..config import load_config
    from ..config_v3 import DeepseekV3Config
    from ..sizing import format_info
    from ..sizing_v3 import format_info_v3

    cfg = load_config(a.model)
    ctx = a.context_len if a.context_len is not None else min(cfg.max_position_embeddings, 131072)
    if ctx < 1 or a.batch < 1:
        raise AscendDSV4Error("--context-len and --batch must be positive")
    print((format_info_v3 if isinstance(cfg, DeepseekV3Config) else format_info)(cfg, ctx, a.batch))
    import os

    if os.path.isdir(a.model):
        from ..weights.folder_info import describe_folder

        print(describe_folder(a.model))
    return 0


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return {"generate": _generate, "info": _info, "make-random-checkpoint": _make_random_checkpoint,
                "serve": _serve, "bench": _bench, "quantize": _quantize}[a.command](a)
    except AscendDSV4Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
