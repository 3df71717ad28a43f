"""The command line: streaming generate, info, and one-line errors (no stack trace)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ascend_dsv4.entrypoints.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_generate_streams_text(capsys):
    assert main(["generate", "--model", "toy-v4", "--prompt", "Hello", "--max-tokens", "8", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert "8 generated" in err and "finish_reason=length" in err
    assert len(out) > 0


def test_info_reports_sizes(capsys):
    assert main(["info", "--model", "deepseek-v4-flash", "--context-len", "65536", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "3514" in out.replace(",", "") or "3,514" in out  # production KV bytes per token (ascend_dsv4/models/deepseek_v4/README.md §4.2)
    assert "csa" in out.lower() and "hca" in out.lower()


@pytest.mark.parametrize("argv, needle", [
    (["generate", "--model", "toy-v9", "--prompt", "x"], "unknown model"),
    (["generate", "--model", "toy-v4", "--prompt", "x", "--temperature", "-1"], "temperature"),
    (["generate", "--model", "toy-v4", "--prompt", "x" * 5000], "max_model_len"),
    (["generate", "--model", "toy-v4", "--prompt", "x", "--top-p", "1.5"], "top_p"),
    (["info", "--model", "toy-v4", "--context-len", "100000"], "context"),
])
def test_errors_are_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and needle in err and "Traceback" not in err


def test_malformed_config_file(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"dim": 256, "n_layers": 2, "compress_ratios": [0, 5, 0]')
    assert main(["info", "--model", str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text('{"dim": 256, "n_layers": 2}')
    assert main(["info", "--model", str(tmp_path)]) == 2
    assert "'vocab_size', 'n_heads', 'moe_inter_dim', 'n_routed_experts', 'n_activated_experts' missing" in \
        capsys.readouterr().err  # named, never Flash's defaults
    (tmp_path / "config.json").write_text('{"dim": 256, "n_layers": 2, "compress_ratios": [0, 5, 0], "vocab_size": '
                                          '1024, "n_heads": 4, "moe_inter_dim": 128, "n_routed_experts": 16, '
                                          '"n_activated_experts": 2}')
    assert main(["info", "--model", str(tmp_path)]) == 2
    assert "compress_ratios" in capsys.readouterr().err


def test_module_entry_point_runs_as_a_process():
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "ascend_dsv4.entrypoints.cli", "generate", "--model", "nope",
                        "--prompt", "x"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error:") and "Traceback" not in r.stderr


def test_info_reports_folder_quantization(tmp_path, capsys):
    fix = os.path.join(ROOT, "tests", "fixtures", "msmodelslim", "dsv3_w8a8_dynamic_v0")
    assert main(["info", "--model", fix]) == 0
    out = capsys.readouterr().out
    assert "msModelSlim" in out and "W8A8_DYNAMIC" in out and "bytes per parameter" in out
    assert main(["make-random-checkpoint", "--preset", "toy-v4", "--out", str(tmp_path / "c")]) == 0
    capsys.readouterr()
    assert main(["info", "--model", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "FP8 e4m3" in out and "packed FP4" in out
