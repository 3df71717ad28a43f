"""``ascend-dsv4 check-env``: is this node (and the Ray cluster) ready to serve? One table, a verdict and a fix
per item, exit status 1 when an item is fatal.

Items: ``cann`` (toolkit found, set_env.sh sourced, version), ``driver`` (``npu-smi info``: chip count, health,
HBM in use; driver / firmware versions), ``torch`` (torch and torch_npu versions matching), ``custom-ops``
(the fused-op packages the NPU backend looks for under ``ASCEND_CUSTOM_OPP_PATH`` / ``ASCEND_OPP_PATH``),
``hccl-nics`` (``hccn_tool``: link, net health and IP of every NPU NIC), ``host-env`` (the HCCL / gloo NIC
variables and the recipe variables of ``scripts/ascend_env.sh``), ``ray`` (nodes, NPUs per node, the visibility
variable on every node; with ``--check-collectives`` the layout's process groups formed across the nodes),
``memory`` (per-rank weights + KV of the requested layout vs free HBM) and ``weights`` (the folder readable here and, with Ray, on every node). Verdicts: OK, WARN (works, but slower or
fragile), FAIL (will not serve; exit 1), SKIP (not relevant to the requested layout).

The NPU items parse the tools' text (:mod:`ascend_dsv4.entrypoints.env_probes`); tests put fake ``npu-smi`` /
``hccn_tool`` executables on PATH that print recorded outputs. No NPU exists where this was written: the
parsers are checked against public recordings, not against a live device.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import socket
import sys
from dataclasses import asdict

from . import env_probes as ep
from .check_env_plan import NPUS_PER_NODE, Check, Plan, Probe  # noqa: F401  (NPUS_PER_NODE: re-exported)

VERDICTS = ("OK", "WARN", "FAIL", "SKIP")
HBM_BUSY_FRACTION = 0.10  # more HBM than this in use on an idle chip: another process holds it

# Fused DeepSeek-V4 ops the NPU backend resolves from custom-op packages (vllm-ascend `_C_ascend`,
# cann-recipes-infer `custom`, sgl-kernel-npu): label -> substrings of the aclnn op name that satisfy it.
WANTED_CUSTOM_OPS = {
    "sparse_attn_sharedkv": ("sparse_attn_sharedkv",),
    "compressor": ("compressor",),
    "lightning_indexer": ("lightning_indexer",),
    "hc_pre": ("hc_pre",),
    "hc_post": ("hc_post",),
    "inplace_partial_rotary_mul": ("partial_rotary_mul",),
    "moe_gating_top_k": ("moe_gating_top_k",),
}
RECIPE_VARS = ("HCCL_CONNECT_TIMEOUT", "HCCL_BUFFSIZE", "PYTORCH_NPU_ALLOC_CONF", "TASK_QUEUE_ENABLE")
NIC_VARS = ("HCCL_IF_IP", "HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
ENV_FIX = "generate the environment with scripts/ascend_env.sh and source it (or start nodes with scripts/ray_*.sh)"


# ---- node checks ------------------------------------------------------------------------------------------

def check_cann(plan: Plan) -> Check:
    if plan.device != "npu":
        return Check("cann", "SKIP", f"not needed for --device {plan.device}")
    home = plan.env.get("ASCEND_HOME_PATH") or plan.env.get("ASCEND_TOOLKIT_HOME")
    set_env = os.path.join(plan.ascend_root, "ascend-toolkit", "set_env.sh")
    if not home:
        if os.path.isfile(set_env):
            return Check("cann", "FAIL", f"CANN is installed ({set_env}) but set_env.sh was not sourced in this shell "
                         "(ASCEND_HOME_PATH unset)", f"source {set_env}; {ENV_FIX}")
        return Check("cann", "FAIL", "CANN toolkit not found (ASCEND_HOME_PATH unset, no "
                     f"{set_env})", "install the CANN toolkit and the kernels package for your SoC "
                     "(hiascend.com), then source its set_env.sh")
    if not os.path.isdir(home):
        return Check("cann", "FAIL", f"ASCEND_HOME_PATH={home} does not exist",
                     "source the set_env.sh of an installed CANN (a stale shell or container env?)")
    version, info = ep.cann_version(home)
    if version is None:
        return Check("cann", "WARN", f"CANN at {home}, but no ascend_toolkit_install.info with its version",
                     "reinstall the toolkit or check ASCEND_HOME_PATH points at .../ascend-toolkit/latest")
    return Check("cann", "OK", f"CANN {version} at {home} (set_env.sh sourced; {info})")


def _version_file(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return ep.parse_key_values(f.read()).get("version")
    except OSError:
        return None


def check_driver(plan: Plan, probe: Probe) -> Check:
    if plan.device != "npu":
        return Check("driver", "SKIP", f"not needed for --device {plan.device}")
    r = ep.run_tool(["npu-smi", "info"])
    if not r.found:
        return Check("driver", "FAIL", "npu-smi not on PATH: Ascend driver not installed or not mounted",
                     "install driver + firmware; in a container mount /usr/local/bin/npu-smi, "
                     "/usr/local/Ascend/driver and pass --device /dev/davinci*, /dev/davinci_manager")
    if r.rc != 0:
        first = (r.out.strip().splitlines() or ["(no output)"])[0]
        return Check("driver", "FAIL", f"npu-smi info failed (rc {r.rc}): {first}",
                     "check the driver (dmesg, npu-smi info as root); reboot after a driver upgrade")
    info = ep.parse_npu_smi_info(r.out)
    probe.chips = info.chips
    if not info.chips:
        return Check("driver", "FAIL", "npu-smi info lists no NPU chips",
                     "check the devices are visible (/dev/davinci*) and the driver loaded")
    drv = _version_file(os.path.join(plan.ascend_root, "driver", "version.info"))
    fw = _version_file(os.path.join(plan.ascend_root, "firmware", "version.info"))
    names = sorted({c.name for c in info.chips})
    used = [c.hbm_used_mb for c in info.chips]
    detail = (f"{len(info.chips)} chips {'/'.join(names)} on {len({c.npu for c in info.chips})} NPUs; HBM in use "
              f"{min(used)}-{max(used)} of {info.chips[0].hbm_total_mb} MB; npu-smi {info.version or '?'}"
              + (f", driver {drv}" if drv else "") + (f", firmware {fw}" if fw else ""))
    bad = [c for c in info.chips if c.health.upper() not in ("OK", "WARNING")]
    warn = [c for c in info.chips if c.health.upper() == "WARNING"]
    want = plan.expected_npus()
    if bad:
        lst = ", ".join(f"NPU {c.npu} chip {c.chip} ({c.bus_id}) health {c.health}" for c in bad)
        return Check("driver", "FAIL", f"{lst}; {detail}",
                     f"npu-smi info -t health -i {bad[0].npu} shows the alarm codes; exclude the chip with "
                     "--devices (scripts) / ASCEND_RT_VISIBLE_DEVICES or have the node serviced")
    if want is not None and len(info.chips) < want:
        return Check("driver", "FAIL", f"{len(info.chips)} chips, the layout needs {want} per node; {detail}",
                     "check /dev/davinci* are all passed to the container and npu-smi info lists every chip")
    busy = [c for c in info.chips if c.hbm_total_mb and c.hbm_used_mb > HBM_BUSY_FRACTION * c.hbm_total_mb]
    if warn or busy:
        lst = [f"NPU {c.npu} chip {c.chip} health Warning" for c in warn]
        lst += [f"NPU {c.npu} chip {c.chip} has {c.hbm_used_mb} of {c.hbm_total_mb} MB HBM in use" for c in busy]
        return Check("driver", "WARN", "; ".join(lst) + f"; {detail}",
                     "another process holds HBM (npu-smi info shows it): stop it before serving"
                     if busy else f"npu-smi info -t health -i {warn[0].npu}")
    return Check("driver", "OK", detail + ", all chips OK")


def _dist_version(*names: str) -> str | None:
    for n in names:
        try:
            return importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_torch(plan: Plan, versions: dict | None = None) -> Check:
    """``versions`` ({"torch": ..., "torch_npu": ...}) overrides what is installed (tests)."""
    v = versions if versions is not None else {"torch": _dist_version("torch"),
                                               "torch_npu": _dist_version("torch_npu", "torch-npu")}
    tv, nv = v.get("torch"), v.get("torch_npu")
    if tv is None:
        return Check("torch", "FAIL", "torch is not installed", "pip install torch==<the version torch_npu needs>")
    rng = ep.base_version(tv)[:2]
    note = "" if (2, 10) <= rng < (2, 14) else " (outside this package's tested range 2.10-2.13)"
    if plan.device != "npu":
        return Check("torch", "WARN" if note else "OK", f"torch {tv}{note}; torch_npu not needed for --device "
                     f"{plan.device}", "install a torch in 2.10-2.13" if note else "")
    if nv is None:
        want = ".".join(map(str, ep.base_version(tv)))
        return Check("torch", "FAIL", f"torch {tv}, torch_npu not installed",
                     f"pip install torch-npu=={want}.postN (the torch_npu release for torch {want} and your CANN)")
    if not ep.torch_npu_matches(tv, nv):
        return Check("torch", "FAIL", f"torch {tv} with torch_npu {nv}: torch_npu is built for one torch release",
                     f"pip install torch=={'.'.join(map(str, ep.base_version(nv)))} (or the torch_npu for torch {tv})")
    return Check("torch", "WARN" if note else "OK", f"torch {tv} + torch_npu {nv} (matching){note}",
                 "install a torch / torch_npu pair in 2.10-2.13" if note else "")


def check_custom_ops(plan: Plan, model_type: str | None) -> Check:
    if plan.device != "npu":
        return Check("custom-ops", "SKIP", f"not needed for --device {plan.device}")
    from ..models import FAMILIES

    family = FAMILIES.get(model_type or "")
    if family is not None and not family.needs_custom_ops:
        return Check("custom-ops", "SKIP", f"{family.title} runs on torch_npu's built-in ops")
    roots = [p for p in plan.env.get("ASCEND_CUSTOM_OPP_PATH", "").split(":") if p]
    missing_roots = [p for p in roots if not os.path.isdir(p)]
    if plan.env.get("ASCEND_OPP_PATH"):
        roots.append(plan.env["ASCEND_OPP_PATH"])
    found = ep.custom_op_headers([r for r in roots if os.path.isdir(r)])
    names = {n for ops in found.values() for n in ops}
    have = [k for k, alts in WANTED_CUSTOM_OPS.items() if any(a in n for a in alts for n in names)]
    missing = [k for k in WANTED_CUSTOM_OPS if k not in have]
    fix = ("install the vllm-ascend or cann-recipes-infer custom-op package built for your SoC and source its "
           "set_env.bash (scripts/*.sh --opp-env FILE); check ASCEND_CUSTOM_OPP_PATH")
    where = f"{len(found)} vendor folder(s): " + ", ".join(os.path.basename(d.rstrip('/')) for d in found) \
        if found else "no custom-op vendor folder"
    if missing_roots:
        return Check("custom-ops", "WARN", f"ASCEND_CUSTOM_OPP_PATH names missing folder(s) "
                     f"{', '.join(missing_roots)}; {where}", fix)
    if missing:
        return Check("custom-ops", "WARN", f"{where}; missing fused op(s) {', '.join(missing)}: those run the "
                     "reference implementation on the NPU (correct, slow)", fix)
    return Check("custom-ops", "OK", f"{where}; all {len(WANTED_CUSTOM_OPS)} fused V4 ops found")


def check_hccl_nics(plan: Plan, probe: Probe) -> Check:
    if plan.device != "npu":
        return Check("hccl-nics", "SKIP", f"not needed for --device {plan.device}")
    sev = "FAIL" if plan.nodes > 1 else "WARN"  # one node talks over HCCS; the NICs carry cross-node traffic
    n = len(probe.chips) if probe.chips else plan.expected_npus()
    if n is None:
        return Check("hccl-nics", "SKIP", "device count unknown (npu-smi failed and no --platform)")
    if ep.run_tool(["hccn_tool", "-h"]).found is False:
        return Check("hccl-nics", sev, "hccn_tool not on PATH: NPU NICs not checked",
                     "mount /usr/local/Ascend/driver/tools/hccn_tool (and /etc/hccn.conf) into the container")
    problems, ips = [], {}
    for d in range(n):
        link = ep.parse_hccn_link(ep.run_tool(["hccn_tool", "-i", str(d), "-link", "-g"]).out)
        health = ep.parse_hccn_net_health(ep.run_tool(["hccn_tool", "-i", str(d), "-net_health", "-g"]).out)
        ip = ep.parse_hccn_ip(ep.run_tool(["hccn_tool", "-i", str(d), "-ip", "-g"]).out)
        if link != "UP":
            problems.append(f"device {d} link {link or 'unknown'}")
        if health is None or health.lower() != "success":
            problems.append(f"device {d} net health {health or 'unknown'}")
        if ip is None:
            problems.append(f"device {d} has no IP")
        else:
            ips.setdefault(ip, []).append(d)
    problems += [f"devices {', '.join(map(str, ds))} share IP {ip}" for ip, ds in ips.items() if len(ds) > 1]
    if problems:
        return Check("hccl-nics", sev, "; ".join(problems),
                     "check the cable / switch port (hccn_tool -i N -lldp -g), /etc/hccn.conf addresses and "
                     "gateway, then hccn_tool -i N -net_health -g; cross-node: hccn_tool -i N -ping -g address IP")
    return Check("hccl-nics", "OK", f"{n}/{n} NICs link UP, net health Success, IPs {', '.join(ips)}")


def _is_local_ip(ip: str) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


def check_host_env(plan: Plan) -> Check:
    if plan.device != "npu":
        return Check("host-env", "SKIP", f"not needed for --device {plan.device}")
    env = plan.env
    problems, warns = [], []
    if plan.multi_node:
        problems += [f"{v} unset" for v in NIC_VARS if not env.get(v)]
        ip = env.get("HCCL_IF_IP")
        if ip and not _is_local_ip(ip):
            problems.append(f"HCCL_IF_IP={ip} is not an address of this host")
        for v in ("HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
            nic = env.get(v)
            if nic and not os.path.exists(f"/sys/class/net/{nic}"):
                problems.append(f"{v}={nic}: no such NIC")
    warns += [f"{v} unset" for v in RECIPE_VARS if not env.get(v)]
    set_ = [f"{v}={env[v]}" for v in (*NIC_VARS, *RECIPE_VARS) if env.get(v)]
    detail = "; ".join(problems + warns) + ("; " if problems + warns else "") + ("set: " + ", ".join(set_)
                                                                                 if set_ else "none set")
    if problems:
        return Check("host-env", "FAIL", detail, ENV_FIX + " (multi-node: pick the NIC of the cluster network)")
    if warns:
        return Check("host-env", "WARN", detail, ENV_FIX)
    return Check("host-env", "OK", detail)


# ---- table and command line -------------------------------------------------------------------------------

def run_checks(plan: Plan, torch_versions: dict | None = None) -> list[Check]:
    """Every check for ``plan``, in table order."""
    from .check_env_cluster import check_memory, check_ray, check_weights, model_type_of

    probe = Probe()
    mtype = model_type_of(plan.model)
    rows = [check_cann(plan), check_driver(plan, probe), check_torch(plan, torch_versions),
            check_custom_ops(plan, mtype), check_hccl_nics(plan, probe), check_host_env(plan)]
    rows += check_ray(plan)
    rows += [check_memory(plan, probe), check_weights(plan)]
    return rows


def format_table(rows: list[Check]) -> str:
    w = max(len(r.name) for r in rows)
    out = [f"{'check':<{w}}  verdict  detail"]
    for r in rows:
        out.append(f"{r.name:<{w}}  {r.verdict:<7}  {r.detail}")
        if r.fix and r.verdict in ("WARN", "FAIL"):
            out.append(f"{'':<{w}}  {'':<7}  -> fix: {r.fix}")
    counts = {v: sum(r.verdict == v for r in rows) for v in VERDICTS}
    out.append(", ".join(f"{n} {v}" for v, n in counts.items()) +
               ("  => NOT ready: fix the FAIL rows" if counts["FAIL"] else "  => ready"))
    return "\n".join(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="npu", choices=("npu", "cuda", "cpu"), help="device to serve on (default npu)")
    p.add_argument("--platform", default=None, choices=("a2", "a3"), help="Atlas A2 (8 NPUs/node) or A3 (16)")
    p.add_argument("--npus-per-node", type=int, default=None, help="NPUs each node must have (default: platform's)")
    p.add_argument("--nodes", type=int, default=1, help="nodes of the deployment")
    p.add_argument("--distributed-executor-backend", default=None, choices=("mp", "ray"),
                   help="default: ray when --nodes > 1, else mp")
    p.add_argument("--ray-address", default=None, help="Ray cluster (default $RAY_ADDRESS, else auto)")
    p.add_argument("--model", default=None, help="preset name or model folder (memory plan, weights check)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--enable-expert-parallel", action="store_true")
    p.add_argument("--max-model-len", type=int, default=32768, help="context per sequence for the KV plan")
    p.add_argument("--max-num-seqs", type=int, default=8, help="sequences per data-parallel replica")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of free HBM the plan may use")
    p.add_argument("--ascend-root", default="/usr/local/Ascend", help="install root (driver/firmware version files)")
    p.add_argument("--check-collectives", action="store_true",
                   help="with Ray: start one actor per rank of the layout, form the process groups across the nodes "
                        "and all-reduce (no weights loaded)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")


def plan_from_args(a: argparse.Namespace) -> Plan:
    from ..errors import AscendDSV4Error

    for name in ("nodes", "tensor_parallel_size", "data_parallel_size", "max_model_len", "max_num_seqs"):
        if getattr(a, name) < 1:
            raise AscendDSV4Error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if not 0 < a.gpu_memory_utilization <= 1:
        raise AscendDSV4Error(f"--gpu-memory-utilization must be in (0, 1], got {a.gpu_memory_utilization}")
    backend = a.distributed_executor_backend or ("ray" if a.nodes > 1 else "mp")
    if a.nodes > 1 and backend != "ray":
        raise AscendDSV4Error("--nodes > 1 needs --distributed-executor-backend ray")
    return Plan(device=a.device, platform=a.platform, npus_per_node=a.npus_per_node, nodes=a.nodes, backend=backend,
                ray_address=a.ray_address or os.environ.get("RAY_ADDRESS"), model=a.model,
                tp=a.tensor_parallel_size, dp=a.data_parallel_size, ep=a.enable_expert_parallel,
                max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                memory_utilization=a.gpu_memory_utilization, ascend_root=a.ascend_root,
                check_collectives=a.check_collectives)


def main(a: argparse.Namespace) -> int:
    rows = run_checks(plan_from_args(a))
    if a.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        print(format_table(rows))
    return 1 if any(r.verdict == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="ascend-dsv4 check-env")
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
