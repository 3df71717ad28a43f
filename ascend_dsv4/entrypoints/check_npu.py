"""``ascend-dsv4 check-npu``: the NPU dry run on a machine without an NPU.

Runs a short prefill and a few decode steps of the model through the NPU backend with torch_npu replaced by the
CPU emulation (:mod:`atb_ops.npu.emulation`) and every torch_npu call replayed on the torch_npu wheel's own
schemas and Meta kernels (:mod:`atb_ops.npu.contracts`). Prints the op table (op -> torch_npu / custom /
composed / reference, calls, contract) and the violations. Exit status: 0 clean; 1 a contract violation or a
hot-path op on the reference fallback; 2 a usage error (bad model or layout); 3 the wheel contracts could
not be loaded (e.g. no network for ``pip download``). With ``--tensor-parallel-size N`` the model runs split over
N ranks through the ``mp`` executor (gloo between the CPU processes): rank 0 here, ranks 1..N-1 in worker
processes that install the emulation and record their contracts themselves
(:mod:`atb_ops.npu.worker_emulation`); their calls and violations are reported too. Nothing here runs on, or proves anything about, NPU
hardware beyond the op signatures, shapes and dtypes the wheel declares.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import tempfile

from ..errors import AscendDSV4Error

log = logging.getLogger("ascend_dsv4")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="toy-v4", help="preset name (toy-v4, toy-v3) or model folder")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="tensor-parallel ranks (worker processes through the mp executor)")
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


class _Reports:
    result: tuple[dict[str, int], list[str]] = ({}, [])


@contextlib.contextmanager
def _worker_reports(active: bool, contracts: bool):
    """While active: the environment that makes the mp executor's workers install the emulation and record their
    contracts into a temporary folder; afterwards ``.result`` = (calls per op, violations) of all workers."""
    rep = _Reports()
    if not active:
        yield rep
        return
    from atb_ops.npu.worker_emulation import ENV_DIR, ENV_PARENT, read_reports

    saved = {k: os.environ.get(k) for k in (ENV_DIR, ENV_PARENT)}
    with tempfile.TemporaryDirectory(prefix="check-npu-") as d:
        os.environ[ENV_DIR], os.environ[ENV_PARENT] = d, str(os.getpid())
        try:
            yield rep
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if contracts:
            rep.result = read_reports(d)


def run(a: argparse.Namespace) -> int:
    from atb_ops.npu import emulation

    if a.tensor_parallel_size < 1:
        print(f"--tensor-parallel-size must be >= 1, got {a.tensor_parallel_size}")
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
        tp = a.tensor_parallel_size
        with _worker_reports(tp > 1, oracle is not None) as reports:
            llm = LLM(model=a.model, backend="npu", device="cpu", dtype=a.dtype, seed=a.weights_seed,
                      max_model_len=max(64, a.prompt_len + a.decode_steps + 8), progress=False,
                      **(dict(tensor_parallel_size=tp, distributed_executor_backend="mp") if tp > 1 else {}))
            try:
                vocab = llm.cfg.vocab_size
                ids = [(7 + 31 * i) % vocab for i in range(a.prompt_len + a.decode_steps)]
                logits = llm.logits(ids, prefill_len=a.prompt_len)
            finally:
                llm.shutdown()
        table = optable.table()
    finally:
        if checker is not None:
            checker.detach()
        if installed_here:  # leave the process as it was (the command also runs in-process, e.g. in tests)
            emulation.uninstall()
    finite = bool(logits.isfinite().all())
    contracts = _op_contracts(table, checker) if checker is not None else None
    print(f"check-npu: {a.model} ({llm.cfg.model_type}, dtype {a.dtype}), prefill {a.prompt_len} + decode "
          f"{a.decode_steps} through the NPU backend under the torch_npu CPU emulation (no NPU used)"
          + (f", tensor-parallel size {tp} (rank 0's table below)" if tp > 1 else ""))
    print(optable.format_table(table, contracts))
    failures = []
    if checker is not None:
        print()
        print("torch_npu calls checked against the torch_npu wheel's schemas and Meta kernels:")
        print(checker.summary() or "(none)")
        for v in checker.violations:
            failures.append(f"contract: {v}")
    if tp > 1 and checker is not None:
        w_calls, w_bad = reports.result
        print()
        print(f"ranks 1..{tp - 1} (worker processes), torch_npu calls checked against the wheel:")
        print("\n".join(f"{op}: {n} calls" for op, n in sorted(w_calls.items())) or "(none)")
        if not w_calls:
            failures.append("the worker ranks reported no torch_npu call")
        for v in w_bad:
            failures.append(f"contract (worker rank): {v}")
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
