"""Command line: ``ascend-dsv4 generate``, ``info``, ``make-random-checkpoint``, ``serve``, ``bench serve`` and
``check-env``.

Every failure the user can cause (bad model name, malformed config, prompt too long, invalid sampling
parameters, ...) prints one ``error: ...`` line and exits with status 2: no stack trace.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..errors import AscendDSV4Error


DEFAULT_MODEL = "toy-v4"


_ASYNC_HELP = ("launch the next greedy decode step before the host has processed the one in flight (the host's "
               "per-step work overlaps the device; outputs unchanged); as vLLM's --async-scheduling")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help=f"preset name or model folder, as vLLM's positional model (same as --model)")
    p.add_argument("--model", default=None,
                   help=f"preset name (toy-v4, deepseek-v4-flash, ...) or model folder (default: {DEFAULT_MODEL})")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM compatibility and ignored: this package runs no code from model folders")


def _add_verbose(p: argparse.ArgumentParser) -> None:
    # default SUPPRESS: a subcommand's -v adds to the top-level one instead of overwriting it with False
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at INFO level")


def _resolve_model(a: argparse.Namespace, sub: argparse.ArgumentParser) -> None:
    tag = getattr(a, "model_tag", None)
    if tag is not None and a.model is not None and tag != a.model:
        sub.error(f"the model is given twice: positional {tag!r} and --model {a.model!r}")
    a.model = tag or a.model or DEFAULT_MODEL
    if getattr(a, "trust_remote_code", False):
        print("note: --trust-remote-code is ignored: ascend-dsv4 implements the DeepSeek architectures itself and "
              "runs no code from the model folder", file=sys.stderr)


def _add_weight_check_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--skip-weight-check", action="store_true",
                   help="do not count NaN/Inf values of each weight as it loads (the check runs on the device the "
                        "weight lands on; skip it only where you measured that it costs you)")


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks (devices) the model is split over")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="partition the routed experts over the ranks instead of splitting every expert")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="attention replicas (each with its own scheduler and KV cache, TP inside); the routed "
                        "experts are expert-parallel over all replicas' ranks (needs --enable-expert-parallel)")
    p.add_argument("--distributed-executor-backend", default=None, choices=("mp", "ray"),
                   help="how ranks run: mp = one worker process per rank on this node (default with -tp > 1); "
                        "ray = one actor per rank on the Ray cluster at $RAY_ADDRESS (scripts/ray_head.sh)")


def _parallel_kwargs(a: argparse.Namespace) -> dict:
    return {"tensor_parallel_size": a.tensor_parallel_size, "enable_expert_parallel": a.enable_expert_parallel,
            "distributed_executor_backend": a.distributed_executor_backend,
            "data_parallel_size": a.data_parallel_size}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ascend-dsv4", description="DeepSeek-V4 / V3 serving for Ascend NPUs")
    from .. import __version__

    ap.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    ap.add_argument("--version", action="version", version=f"ascend-dsv4 {__version__}")
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
    g.add_argument("--backend", default="auto", help="auto | reference | cuda | npu | ascendc_emu")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    g.add_argument("--numerics", default="exact", help="exact | reference (official FP8/FP4 activation rounding)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's max_position_embeddings; larger is an error)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of the device memory for weights + KV cache; on cuda / npu the KV pools are sized "
                        "from it (default: pools for --max-num-seqs sequences of --max-model-len); ignored on cpu")
    g.add_argument("--weights-seed", type=int, default=0, help="seed of the random weights of a preset")
    g.add_argument("--enforce-eager", action="store_true", help="CUDA: run decode steps eagerly (no CUDA graph capture)")
    g.add_argument("--async-scheduling", action="store_true", help=_ASYNC_HELP)
    g.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant ops: output bitwise independent of the batch (slower)")
    _add_weight_check_arg(g)
    _add_parallel_args(g)

    i = sub.add_parser("info", help="print the config, parameter count, KV bytes per token and memory needs")
    _add_model_args(i)
    i.add_argument("--context-len", type=int, default=None, help="context length for the memory estimate")
    i.add_argument("--batch", type=int, default=1, help="number of sequences for the memory estimate")
    _add_parallel_args(i)
    i.add_argument("--device-memory", default=None, help="memory of one device (e.g. 64GiB): prints the tokens of "
                   "KV that fit per rank and checks the per-rank weights against it")
    i.add_argument("--backend", default=None, help="npu: also print the NPU backend's op table (op -> what runs it)")
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
                   help="name(s) clients use in 'model' (default: the model folder's base name, or the preset name)")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's max_position_embeddings; larger is an error)")
    s.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of the device memory for weights + KV cache; on cuda / npu the KV pools are sized "
                        "from it (default: pools for --max-num-seqs sequences of --max-model-len); ignored on cpu")
    s.add_argument("--max-num-seqs", type=int, default=8, help="requests decoded together")
    s.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per engine step")
    s.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    s.add_argument("--max-queue", type=int, default=256, help="waiting requests before answering 429")
    s.add_argument("--enable-prefix-caching", action="store_true", help="reuse KV pages of shared prompt prefixes")
    s.add_argument("--enforce-eager", action="store_true", help="CUDA: run decode steps eagerly (no CUDA graph capture)")
    s.add_argument("--async-scheduling", action="store_true", help=_ASYNC_HELP)
    s.add_argument("--num-speculative-tokens", type=int, default=0, help="MTP draft tokens per step (0 or 1)")
    s.add_argument("--chat-template", default=None, help="Jinja2 chat template (file or string) overriding the "
                   "model folder's; default: tokenizer_config.json's, else DeepSeek's chat format")
    s.add_argument("--device", default=None, help="cpu | cuda | npu (default: cuda when available, else cpu)")
    s.add_argument("--backend", default="auto", help="auto | reference | cuda | npu | ascendc_emu")
    s.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    s.add_argument("--numerics", default="exact", help="exact | reference (official FP8/FP4 activation rounding)")
    s.add_argument("--weights-seed", type=int, default=0, help="seed of the random weights of a preset")
    s.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant ops: each request's output bitwise independent of the other requests "
                        "batched with it (slower)")
    _add_weight_check_arg(s)
    _add_parallel_args(s)
    s.add_argument("--uvicorn-log-level", default="info", help="critical | error | warning | info | debug")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds requests in flight get to finish (new ones get 503) before they are "
                        "ended with an error and the server exits")

    c = sub.add_parser("check-npu", help="NPU dry run without an NPU: prefill + decode through the NPU backend under "
                                         "the torch_npu CPU emulation, every torch_npu call checked against the "
                                         "torch_npu wheel's schemas and Meta kernels")
    from .check_npu import add_arguments as _add_check_npu_args

    _add_check_npu_args(c)

    from .check_env import add_arguments as _add_check_env_args

    _add_check_env_args(sub.add_parser("check-env", help="is this node / Ray cluster ready to serve? one table of "
                                                         "checks with a verdict and a fix each (exit 1 on FAIL)"))

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    from .bench_serve import add_arguments as _add_bench_serve_args

    _add_bench_serve_args(bsub.add_parser("serve", help="load-test a running OpenAI-compatible server "
                                                         "(streaming completions; TTFT/TPOT percentiles)",
                                          formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    for p in list(sub.choices.values()) + list(bsub.choices.values()):
        _add_verbose(p)  # -v after the subcommand too
    return ap


def _subparser(ap: argparse.ArgumentParser, a: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (innermost) subcommand ``a`` ran."""
    p = ap
    for dest in ("command", "bench_command"):
        name = getattr(a, dest, None)
        acts = [x for x in p._actions if isinstance(x, argparse._SubParsersAction)]
        if name is None or not acts or name not in acts[0].choices:
            break
        p = acts[0].choices[name]
    return p


def _make_random_checkpoint(a: argparse.Namespace) -> int:
    import os

    from ..models import preset
    from ..weights.random_checkpoint import write_checkpoint

    cfg = preset(a.preset)
    if a.layers is not None and not 1 <= a.layers <= cfg.n_layers:
        raise AscendDSV4Error(f"--layers must be in [1, {cfg.n_layers}] for {a.preset}, got {a.layers}")
    if os.path.isdir(a.out) and os.listdir(a.out):
        raise AscendDSV4Error(f"--out {a.out} exists and is not empty; refusing to overwrite")
    cfg = cfg.with_layers(a.layers)
    shards = write_checkpoint(cfg, a.out, a.format, a.seed, int(a.shard_gb * (1 << 30)))
    print(f"wrote {cfg.name} ({a.format} layout, {cfg.n_layers} layers + {cfg.n_mtp_layers} MTP) to {a.out}: "
          f"{len(shards)} shard(s)")
    return 0


def _isatty(f) -> bool:
    try:
        return f.isatty()
    except (AttributeError, ValueError):
        return False


def escape_controls(text: str) -> str:
    """``text`` with control characters (C0 but newline and tab, DEL, C1) shown as ``\\xNN`` escapes: a model's raw
    bytes (the toy tokenizer's random output, ESC sequences) must not drive the terminal."""
    out = []
    for ch in text:
        o = ord(ch)
        if (o < 0x20 and ch not in "\n\t") or 0x7F <= o <= 0x9F:
            out.append(f"\\x{o:02x}")
        else:
            out.append(ch)
    return "".join(out)


def _generate(a: argparse.Namespace) -> int:
    from .. import LLM, SamplingParams

    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.seed)
    llm = LLM(model=a.model, backend=a.backend, dtype=a.dtype, numerics=a.numerics, device=a.device,
              seed=a.weights_seed, max_model_len=a.max_model_len, skip_weight_check=a.skip_weight_check,
              gpu_memory_utilization=a.gpu_memory_utilization, enforce_eager=a.enforce_eager,
              batch_invariant=a.batch_invariant, async_scheduling=a.async_scheduling, **_parallel_kwargs(a))

    tty = _isatty(sys.stdout)

    def emit(_rid: int, text: str) -> None:
        sys.stdout.write(escape_controls(text) if tty else text)
        sys.stdout.flush()

    try:
        out = llm.generate(a.prompt, params, on_text=emit, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    sys.stdout.write("\n")
    print(f"[{len(out.prompt_token_ids)} prompt tokens, {len(out.token_ids)} generated, "
          f"finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def _serve(a: argparse.Namespace) -> int:
    from .. import LLM
    from .serve_lifecycle import bind_socket
    from .server import run_server

    if not 0 <= a.port < 65536:
        raise AscendDSV4Error(f"--port must be in [0, 65535], got {a.port}")
    if a.max_queue < 1:
        raise AscendDSV4Error(f"--max-queue must be >= 1, got {a.max_queue}")
    if not a.shutdown_timeout >= 0:
        raise AscendDSV4Error(f"--shutdown-timeout must be >= 0 seconds, got {a.shutdown_timeout}")
    sock = bind_socket(a.host, a.port)  # a port in use fails now, not after the weights have loaded
    try:
        return _serve_on(a, sock, LLM, run_server)
    finally:
        sock.close()


def served_name(model: str) -> str:
    """The name a served folder answers to: its base name (``/data/DeepSeek-V4-Flash/`` -> ``DeepSeek-V4-Flash``);
    a preset keeps its name."""
    import os

    if os.path.isdir(model):
        return os.path.basename(os.path.normpath(os.path.abspath(model)))
    return model


def _serve_on(a: argparse.Namespace, sock, LLM, run_server) -> int:
    import os

    llm = LLM(model=a.model, backend=a.backend, dtype=a.dtype, numerics=a.numerics, device=a.device,
              seed=a.weights_seed, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, block_size=a.block_size,
              enable_prefix_caching=a.enable_prefix_caching, num_speculative_tokens=a.num_speculative_tokens,
              skip_weight_check=a.skip_weight_check, gpu_memory_utilization=a.gpu_memory_utilization,
              enforce_eager=a.enforce_eager, batch_invariant=a.batch_invariant, async_scheduling=a.async_scheduling,
              **_parallel_kwargs(a))
    try:
        run_server(llm, host=a.host, port=a.port, api_key=a.api_key or os.environ.get("ASCEND_DSV4_API_KEY"),
                   served_model_name=a.served_model_name or served_name(a.model), max_queue=a.max_queue,
                   model_dir=a.model if os.path.isdir(a.model) else None, chat_template=a.chat_template,
                   log_level=a.uvicorn_log_level, sock=sock, shutdown_timeout=a.shutdown_timeout)
    finally:
        llm.shutdown()
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
    from ..models import family_of, load_config

    cfg = load_config(a.model)
    ctx = a.context_len if a.context_len is not None else min(cfg.max_position_embeddings, 131072)
    if ctx < 1 or a.batch < 1:
        raise AscendDSV4Error("--context-len and --batch must be positive")
    print(family_of(cfg).format_info(cfg, ctx, a.batch))
    dp = getattr(a, "data_parallel_size", 1)
    if a.tensor_parallel_size != 1 or a.enable_expert_parallel or a.device_memory is not None or dp != 1:
        from ..parallel_plan import format_layout_info, parse_bytes

        mem = parse_bytes(a.device_memory) if a.device_memory is not None else None
        print(format_layout_info(cfg, a.tensor_parallel_size, a.enable_expert_parallel, mem, data_parallel_size=dp))
    import os

    if os.path.isdir(a.model):
        from ..weights.folder_info import describe_folder

        print(describe_folder(a.model))
    if a.backend == "npu":
        print(_npu_table())
    elif a.backend not in (None, "auto", "reference", "cuda"):
        raise AscendDSV4Error(f"--backend must be reference, cuda or npu, got {a.backend!r}")
    return 0


def _npu_table() -> str:
    from atb_ops.npu import emulation, optable

    if emulation.is_installed():
        where = "torch_npu: CPU emulation"
    elif emulation.real_torch_npu_available():
        where = "torch_npu: installed"
    else:
        where = ("torch_npu: not installed here, so every op would fall back to the reference implementation; "
                 "`ascend-dsv4 check-npu` shows the table under the torch_npu CPU emulation")
    optable.reset()
    return f"NPU backend op table ({where}):\n{optable.format_table(optable.table())}"


def _check_npu(a: argparse.Namespace) -> int:
    from .check_npu import run

    return run(a)


def _check_env(a: argparse.Namespace) -> int:
    from . import check_env

    return check_env.main(a)


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    a, extra = ap.parse_known_args(argv)
    sub = _subparser(ap, a)
    if extra:  # reported by the subcommand's own usage, not the top level's
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
    if hasattr(a, "model_tag"):
        _resolve_model(a, sub)
    # serve logs its start-up (and drain) at INFO, as vLLM does; other commands stay quiet unless -v
    level = logging.INFO if a.verbose or a.command == "serve" else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return {"generate": _generate, "info": _info, "make-random-checkpoint": _make_random_checkpoint,
                "serve": _serve, "bench": _bench, "quantize": _quantize,
                "check-npu": _check_npu, "check-env": _check_env}[a.command](a)
    except AscendDSV4Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
