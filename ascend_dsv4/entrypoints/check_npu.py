"""``ascend-dsv4 check-npu``: the NPU dry run on a machine without an NPU.

Runs a short prefill and a few decode steps of the model through the NPU backend with torch_npu replaced by the
CPU emulation (:mod:`atb_ops.npu.emulation`) and every torch_npu call replayed on the torch_npu wheel's own
schemas and Meta kernels (:mod:`atb_ops.npu.contracts`). Prints the op table (op -> torch_npu / custom /
composed / reference, calls, contract) and the violations. Exit status: 0 clean; 1 a contract violation or a
hot-path op on the reference fallback; 2 a usage error (bad model, TP unavailable); 3 the wheel contracts could
not be loaded (e.g. no network for ``pip download``). Nothing here runs on, or proves anything about, NPU
hardware beyond the op signatures, shapes and dtypes the wheel declares.
"""

from __future__ import annotations

import argparse
import logging

from ..errors import AscendDSV4Error

log = logging.getLogger("ascend_dsv4")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="toy-v4", help="preset name (toy-v4, toy-v3) or model folder")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="tensor-parallel ranks (1 only for now)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (as on the NPU) | float32 | float16")
    p.add_argument("--prompt-len", type=int, default=12, help="prefill tokens")
    p.add_argument("--decode-steps", type=int, default=4, help="decode steps after the prefill")
    p.add_argument("--no-contracts", action="store_true", help="skip the wheel contract replay")
    p.add_argument("--weights-seed", type=int, default=0, help="seed of the random weights of a preset")


def _op_contracts(table, checker) -> dict[str, str]:
    """atb_ops op -> contract status of the torch_npu ops it called (matched by the ``via`` text)."""
    out = {}
    for op, e in table.items():
        if e.calls == 0 or e.kind in ("composed", "reference") and "torch_npu." not in e.via:
            out[op] = "-"
            continue
        used = [r for name, r in checker.ops.items() if name in e.via]
        if not used:
            out[op] = "-"
        else:
            bad = sum(len(r.violations) for r in used)
            out[op] = "ok" if bad == 0 else f"{bad} violation(s)"
    return out


def run(a: argparse.Namespace) -> int:
    from atb_ops.npu import emulation

    if a.tensor_parallel_size != 1:
        print(f"tensor parallelism (--tensor-parallel-size {a.tensor_parallel_size}) is not available in "
              f"check-npu yet: it needs the tensor-parallel runtime; run with --tensor-parallel-size 1")
        return 2
    if a.prompt_len < 1 or a.decode_steps < 0:
        raise AscendDSV4Error("--prompt-len must be >= 1 and --decode-steps >= 0")
    oracle = None
    if not a.no_contracts:
        from atb_ops.npu.wheel_oracle import OracleUnavailable, load_oracle

        try:
            oracle = load_oracle()
        except OracleUnavailable as e:
            print(f"cannot check contracts: {e} (use --no-contracts to run without them)")
            return 3
    installed_here = not emulation.is_installed()
    try:
        mod = emulation.install()
    except emulation.EmulationError as e:
        raise AscendDSV4Error(f"{e}; check-npu is the dry run for machines without an NPU") from None
    checker = None
    try:
        if oracle is not None:
            from atb_ops.npu.contracts import ContractChecker

            checker = ContractChecker(oracle).attach(mod)
        from atb_ops.npu import optable

        from .. import LLM

        optable.reset()
        llm = LLM(model=a.model, backend="npu", device="cpu", dtype=a.dtype, seed=a.weights_seed,
                  max_model_len=max(64, a.prompt_len + a.decode_steps + 8), progress=False)
        vocab = llm.cfg.vocab_size
        ids = [(7 + 31 * i) % vocab for i in range(a.prompt_len + a.decode_steps)]
        logits = llm.logits(ids, prefill_len=a.prompt_len)
        table = optable.table()
    finally:
        if checker is not None:
            checker.detach()
        if installed_here:  # leave the process as it was (the command also runs in-process, e.g. in tests)
            emulation.uninstall()
    finite = bool(logits.isfinite().all())
    contracts = _op_contracts(table, checker) if checker is not None else None
    print(f"check-npu: {a.model} ({llm.cfg.model_type}, dtype {a.dtype}), prefill {a.prompt_len} + decode "
          f"{a.decode_steps} through the NPU backend under the torch_npu CPU emulation (no NPU used)")
    print(optable.format_table(table, contracts))
    failures = []
    if checker is not None:
        print()
        print("torch_npu calls checked against the torch_npu wheel's schemas and Meta kernels:")
        print(checker.summary() or "(none)")
        for v in checker.violations:
            failures.append(f"contract: {v}")
    for op in optable.hot_path_fallbacks(table):
        if table[op].calls:
            failures.append(f"hot-path op {op} ran on the reference fallback")
    if not finite:
        failures.append("the logits are not finite")
    if failures:
        print()
        print("FAILED:")
        for f in failures:
            print(f"  {f}")
        return 1
    print()
    print("OK: no contract violation, no hot-path reference fallback")
    return 0
