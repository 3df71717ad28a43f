"""Parsers for what Ascend's tools print, and small probes that run them (used by ``ascend-dsv4 check-env``).

Formats (taken from recorded outputs in public threads; the test fixtures under tests/launch/fixtures/ are
those recordings):

* ``npu-smi info`` -- a box table; a header row ``| npu-smi 23.0.rc3   Version: 23.0.rc3 |``, then per chip
  two rows (vllm-ascend issues #2534 and #12980 for A3, two chips per NPU with a ``Phy-ID`` column;
  Project-HAMi/HAMi-WebUI issue #47 for A2, one chip per NPU)::

      | NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
      | Chip  Phy-ID              | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
      | 0     Ascend910           | OK            | 162.6       34                0    / 0             |
      | 0     0                   | 0000:9D:00.0  | 0           0    / 0          3419 / 65536         |

  followed by a process table (``| NPU  Chip | Process id | ...``) that is skipped. Health is ``OK`` when the
  chip is fine; anything else (``Warning``, ``Alarm``, ``Critical``, ...) is reported.
* ``hccn_tool -i N -link -g`` -> ``link status: UP`` / ``link status: DOWN``;
  ``hccn_tool -i N -net_health -g`` -> ``net health status: Success`` (else ``Fault``, ``Init``,
  ``Socket fail``, ``Receive timeout``, ``Unreachable``, ...); ``hccn_tool -i N -ip -g`` ->
  ``ipaddr:29.1.112.213`` / ``netmask:255.255.0.0`` (Huawei's HCCN Tool interface reference; the
  vllm-ascend ``tutorials/features/ray.md`` network checks; SH-AIT/BooM ``net_check.sh``).
* CANN: ``$ASCEND_HOME_PATH/<arch>-linux/ascend_toolkit_install.info`` holds ``key=value`` lines with
  ``version=8.0.RC3`` (CANN install guide, "check the version field"); the driver's
  ``/usr/local/Ascend/driver/version.info`` holds ``Version=...``.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

TOOL_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Chip:
    """One chip of ``npu-smi info``: NPU id, chip id within the NPU, name, health, HBM used / total (MB)."""

    npu: int
    chip: int
    name: str
    health: str
    bus_id: str
    hbm_used_mb: int
    hbm_total_mb: int


@dataclass(frozen=True)
class NpuSmiInfo:
    version: str | None
    chips: list[Chip]


_BUS = re.compile(r"^[0-9A-Fa-fx]{4}:[0-9A-Fa-fx]{2}:[0-9A-Fa-fx]{2}\.[0-9A-Fa-fx]$")


def _cells(line: str) -> list[str]:
    s = line.strip()
    if not (s.startswith("|") and s.endswith("|")):
        return []
    return [c.strip() for c in s[1:-1].split("|")]


def parse_npu_smi_info(text: str) -> NpuSmiInfo:
    """``npu-smi info`` text -> version + one :class:`Chip` per chip row pair (see the module docstring)."""
    m = re.search(r"Version:\s*(\S+)", text)
    version = m.group(1) if m else None
    chips: list[Chip] = []
    lines = text.splitlines()
    for i in range(len(lines) - 1):
        a, b = _cells(lines[i]), _cells(lines[i + 1])
        if len(a) < 3 or len(b) < 3 or not _BUS.match(b[1]):
            continue
        head = a[0].split()
        if len(head) < 2 or not head[0].isdigit() or not b[0].split() or not b[0].split()[0].isdigit():
            continue
        pairs = re.findall(r"(\d+)\s*/\s*(\d+)", b[2])
        used, total = (int(pairs[-1][0]), int(pairs[-1][1])) if pairs else (0, 0)
        chips.append(Chip(npu=int(head[0]), chip=int(b[0].split()[0]), name=" ".join(head[1:]), health=a[1],
                          bus_id=b[1], hbm_used_mb=used, hbm_total_mb=total))
    return NpuSmiInfo(version, chips)


def parse_hccn_link(text: str) -> str | None:
    """``link status: UP`` -> ``"UP"`` (None when the text has no link status)."""
    m = re.search(r"link status\s*:\s*(\S+)", text, re.IGNORECASE)
    return m.group(1).upper() if m else None


def parse_hccn_net_health(text: str) -> str | None:
    """``net health status: Success`` -> ``"Success"`` (the rest of the line; None when absent)."""
    m = re.search(r"net health status\s*:\s*(.+)", text, re.IGNORECASE)
    return m.group(1).strip() if m else None


def parse_hccn_ip(text: str) -> str | None:
    """``ipaddr:29.1.112.213`` -> ``"29.1.112.213"`` (None when the device has no address)."""
    m = re.search(r"ipaddr\s*:\s*([0-9.]+)", text)
    return m.group(1) if m else None


def parse_key_values(text: str) -> dict[str, str]:
    """``key=value`` lines (CANN ``*_install.info``, driver ``version.info``) -> dict with lower-case keys."""
    out = {}
    for line in text.splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            out[k.strip().lower()] = v.strip()
    return out


def base_version(v: str) -> tuple[int, ...]:
    """``"2.5.1.post2"`` / ``"2.13.0+cpu"`` -> ``(2, 5, 1)``: the leading release numbers (at most 3)."""
    nums = []
    for part in re.split(r"[.+]", v):
        if not part.isdigit():
            break
        nums.append(int(part))
    return tuple(nums[:3])


def torch_npu_matches(torch_version: str, torch_npu_version: str) -> bool:
    """torch_npu ``X.Y.Z[.postN]`` is built for torch ``X.Y.Z`` exactly (torch_npu's version policy)."""
    return base_version(torch_version) == base_version(torch_npu_version) and len(base_version(torch_version)) == 3


# ---- probes ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolResult:
    """A tool's run: ``found`` False when not on PATH; ``rc`` / ``out`` otherwise (``rc`` None on timeout)."""

    found: bool
    rc: int | None = None
    out: str = ""


def run_tool(argv: list[str], timeout: float = TOOL_TIMEOUT_S) -> ToolResult:
    """Run ``argv`` (found on PATH) with a timeout; stdout and stderr together."""
    exe = shutil.which(argv[0])
    if exe is None:
        return ToolResult(found=False)
    try:
        p = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return ToolResult(found=True, rc=None, out=f"{argv[0]} did not answer within {timeout:g} s")
    except OSError as e:
        return ToolResult(found=True, rc=126, out=str(e))
    return ToolResult(found=True, rc=p.returncode, out=p.stdout + p.stderr)


def cann_version(home: str) -> tuple[str | None, str | None]:
    """``(version, info file)`` of the CANN toolkit under ``home`` (``$ASCEND_HOME_PATH``); Nones if absent."""
    pats = [os.path.join(home, "*-linux", "ascend_toolkit_install.info"),
            os.path.join(home, "..", "*-linux", "ascend_toolkit_install.info"),
            os.path.join(home, "version.cfg")]
    for pat in pats:
        for path in sorted(glob.glob(pat)):
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    kv = parse_key_values(f.read())
            except OSError:
                continue
            v = kv.get("version") or kv.get("toolkit_running_version")
            if v:
                return v.strip("[]"), os.path.normpath(path)
    return None, None


def custom_op_headers(opp_roots: list[str]) -> dict[str, list[str]]:
    """aclnn op names (``aclnn_<name>.h``) each custom-op vendor folder under the roots ships.

    A root is an entry of ``ASCEND_CUSTOM_OPP_PATH`` (one vendor folder, e.g. ``.../vendors/custom_transformer``)
    or ``$ASCEND_OPP_PATH`` (whose ``vendors/*`` are searched). Returns ``{vendor folder: [op names]}``.
    """
    out: dict[str, list[str]] = {}
    for root in opp_roots:
        cands = [root] + sorted(glob.glob(os.path.join(root, "vendors", "*")))
        for d in cands:
            hdrs = glob.glob(os.path.join(d, "op_api", "include", "aclnn_*.h"))
            if hdrs or (d == root and os.path.isdir(os.path.join(d, "op_api"))):
                out[d] = sorted(os.path.basename(h)[len("aclnn_"):-2] for h in hdrs)
    return out
