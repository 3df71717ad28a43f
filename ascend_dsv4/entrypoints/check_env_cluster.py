"""check-env items that look past this node: the Ray cluster (nodes, NPUs, the environment every raylet gives its
workers, the weights folder on every node), the memory plan of the requested layout, the weights folder.

The Ray probe runs in a child process (``python -m ascend_dsv4.entrypoints.check_env_cluster ADDRESS [MODEL]``,
JSON on stdout) with a timeout, so a cluster that never answers cannot hang check-env: it connects, reads
``ray.nodes()`` and runs one zero-CPU task pinned to each live node that reports the node's view (the environment
variables the raylet was started with, whether the weights folder is readable there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ..errors import AscendDSV4Error
from .check_env_plan import Check, Plan, Probe
from .ray_cluster import NodeInfo, check_cluster, summarize_nodes

RAY_PROBE_TIMEOUT_S = 90.0
NODE_ENV_VARS = ("ASCEND_RT_VISIBLE_DEVICES", "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES", "HCCL_IF_IP",
                 "HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "ASCEND_HOME_PATH", "HCCL_CONNECT_TIMEOUT")
RESOURCE = {"npu": "NPU", "cuda": "GPU", "cpu": "CPU"}


def model_type_of(model: str | None) -> str | None:
    """``"deepseek_v4"`` / ``"deepseek_v3"`` for a preset or folder; None when there is none or it is unreadable."""
    if not model:
        return None
    from ..models import load_config

    try:
        return load_config(model).model_type
    except (AscendDSV4Error, OSError):
        return None


# ---- weights ----------------------------------------------------------------------------------------------

def weights_summary(model: str) -> tuple[bool, str]:
    """Is the folder's checkpoint readable here? ``(ok, detail)``: config parses, every shard header reads."""
    from ..models import load_config
    from quant.safetensors_io import checkpoint_inventory

    if not os.path.isdir(model):
        return False, f"{model}: no such folder"
    try:
        load_config(model)
        inv = checkpoint_inventory(model)
    except (AscendDSV4Error, OSError) as e:
        return False, f"{model}: {e}".splitlines()[0]
    shards = sorted({p for p, _ in inv.values()})
    unreadable = [os.path.basename(p) for p in shards if not os.access(p, os.R_OK)]
    if unreadable:
        return False, f"{model}: shard(s) not readable by this user: {', '.join(unreadable[:5])}"
    if not shards:
        return False, f"{model}: config.json but no *.safetensors"
    nbytes = sum(info.nbytes for _, info in inv.values())
    return True, f"{len(shards)} shard(s), {len(inv)} tensors, {nbytes / 2**30:,.1f} GiB, headers and config OK"


def check_weights(plan: Plan) -> Check:
    from ..models import ALL_PRESETS

    if not plan.model:
        return Check("weights", "SKIP", "no --model given")
    if plan.model in ALL_PRESETS and not os.path.isdir(plan.model):
        return Check("weights", "SKIP", f"{plan.model} is a preset (random weights, nothing to read)")
    ok, detail = weights_summary(plan.model)
    return Check("weights", "OK" if ok else "FAIL", detail,
                 "" if ok else "put the checkpoint on storage every node mounts at the same path, readable by "
                               "the serving user; re-download truncated shards")


# ---- memory plan ------------------------------------------------------------------------------------------

def rank_weight_bytes(cfg, model: str, tp: int, ep_ranks: int, ep: bool) -> tuple[int, str]:
    """``(checkpoint-format bytes one rank holds, source)`` under the split rules of
    :mod:`ascend_dsv4.parallel_plan` (replicated / split over TP / whole experts over the ``ep_ranks`` expert
    ranks, or every expert split over TP without EP). Tensors come from the folder when ``model`` is one
    (quantised checkpoints included), else from the family's inventory in its checkpoint formats."""
    from ..models import family_of
    from ..parallel_plan import split_rule

    if os.path.isdir(model):
        from quant.safetensors_io import checkpoint_inventory

        items = [(n, i.nbytes) for n, (_, i) in checkpoint_inventory(model).items()]
        source = "checkpoint files"
    else:  # stored duplicates (V3's MTP copies of embed / head) are not loaded twice
        items = [(t.name, t.nbytes) for t in family_of(cfg).tensor_inventory(cfg) if not getattr(t, "copy", False)]
        source = "preset inventory"
    total = 0
    for name, nbytes in items:
        rule, _ = split_rule(name, cfg)
        if rule == "replicate":
            total += nbytes
        elif rule == "expert" and ep:
            total += nbytes // ep_ranks
        else:
            total += nbytes // tp
    return total, source


def kv_bytes_per_rank(cfg, context_len: int, seqs: int) -> int:
    """KV pool bytes of one data-parallel replica's ``seqs`` sequences of ``context_len`` tokens. DeepSeek's
    KV is one shared latent (V4: one K=V head; V3: the MLA latent), so TP ranks each hold all of it."""
    from ..models import family_of

    return family_of(cfg).memory_plan(cfg, context_len, seqs)["kv_bytes"]


def check_memory(plan: Plan, probe: Probe) -> Check:
    from ..models import load_config

    if not plan.model:
        return Check("memory", "SKIP", "no --model given: pass --model and the layout to plan HBM")
    try:
        cfg = load_config(plan.model)
    except (AscendDSV4Error, OSError) as e:
        return Check("memory", "FAIL", f"cannot size {plan.model}: {e}".splitlines()[0],
                     "fix the model folder first (see the weights row)")
    from ..parallel_plan import validate_layout

    tp, dp = plan.tp, plan.dp
    ep_ranks = tp * dp if plan.ep else tp
    layout = f"TP {tp} x DP {dp}" + (f", EP {ep_ranks}" if plan.ep else "")
    problems = []
    try:
        validate_layout(cfg, tp, plan.ep)
    except AscendDSV4Error as e:
        problems.append(str(e))
    if plan.ep and dp > 1 and cfg.n_routed_experts % ep_ranks:
        problems.append(f"{cfg.n_routed_experts} routed experts do not split over {ep_ranks} expert ranks")
    want = plan.expected_npus()
    if want and tp * dp > want * plan.nodes:
        problems.append(f"{layout} needs {tp * dp} NPUs, {plan.nodes} node(s) x {want} have {want * plan.nodes}")
    if problems:
        return Check("memory", "FAIL", "; ".join(problems),
                     "choose TP dividing the heads and TP x DP (EP) dividing the experts, within the NPUs you have")
    try:
        w, source = rank_weight_bytes(cfg, plan.model, tp, ep_ranks, plan.ep)
    except (AscendDSV4Error, OSError) as e:
        return Check("memory", "FAIL", f"cannot size {plan.model}: {e}".splitlines()[0],
                     "fix the model folder first (see the weights row)")
    ctx = min(plan.max_model_len, cfg.max_position_embeddings)
    kv = kv_bytes_per_rank(cfg, ctx, plan.max_num_seqs)
    need = w + kv
    gib = 2**30
    detail = (f"{layout}: per rank weights {w / gib:,.1f} GiB ({source}; experts / {ep_ranks if plan.ep else tp}, "
              f"split tensors / {tp}, KV projection, indexer, norms replicated) + "
              f"KV {kv / gib:,.1f} GiB ({plan.max_num_seqs} x {ctx:,} tokens) = {need / gib:,.1f} GiB")
    if plan.device != "npu":
        return Check("memory", "SKIP", detail + f"; no HBM to compare with on --device {plan.device}")
    if not probe.chips:
        return Check("memory", "WARN", detail + "; free HBM unknown (npu-smi gave no chips)",
                     "run on the node itself with the driver installed")
    free = min(c.hbm_total_mb - c.hbm_used_mb for c in probe.chips) * 2**20
    budget = free * plan.memory_utilization
    detail += f" vs {budget / gib:,.1f} GiB ({plan.memory_utilization:g} x {free / gib:,.1f} GiB free on the fullest chip)"
    if need > budget:
        return Check("memory", "FAIL", detail + "; activations and workspace come on top",
                     "more ranks per layout (TP / DP with --enable-expert-parallel), shorter --max-model-len or "
                     "fewer --max-num-seqs, or a W8A8 / W4A8 checkpoint (ascend-dsv4 quantize)")
    if need > 0.85 * budget:
        return Check("memory", "WARN", detail + f"; {100 * need / budget:.0f}% of the budget: little room for "
                     "activations", "lower --max-num-seqs or --max-model-len")
    return Check("memory", "OK", detail + "; activations and workspace not included")


# ---- the Ray cluster --------------------------------------------------------------------------------------

def _probe_ray(address: str, model: str | None, timeout: float = RAY_PROBE_TIMEOUT_S) -> dict:
    """Run :func:`_ray_probe_main` in a child process; its JSON, or ``{"error": ...}``."""
    cmd = [sys.executable, "-m", "ascend_dsv4.entrypoints.check_env_cluster", address] + ([model] if model else [])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no answer from the Ray cluster at {address} within {timeout:g} s"}
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": (p.stderr.strip().splitlines() or [f"probe exited with {p.returncode}"])[-1]}


def _ray_probe_main(address: str, model: str | None) -> dict:
    import logging

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False, include_dashboard=False)
    try:
        nodes = ray.nodes()

        @ray.remote(num_cpus=0)
        def node_report(model_dir):
            from ascend_dsv4.entrypoints.check_env_cluster import NODE_ENV_VARS, weights_summary

            env = {k: os.environ.get(k) for k in NODE_ENV_VARS}
            return {"ip": ray.util.get_node_ip_address(), "env": env,
                    "weights": weights_summary(model_dir) if model_dir and os.path.isdir(model_dir) else None}

        refs = [node_report.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote(model if model and os.path.isdir(model) else None) for n in nodes if n.get("Alive")]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=RAY_PROBE_TIMEOUT_S / 2)
        reports = [ray.get(r) for r in ready]
        return {"nodes": [{k: n.get(k) for k in ("NodeID", "Alive", "NodeManagerAddress", "Resources")}
                          for n in nodes], "reports": reports, "unanswered": len(refs) - len(ready)}
    finally:
        ray.shutdown()


def evaluate_ray(plan: Plan, data: dict) -> list[Check]:
    """Rows ``ray`` / ``ray-env`` / ``weights@nodes`` from a probe result (see :func:`_ray_probe_main`)."""
    start_fix = ("start the head with scripts/ray_head.sh and every other node with scripts/ray_worker.sh --head "
                 "HEAD_IP:6379; a node with too few NPUs: ray stop, fix ASCEND_RT_VISIBLE_DEVICES, ray start again")
    if "error" in data:
        return [Check("ray", "FAIL", f"Ray cluster at {plan.ray_address or 'auto'}: {data['error']}", start_fix)]
    res = RESOURCE[plan.device]
    per_node = (plan.expected_npus() or 0) if plan.device == "npu" else 0
    nodes: list[NodeInfo] = summarize_nodes(data["nodes"], res)
    ok, why = check_cluster(nodes, plan.nodes, per_node, None, res)
    listing = ", ".join(f"{n.ip} {n.accelerators:g} {res}" + ("" if n.alive else " (dead)") for n in nodes)
    rows = [Check("ray", "OK" if ok else "FAIL", f"{why}: {listing}", "" if ok else start_fix)]

    by_ip = {n.ip: n for n in nodes if n.alive}
    env_problems = []
    for rep in data["reports"]:
        ip, env = rep["ip"], rep["env"]
        if plan.device == "npu":
            if env.get("RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES") != "1":
                env_problems.append(f"{ip}: RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES not 1 (Ray rewrites "
                                    "device visibility per worker)")
            vis = env.get("ASCEND_RT_VISIBLE_DEVICES")
            node = by_ip.get(ip)
            if vis is None:
                env_problems.append(f"{ip}: ASCEND_RT_VISIBLE_DEVICES unset")
            elif node is not None and len(vis.split(",")) != node.accelerators:
                env_problems.append(f"{ip}: ASCEND_RT_VISIBLE_DEVICES has {len(vis.split(','))} ids, Ray counts "
                                    f"{node.accelerators:g} NPU")
        if plan.multi_node:
            for v in ("HCCL_IF_IP", "HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
                if not env.get(v):
                    env_problems.append(f"{ip}: {v} unset")
            if env.get("HCCL_IF_IP") and env["HCCL_IF_IP"] != ip:
                env_problems.append(f"{ip}: HCCL_IF_IP={env['HCCL_IF_IP']} is not this node's address")
    if data.get("unanswered"):
        env_problems.append(f"{data['unanswered']} node(s) did not answer the probe task")
    rows.append(Check("ray-env", "FAIL" if env_problems else "OK",
                      "; ".join(env_problems) if env_problems else
                      f"{len(data['reports'])} node(s): visibility and NIC variables set in the raylets' environment",
                      "set the environment BEFORE `ray start` (scripts/ray_head.sh / ray_worker.sh --restart); "
                      "workers inherit the raylet's environment" if env_problems else ""))
    if plan.model and os.path.isdir(plan.model):
        bad = [f"{r['ip']}: {r['weights'][1] if r['weights'] else 'folder missing'}" for r in data["reports"]
               if not (r["weights"] and r["weights"][0])]
        rows.append(Check("weights@nodes", "FAIL" if bad else "OK",
                          "; ".join(bad) if bad else f"readable on all {len(data['reports'])} node(s)",
                          "mount the same checkpoint at the same path on every node" if bad else ""))
    return rows


def check_collectives(plan: Plan, timeout_s: float = 300.0) -> Check:
    """Form the layout's process groups across the cluster (one Ray actor per rank, no weights) and all-reduce
    over the world / TP / EP groups: what HCCL timeouts at start-up would otherwise reveal after the weights load."""
    import time

    from ..engine.ray_executor import ExecutorError, RayExecutor
    from ..engine.ray_placement import PlacementError

    world = plan.tp * plan.dp
    t0 = time.monotonic()
    ex = RayExecutor(world, "ascend_dsv4.engine.ray_executor.GroupCheckWorker", {"device": plan.device},
                     device=plan.device, address=plan.ray_address, enable_expert_parallel=plan.ep,
                     start_timeout_s=timeout_s, call_timeout_s=timeout_s)
    try:
        ex.start()
        sums = ex.collective_rpc("all_reduce_ranks")
    except (ExecutorError, PlacementError) as e:
        return Check("collectives", "FAIL", str(e).split(". the server")[0],
                     "check HCCL_IF_IP / HCCL_SOCKET_IFNAME on every node and the hccl-nics row; "
                     "hccn_tool -i N -ping -g address <peer NPU IP> between nodes")
    finally:
        ex.shutdown()
    want = world * (world - 1) / 2
    bad = [r for r, s in enumerate(sums) if s["world"] != want]
    if bad:
        return Check("collectives", "FAIL", f"all-reduce over {world} ranks gave wrong sums on ranks {bad}: "
                     f"{sums[bad[0]]}", "a rank joined the wrong group: restart Ray on every node with the same "
                     "environment")
    nodes = len({s.node_id for s in ex.slots})
    backend = {"npu": "hccl", "cuda": "nccl"}.get(plan.device, "gloo")
    return Check("collectives", "OK", f"{world} ranks on {nodes} node(s) formed the world / TP / EP groups and "
                 f"all-reduced ({backend}) in {time.monotonic() - t0:.1f} s")


def check_ray(plan: Plan, probe_fn=_probe_ray) -> list[Check]:
    if not plan.multi_node and not plan.ray_address:
        return [Check("ray", "SKIP", "one node with the mp executor: Ray not used")]
    try:
        import ray  # noqa: F401
    except ImportError:
        return [Check("ray", "FAIL", "ray is not installed", "pip install 'ray==2.60.0' (a dependency of ascend-dsv4)")]
    rows = evaluate_ray(plan, probe_fn(plan.ray_address or "auto", plan.model))
    if plan.check_collectives:
        if rows[0].verdict == "OK":
            rows.append(check_collectives(plan))
        else:
            rows.append(Check("collectives", "SKIP", "the cluster is not ready (ray row)"))
    return rows


if __name__ == "__main__":
    try:
        out = _ray_probe_main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
    except Exception as e:  # reported as a row, not a stack trace
        out = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
    print(json.dumps(out))
