"""The torch_npu emulation (and the wheel-contract recorder) in the worker processes of a multi-rank dry run.

``ascend-dsv4 check-npu --tensor-parallel-size N`` runs the model through the ``mp`` executor: ranks 1..N-1 are
fresh processes that only receive the ``ASCEND_DSV4_*`` environment. When ``ASCEND_DSV4_NPU_EMULATION`` holds a
directory, importing the NPU backend in such a process (:func:`apply_from_env`, called by ``atb_ops.npu``)
installs the emulation and a :class:`~atb_ops.npu.contracts.ContractChecker` that appends one JSON line per
checked torch_npu call to ``<dir>/rank-<pid>.jsonl`` (op, violation or null), which the parent reads back with
:func:`read_reports`. ``ASCEND_DSV4_NPU_EMULATION_PARENT`` (the parent's pid) keeps the parent itself out.
"""

from __future__ import annotations

import glob
import json
import logging
import os

log = logging.getLogger("atb_ops")

ENV_DIR = "ASCEND_DSV4_NPU_EMULATION"
ENV_PARENT = "ASCEND_DSV4_NPU_EMULATION_PARENT"
_attached: list = []


def apply_from_env() -> None:
    out_dir = os.environ.get(ENV_DIR)
    if not out_dir or str(os.getpid()) == os.environ.get(ENV_PARENT) or _attached:
        return
    from . import emulation

    if emulation.real_torch_npu_available():
        log.warning("%s is set but the real torch_npu is installed: the emulation is not used", ENV_DIR)
        return
    mod = emulation.install()
    from .contracts import ContractChecker
    from .wheel_oracle import load_oracle

    path = os.path.join(out_dir, f"rank-{os.getpid()}.jsonl")
    checker = ContractChecker(load_oracle())
    check = checker.check

    def check_and_report(op, args, kwargs, out):
        msg = check(op, args, kwargs, out)
        with open(path, "a") as f:
            f.write(json.dumps({"op": op, "violation": msg}) + "\n")
        return msg

    checker.check = check_and_report
    _attached.append(checker.attach(mod))


def read_reports(out_dir: str) -> tuple[dict[str, int], list[str]]:
    """(calls per torch_npu op, violations) over every worker's report in ``out_dir``."""
    calls: dict[str, int] = {}
    bad: list[str] = []
    for p in sorted(glob.glob(os.path.join(out_dir, "rank-*.jsonl"))):
        with open(p) as f:
            for line in f:
                r = json.loads(line)
                calls[r["op"]] = calls.get(r["op"], 0) + 1
                if r["violation"]:
                    bad.append(r["violation"])
    return calls, bad
