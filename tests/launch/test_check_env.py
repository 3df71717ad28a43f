"""ascend-dsv4 check-env with fake npu-smi / hccn_tool executables on PATH printing recorded outputs
(tests/launch/fixtures/README.md): a healthy A3 node, one unhealthy A2 chip, a NIC link down, CANN not sourced,
torch / torch_npu mismatch, missing custom ops, memory plans that fit and do not fit, broken weights, and the
Ray rows from a recorded probe result."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from ascend_dsv4.entrypoints import check_env as ce
from ascend_dsv4.entrypoints import env_probes as ep
from ascend_dsv4.entrypoints.check_env_cluster import check_memory, check_weights, evaluate_ray

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")

HCCN = """#!/usr/bin/env bash
[[ $1 == -h ]] && { echo "usage: hccn_tool -i <device> ..."; exit 0; }
dev=$2
down=",${FAKE_HCCN_LINK_DOWN:-},"
case $3 in
  -link) if [[ $down == *",$dev,"* ]]; then echo "link status: DOWN"; else echo "link status: UP"; fi ;;
  -net_health) if [[ $down == *",$dev,"* ]]; then echo "net health status: Fault"; else echo "net health status: Success"; fi ;;
  -ip) echo "ipaddr:29.1.1.$((dev + 1))"; echo "netmask:255.255.255.0" ;;
  *) echo "unknown option $3" >&2; exit 1 ;;
esac
"""


def _exe(path, body: str) -> None:
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A fake Ascend node: npu-smi + hccn_tool on PATH, a CANN tree, a custom-op vendor folder, the recipe env."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    _exe(bin_ / "npu-smi", '#!/usr/bin/env bash\n[[ $1 == info ]] || exit 1\ncat "$FAKE_NPU_SMI"\n')
    _exe(bin_ / "hccn_tool", HCCN)
    cann = tmp_path / "Ascend" / "ascend-toolkit" / "latest"
    (cann / "aarch64-linux").mkdir(parents=True)
    (cann / "aarch64-linux" / "ascend_toolkit_install.info").write_text(
        "package_name=Ascend-cann-toolkit\nversion=8.2.RC1\narch=aarch64\nos=linux\n")
    (tmp_path / "Ascend" / "driver").mkdir()
    (tmp_path / "Ascend" / "driver" / "version.info").write_text("Version=25.2.0\nascendhal_version=7.35.23\n")
    opp = tmp_path / "opp" / "vendors" / "custom_transformer"
    (opp / "op_api" / "include").mkdir(parents=True)
    for op in ("npu_sparse_attn_sharedkv", "compressor", "vllm_quant_lightning_indexer", "hc_pre", "hc_post",
               "inplace_partial_rotary_mul", "moe_gating_top_k_hash"):
        (opp / "op_api" / "include" / f"aclnn_{op}.h").write_text("")
    env = {"PATH": f"{bin_}:{os.environ['PATH']}", "ASCEND_HOME_PATH": str(cann), "ASCEND_CUSTOM_OPP_PATH": str(opp),
           "FAKE_NPU_SMI": os.path.join(FIX, "npu_smi_info_a3_healthy.txt"), "HCCL_CONNECT_TIMEOUT": "1200",
           "HCCL_BUFFSIZE": "1024", "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True", "TASK_QUEUE_ENABLE": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("HCCL_IF_IP", "HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "RAY_ADDRESS", "FAKE_HCCN_LINK_DOWN"):
        monkeypatch.delenv(k, raising=False)
    return {"tmp": tmp_path, "env": env, "root": str(tmp_path / "Ascend")}


def _plan(node, **kw) -> ce.Plan:
    kw.setdefault("ascend_root", node["root"])
    return ce.Plan(env=dict(os.environ), **kw)


def _rows(plan, torch_npu="2.13.0.post1") -> dict[str, ce.Check]:
    rows = ce.run_checks(plan, torch_versions={"torch": "2.13.0+cpu", "torch_npu": torch_npu})
    return {r.name: r for r in rows}


def test_parse_recorded_npu_smi():
    with open(os.path.join(FIX, "npu_smi_info_a3_healthy.txt")) as f:
        a3 = ep.parse_npu_smi_info(f.read())
    assert a3.version == "26.0.rc2" and len(a3.chips) == 16
    assert [(c.npu, c.chip) for c in a3.chips[:3]] == [(0, 0), (0, 1), (1, 0)]
    assert a3.chips[0].hbm_used_mb == 3419 and a3.chips[1].hbm_used_mb == 2874 and a3.chips[0].hbm_total_mb == 65536
    assert a3.chips[1].bus_id == "0000:9F:00.0" and all(c.health == "OK" for c in a3.chips)
    with open(os.path.join(FIX, "npu_smi_info_a2_one_alarm.txt")) as f:
        a2 = ep.parse_npu_smi_info(f.read())
    assert a2.version == "23.0.rc3" and len(a2.chips) == 8 and {c.chip for c in a2.chips} == {0}
    assert [c.npu for c in a2.chips if c.health != "OK"] == [3] and a2.chips[3].health == "Alarm"
    assert ep.parse_npu_smi_info("npu-smi: command output without a table").chips == []


def test_parse_hccn_and_versions():
    assert ep.parse_hccn_link("link status: UP\n") == "UP" and ep.parse_hccn_link("link status: DOWN") == "DOWN"
    assert ep.parse_hccn_net_health("net health status: Receive timeout\n") == "Receive timeout"
    assert ep.parse_hccn_ip("ipaddr:29.1.112.213\nnetmask:255.255.0.0\n") == "29.1.112.213"
    assert ep.parse_hccn_ip("") is None and ep.parse_hccn_link("error") is None
    assert ep.torch_npu_matches("2.5.1", "2.5.1.post2") and ep.torch_npu_matches("2.13.0+cpu", "2.13.0")
    assert not ep.torch_npu_matches("2.6.0", "2.5.1.post2") and not ep.torch_npu_matches("2.5", "2.5.0")


def test_healthy_a3_node_is_ready(node):
    rows = _rows(_plan(node, platform="a3", model="deepseek-v4-flash", tp=8, dp=2, ep=True))
    verdicts = {k: r.verdict for k, r in rows.items()}
    assert verdicts == {"cann": "OK", "driver": "OK", "torch": "OK", "custom-ops": "OK", "hccl-nics": "OK",
                        "host-env": "OK", "ray": "SKIP", "memory": "OK", "weights": "SKIP"}, rows
    assert "CANN 8.2.RC1" in rows["cann"].detail
    assert "16 chips Ascend910 on 8 NPUs" in rows["driver"].detail and "driver 25.2.0" in rows["driver"].detail
    assert "16/16 NICs link UP" in rows["hccl-nics"].detail and "29.1.1.16" in rows["hccl-nics"].detail
    assert "vs " in rows["memory"].detail and "free on the fullest chip" in rows["memory"].detail
    text = ce.format_table(list(rows.values()))
    assert text.splitlines()[-1].startswith("7 OK, 0 WARN, 0 FAIL, 2 SKIP") and "ready" in text


def test_one_unhealthy_chip_fails(node, monkeypatch):
    monkeypatch.setenv("FAKE_NPU_SMI", os.path.join(FIX, "npu_smi_info_a2_one_alarm.txt"))
    rows = _rows(_plan(node, platform="a2"))
    d = rows["driver"]
    assert d.verdict == "FAIL" and "NPU 3 chip 0 (0000:02:00.0) health Alarm" in d.detail
    assert "npu-smi info -t health -i 3" in d.fix
    assert rows["hccl-nics"].detail.startswith("8/8 NICs")  # device count taken from npu-smi


def test_chip_count_below_platform_fails(node, monkeypatch):
    monkeypatch.setenv("FAKE_NPU_SMI", os.path.join(FIX, "npu_smi_info_a2_healthy.txt"))
    d = _rows(_plan(node, platform="a3"))["driver"]
    assert d.verdict == "FAIL" and d.detail.startswith("8 chips, the layout needs 16 per node")


def test_link_down(node, monkeypatch):
    monkeypatch.setenv("FAKE_HCCN_LINK_DOWN", "5")
    probe = ce.Probe()
    ce.check_driver(_plan(node, platform="a3"), probe)
    single = ce.check_hccl_nics(_plan(node, platform="a3"), probe)
    assert single.verdict == "WARN" and single.detail == "device 5 link DOWN; device 5 net health Fault"
    multi = ce.check_hccl_nics(_plan(node, platform="a3", nodes=2, backend="ray"), probe)
    assert multi.verdict == "FAIL" and "hccn_tool -i N -lldp -g" in multi.fix


def test_missing_tools_and_cann_not_sourced(node, monkeypatch, tmp_path):
    import ascend_dsv4.entrypoints.check_env_cluster as cc

    monkeypatch.setattr(cc, "check_ray", lambda plan: [ce.Check("ray", "SKIP", "not probed in this test")])
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.delenv("ASCEND_HOME_PATH")
    (tmp_path / "Ascend" / "ascend-toolkit" / "set_env.sh").write_text("export ASCEND_HOME_PATH=...\n")
    rows = _rows(_plan(node, platform="a2", nodes=2, backend="ray"), torch_npu=None)
    assert rows["cann"].verdict == "FAIL" and "set_env.sh was not sourced" in rows["cann"].detail
    assert rows["driver"].verdict == "FAIL" and "npu-smi not on PATH" in rows["driver"].detail
    assert rows["hccl-nics"].verdict == "FAIL" and "hccn_tool not on PATH" in rows["hccl-nics"].detail
    assert rows["torch"].verdict == "FAIL" and "pip install torch-npu==2.13.0" in rows["torch"].fix
    assert rows["host-env"].verdict == "FAIL" and "HCCL_IF_IP unset" in rows["host-env"].detail


def test_torch_npu_mismatch_and_custom_ops_missing(node, monkeypatch, tmp_path):
    t = ce.check_torch(_plan(node), {"torch": "2.6.0", "torch_npu": "2.5.1.post2"})
    assert t.verdict == "FAIL" and "pip install torch==2.5.1" in t.fix
    for h in (tmp_path / "opp" / "vendors" / "custom_transformer" / "op_api" / "include").glob("aclnn_hc_*.h"):
        h.unlink()
    c = ce.check_custom_ops(_plan(node), "deepseek_v4")
    assert c.verdict == "WARN" and "missing fused op(s) hc_pre, hc_post" in c.detail
    assert ce.check_custom_ops(_plan(node), "deepseek_v3").verdict == "SKIP"


def test_memory_plan(node):
    probe = ce.Probe()
    ce.check_driver(_plan(node, platform="a2"), probe)
    pro = check_memory(_plan(node, platform="a2", model="deepseek-v4-pro", tp=8), probe)
    assert pro.verdict == "FAIL" and "W8A8 / W4A8" in pro.fix
    ok = check_memory(_plan(node, platform="a2", nodes=4, backend="ray", model="deepseek-v4-pro", tp=8, dp=4,
                            ep=True), probe)
    assert ok.verdict in ("OK", "WARN") and "EP 32" in ok.detail and "experts / 32, split tensors / 8" in ok.detail
    bad = check_memory(_plan(node, platform="a2", model="deepseek-v4-flash", tp=3), probe)
    assert bad.verdict == "FAIL" and "n_heads = 64 is not divisible by tensor_parallel_size 3" in bad.detail
    big = check_memory(_plan(node, platform="a2", model="deepseek-v4-flash", tp=8, dp=2), probe)
    assert big.verdict == "FAIL" and "needs 16 NPUs, 1 node(s) x 8 have 8" in big.detail


@pytest.mark.parametrize("model, tp, ep", [("deepseek-v4-flash", 8, True), ("deepseek-v4-pro", 16, False),
                                           ("deepseek-v3", 8, True)])
def test_rank_weights_agree_with_parallel_plan(model, tp, ep):
    """With DP 1, check-env's per-rank weights are parallel_plan's (the layout the executors load)."""
    from ascend_dsv4.models import load_config
    from ascend_dsv4.entrypoints.check_env_cluster import rank_weight_bytes
    from ascend_dsv4.parallel_plan import rank_weight_bytes as plan_bytes

    cfg = load_config(model)
    assert rank_weight_bytes(cfg, model, tp, tp, ep) == (plan_bytes(cfg, tp, ep), "preset inventory")


def test_weights_folder(node, tmp_path):
    out = tmp_path / "toy"
    from ascend_dsv4.entrypoints.cli import main

    assert main(["make-random-checkpoint", "--out", str(out)]) == 0
    w = check_weights(_plan(node, model=str(out)))
    assert w.verdict == "OK" and "headers and config OK" in w.detail
    shard = sorted(out.glob("*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    w = check_weights(_plan(node, model=str(out)))
    assert w.verdict == "FAIL" and shard.name in w.detail
    assert check_weights(_plan(node, model=str(tmp_path / "nope"))).verdict == "FAIL"


def _ray_node(ip, npus):
    return {"NodeID": ip.replace(".", "") * 4, "Alive": True, "NodeManagerAddress": ip,
            "Resources": {"CPU": 192.0, "NPU": float(npus)}}


def _report(ip, noset="1", vis="0,1,2,3,4,5,6,7"):
    return {"ip": ip, "env": {"ASCEND_RT_VISIBLE_DEVICES": vis, "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": noset,
                              "HCCL_IF_IP": ip, "HCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0"},
            "weights": None}


def test_ray_rows_from_probe(node):
    plan = _plan(node, platform="a2", nodes=2, backend="ray")
    good = {"nodes": [_ray_node("10.0.0.1", 8), _ray_node("10.0.0.2", 8)],
            "reports": [_report("10.0.0.1"), _report("10.0.0.2")], "unanswered": 0}
    rows = {r.name: r for r in evaluate_ray(plan, good)}
    assert rows["ray"].verdict == "OK" and "10.0.0.2 8 NPU" in rows["ray"].detail
    assert rows["ray-env"].verdict == "OK"
    bad = {"nodes": [_ray_node("10.0.0.1", 8), _ray_node("10.0.0.2", 4)],
           "reports": [_report("10.0.0.1"), _report("10.0.0.2", noset=None, vis="0,1,2,3")], "unanswered": 0}
    rows = {r.name: r for r in evaluate_ray(plan, bad)}
    assert rows["ray"].verdict == "FAIL" and "short: 10.0.0.2 has 4 NPU" in rows["ray"].detail
    assert rows["ray-env"].verdict == "FAIL" and "10.0.0.2: RAY_EXPERIMENTAL_NOSET" in rows["ray-env"].detail
    err = evaluate_ray(plan, {"error": "no answer from the Ray cluster at auto within 90 s"})
    assert err[0].verdict == "FAIL" and "scripts/ray_head.sh" in err[0].fix


def test_cli_exit_status_and_json(node, tmp_path):
    """The real command in a child process: torch_npu 'installed' through a dist-info on PYTHONPATH."""
    site = tmp_path / "site"
    (site / "torch_npu-2.13.0.post1.dist-info").mkdir(parents=True)
    (site / "torch_npu-2.13.0.post1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.13.0.post1\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{site}"}
    argv = [sys.executable, "-m", "ascend_dsv4.entrypoints.cli", "check-env", "--platform", "a3",
            "--ascend-root", node["root"]]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "torch 2.13.0+cpu + torch_npu 2.13.0.post1 (matching)" in r.stdout
    env["FAKE_NPU_SMI"] = os.path.join(FIX, "npu_smi_info_a2_one_alarm.txt")
    r = subprocess.run(argv + ["--json"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert rows["driver"]["verdict"] == "FAIL" and "health Alarm" in rows["driver"]["detail"]
