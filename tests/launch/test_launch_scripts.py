"""The launch scripts under scripts/: --dry-run output for a 1 x A3 and a 2 x A2 cluster, argument errors, a
real (non-dry) run against stand-in `ray` / `python3` executables that record what they were called with and in
which environment, and shellcheck when it is installed."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "scripts")
JEMALLOC = "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2"  # passed explicitly: dry runs check no files


def run(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    e.update(env or {})
    return subprocess.run(["bash", os.path.join(SCRIPTS, script), *args], capture_output=True, text=True, env=e,
                          timeout=60)


def dry(script: str, *args: str) -> list[str]:
    r = run(script, "--dry-run", "--jemalloc", JEMALLOC, *args)
    assert r.returncode == 0, r.stderr
    # the dry run prints a runnable script: bash must parse it
    assert subprocess.run(["bash", "-n"], input=r.stdout, text=True).returncode == 0, r.stdout
    return [ln for ln in r.stdout.splitlines() if ln.strip()]


def exports(lines: list[str]) -> dict[str, str]:
    """export NAME=VALUE  # why   ->  {NAME: VALUE}; every export must carry its reason."""
    out = {}
    for ln in lines:
        m = re.match(r"export ([A-Z_]+)=(.*?)  # (.+)$", ln)
        if ln.startswith("export "):
            assert m, f"export without a '# why' comment: {ln}"
            out[m.group(1)] = m.group(2).strip("'")
    return out


def index_of(lines: list[str], prefix: str) -> int:
    hits = [i for i, ln in enumerate(lines) if ln.startswith(prefix)]
    assert len(hits) == 1, (prefix, lines)
    return hits[0]


RECIPE_VARS = {"HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "HCCL_BUFFSIZE", "HCCL_OP_EXPANSION_MODE",
               "PYTORCH_NPU_ALLOC_CONF", "TASK_QUEUE_ENABLE", "OMP_PROC_BIND", "OMP_NUM_THREADS", "LD_PRELOAD",
               "ASCEND_RT_VISIBLE_DEVICES"}
NETWORK_VARS = {"HCCL_IF_IP", "HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"}


# ---- 2 x A2: head + worker + serve over Ray ------------------------------------------------------------

def test_two_a2_nodes_head_worker_serve():
    head = dry("ray_head.sh", "--platform", "a2", "--nic", "enp189s0f0", "--ip", "10.0.0.1", "--restart")
    env = exports(head)
    assert RECIPE_VARS | NETWORK_VARS | {"RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"} <= set(env)
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert env["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"] == "1"
    assert env["HCCL_IF_IP"] == "10.0.0.1" and env["GLOO_SOCKET_IFNAME"] == "enp189s0f0"
    assert env["HCCL_INTRA_PCIE_ENABLE"] == "1" and env["HCCL_INTRA_ROCE_ENABLE"] == "0"  # A2 multi-node only
    assert env["LD_PRELOAD"] == JEMALLOC and env["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
    # order: CANN first, then the environment, then (re)start Ray, then the join check
    src = index_of(head, "source /usr/local/Ascend/ascend-toolkit/set_env.sh")
    last_export = max(i for i, ln in enumerate(head) if ln.startswith("export "))
    stop, start = index_of(head, "ray stop --force"), index_of(head, "ray start --head")
    check = index_of(head, "python3 -m ascend_dsv4.entrypoints.ray_cluster wait")
    assert src < last_export < stop < start < check
    assert "--node-ip-address=10.0.0.1" in head[start] and "--resources '{\"NPU\": 8}'" in head[start]
    assert "--address 10.0.0.1:6379 --node-ip 10.0.0.1 --npus-per-node 8" in head[check]

    worker = dry("ray_worker.sh", "--platform", "a2", "--nic", "enp189s0f0", "--ip", "10.0.0.2",
                 "--head", "10.0.0.1")
    wenv = exports(worker)
    assert wenv["HCCL_IF_IP"] == "10.0.0.2" and wenv["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    start = index_of(worker, "ray start --address=10.0.0.1:6379")
    assert "--node-ip-address=10.0.0.2" in worker[start] and "'{\"NPU\": 8}'" in worker[start]
    check = index_of(worker, "python3 -m ascend_dsv4.entrypoints.ray_cluster wait")
    assert start < check and "--node-ip 10.0.0.2 --npus-per-node 8" in worker[check]
    assert not any(ln.startswith("ray stop") for ln in worker)

    serve = dry("serve_multinode.sh", "--platform", "a2", "--nodes", "2", "--model", "/models/DeepSeek-V4-Pro",
                "--nic", "enp189s0f0", "--ip", "10.0.0.1", "--tensor-parallel-size", "8",
                "--enable-expert-parallel", "--host", "0.0.0.0", "--", "--max-model-len", "32768")
    senv = exports(serve)
    assert senv["RAY_ADDRESS"] == "10.0.0.1:6379"
    wait = index_of(serve, "python3 -m ascend_dsv4.entrypoints.ray_cluster wait")
    assert "--nodes 2 --npus-per-node 8 --timeout 600" in serve[wait]
    cmd = serve[index_of(serve, "exec ascend-dsv4 serve")]
    assert wait < serve.index(cmd) and serve[-1] == cmd
    assert cmd == ("exec ascend-dsv4 serve --model /models/DeepSeek-V4-Pro --device npu "
                   "--distributed-executor-backend ray --tensor-parallel-size 8 --data-parallel-size 2 "
                   "--enable-expert-parallel --host 0.0.0.0 --port 8000 --max-model-len 32768")


# ---- 1 x A3: one node of 16 NPUs --------------------------------------------------------------------------

def test_one_a3_node_over_ray_and_single_node():
    head = dry("ray_head.sh", "--platform", "a3", "--nic", "eth0", "--ip", "10.1.0.1")
    env = exports(head)
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == ",".join(map(str, range(16)))
    assert "HCCL_INTRA_PCIE_ENABLE" not in env  # A2-only
    assert "'{\"NPU\": 16}'" in head[index_of(head, "ray start --head")]
    serve = dry("serve_multinode.sh", "--platform", "a3", "--nodes", "1", "--model", "/m", "--nic", "eth0",
                "--ip", "10.1.0.1")
    assert "--nodes 1 --npus-per-node 16" in serve[index_of(serve, "python3 -m ascend_dsv4")]
    # default TP 8 (DeepSeek-V4's o_groups = 8 caps TP), the node's 16 NPUs as DP 2
    assert serve[-1].endswith("--distributed-executor-backend ray --tensor-parallel-size 8 "
                              "--data-parallel-size 2 --host 127.0.0.1 --port 8000")
    tp16 = dry("serve_multinode.sh", "--platform", "a2", "--nodes", "2", "--model", "/m", "--nic", "eth0",
               "--ip", "10.1.0.1", "--tensor-parallel-size", "16")  # V3/R1: TP across both nodes, no DP flag
    assert tp16[-1].endswith("--distributed-executor-backend ray --tensor-parallel-size 16 --host 127.0.0.1 "
                             "--port 8000")

    single = dry("serve_single_node.sh", "--platform", "a3", "--model", "/m", "--enable-expert-parallel")
    senv = exports(single)
    assert RECIPE_VARS <= set(senv) and not (NETWORK_VARS & set(senv))  # no --nic: no network variables
    assert "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES" not in senv  # no Ray on one node
    assert not any(ln.startswith(("ray ", "python3 -m ascend_dsv4.entrypoints.ray_cluster")) for ln in single)
    assert single[-1] == ("exec ascend-dsv4 serve --model /m --device npu --distributed-executor-backend mp "
                          "--tensor-parallel-size 8 --data-parallel-size 2 --enable-expert-parallel "
                          "--host 127.0.0.1 --port 8000")
    a2 = dry("serve_single_node.sh", "--platform", "a2", "--model", "/m")  # TP 8, no DP flag
    assert a2[-1] == ("exec ascend-dsv4 serve --model /m --device npu --distributed-executor-backend mp "
                      "--tensor-parallel-size 8 --host 127.0.0.1 --port 8000")


def test_env_template_detects_nic_in_the_printed_script():
    lines = dry("ascend_env.sh", "--platform", "a2", "--devices", "0,1,2,3", "--hccl-buffsize", "2048",
                "--opp-env", "/opt/ops/vendors/custom_transformer/bin/set_env.bash")
    env = exports(lines)
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3" and env["HCCL_BUFFSIZE"] == "2048"
    assert "threads per rank; 4 ranks share" in next(ln for ln in lines if ln.startswith("export OMP_NUM_THREADS"))
    # no --nic / --ip: the printed script finds them itself
    assert "ip -o -4 route show to default" in env["HCCL_SOCKET_IFNAME"]
    assert "ip -o -4 addr show dev ${HCCL_SOCKET_IFNAME}" in env["HCCL_IF_IP"]
    assert env["GLOO_SOCKET_IFNAME"] == '"${HCCL_SOCKET_IFNAME}"'
    assert index_of(lines, "export HCCL_SOCKET_IFNAME") < index_of(lines, "export HCCL_IF_IP")
    assert index_of(lines, "source /usr/local/Ascend") < index_of(lines, "source /opt/ops/vendors")


@pytest.mark.parametrize("script, args, needle", [
    ("ray_head.sh", [], "--platform a2|a3 is required"),
    ("ray_head.sh", ["--platform", "a5"], "--platform must be a2"),
    ("ray_head.sh", ["--platform", "a2", "--devices", "0,8"], "NPU 8 does not exist on a2"),
    ("ray_head.sh", ["--platform", "a2", "--bogus"], "unknown option '--bogus'"),
    ("ray_head.sh", ["--platform", "a2", "--port"], "--port needs a value"),
    ("ray_worker.sh", ["--platform", "a2"], "--head HEAD_IP[:PORT] is required"),
    ("serve_multinode.sh", ["--platform", "a2", "--nodes", "2", "--model", "/m", "--tensor-parallel-size", "8",
                            "--data-parallel-size", "4"], "TP 8 x DP 4 = 32 ranks, but 2 node(s) x 8 NPUs = 16"),
    ("serve_multinode.sh", ["--platform", "a2", "--model", "/m"], "--nodes N (>= 1) is required"),
    ("serve_single_node.sh", ["--platform", "a3", "--model", "/m", "--tensor-parallel-size", "8",
                              "--data-parallel-size", "4"], "TP 8 x DP 4 needs 32 NPUs, the node has 16"),
    ("serve_single_node.sh", ["--platform", "a2", "--model", "/m", "--tensor-parallel-size", "16"],
     "TP 16 needs 16 NPUs, the node has 8"),
])
def test_argument_errors(script, args, needle):
    r = run(script, *args, "--dry-run")
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert r.stdout == "" or "ascend-dsv4 serve" not in r.stdout


@pytest.mark.parametrize("script", ["ascend_env.sh", "ray_head.sh", "ray_worker.sh", "serve_multinode.sh",
                                    "serve_single_node.sh"])
def test_help(script):
    r = run(script, "--help")
    assert r.returncode == 0 and "Usage: scripts/" + script in r.stdout and "--dry-run" in r.stdout
    with open(os.path.join(SCRIPTS, script)) as f:
        assert "set -euo pipefail" in f.read()


# ---- a real run against stand-ins -------------------------------------------------------------------------

def _stub(path: str, body: str) -> None:
    with open(path, "w") as f:
        f.write("#!/usr/bin/env bash\n" + body)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)


def test_real_run_sets_the_environment_before_ray_start(tmp_path):
    """Without --dry-run: set_env.sh is sourced, the variables are in the environment `ray start` runs in, and
    the join check runs after it; a failing join check fails the script."""
    log = tmp_path / "calls.log"
    _stub(str(tmp_path / "ray"), f'echo "ray $* | IF_IP=$HCCL_IF_IP VIS=$ASCEND_RT_VISIBLE_DEVICES '
                                 f'NOSET=$RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES HOME=$ASCEND_HOME_PATH" '
                                 f'>> {log}\n')
    _stub(str(tmp_path / "py"), f'echo "python $* | BUF=$HCCL_BUFFSIZE" >> {log}\nexit "${{WAIT_RC:-0}}"\n')
    set_env = tmp_path / "set_env.sh"
    set_env.write_text("export ASCEND_HOME_PATH=/fake/cann/latest\n")
    args = ["--platform", "a2", "--nic", "lo", "--ip", "127.0.0.1", "--cann-env", str(set_env),
            "--jemalloc", "none"]
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "RAY": str(tmp_path / "ray"), "PYTHON": str(tmp_path / "py")}
    r = run("ray_head.sh", *args, env=env)
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    assert calls[0].startswith("ray start --head --port=6379 --node-ip-address=127.0.0.1")
    assert "IF_IP=127.0.0.1 VIS=0,1,2,3,4,5,6,7 NOSET=1 HOME=/fake/cann/latest" in calls[0]
    assert calls[1].startswith("python -m ascend_dsv4.entrypoints.ray_cluster wait --address 127.0.0.1:6379")
    assert calls[1].endswith("BUF=1024")
    assert "export HCCL_IF_IP=127.0.0.1" in r.stderr  # the real run logs what it sets

    log.unlink()
    r = run("ray_head.sh", *args, env={**env, "WAIT_RC": "1"})
    assert r.returncode == 1 and len(log.read_text().splitlines()) == 2

    r = run("ray_head.sh", "--platform", "a2", "--nic", "lo", "--ip", "127.0.0.1", "--cann-env",
            str(tmp_path / "missing.sh"), env=env)
    assert r.returncode == 2 and "missing.sh not found" in r.stderr


def test_dry_run_output_is_the_script_that_runs(tmp_path):
    """A dry run without --nic / --ip prints detection commands; running the printed script (with stand-in `ip`,
    `ray`, `python3`) resolves the NIC and address once and hands them to `ray start` and the join check."""
    log = tmp_path / "calls.log"
    _stub(str(tmp_path / "ip"), 'case "$*" in\n'
          '  "-o -4 route show to default") echo "default via 10.9.0.254 dev eth7 proto static" ;;\n'
          '  "-o -4 addr show dev eth7") echo "2: eth7    inet 10.9.0.7/24 brd 10.9.0.255 scope global eth7" ;;\n'
          '  *) echo "unexpected ip $*" >&2; exit 1 ;;\nesac\n')
    _stub(str(tmp_path / "ray"), f'echo "ray $* | NIC=$GLOO_SOCKET_IFNAME" >> {log}\n')
    _stub(str(tmp_path / "python3"), f'echo "python3 $*" >> {log}\n')
    cann = tmp_path / "set_env.sh"
    cann.write_text("export ASCEND_HOME_PATH=/fake\n")
    r = run("ray_head.sh", "--platform", "a3", "--dry-run", "--jemalloc", "none", "--cann-env", str(cann))
    assert r.returncode == 0, r.stderr
    ran = subprocess.run(["bash", "-euo", "pipefail"], input=r.stdout, text=True, capture_output=True,
                         env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert ran.returncode == 0, ran.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == ("ray start --head --port=6379 --node-ip-address=10.9.0.7 --dashboard-port=8265 "
                        '--resources {"NPU": 16} | NIC=eth7')
    assert calls[1] == ("python3 -m ascend_dsv4.entrypoints.ray_cluster wait --address 10.9.0.7:6379 "
                        "--node-ip 10.9.0.7 --npus-per-node 16 --timeout 120")


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (apt install shellcheck)")
def test_shellcheck_clean():
    files = [os.path.join(SCRIPTS, f) for f in sorted(os.listdir(SCRIPTS)) if f.endswith(".sh")]
    files.append(os.path.join(SCRIPTS, "lib", "launch_common.sh"))
    r = subprocess.run(["shellcheck", "-x", *files], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
