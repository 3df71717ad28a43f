#!/usr/bin/env python3
"""Generate msModelSlim fixtures with the REAL msModelSlim tool on CPU.

(One script of about 650 lines on purpose: it runs in msModelSlim's isolated environment, which cannot import this
package, so the case table, the source-model builder and the runner live together.)

Run with the isolated environment made by ``setup_venv.sh`` (never the project env)::

    bash scripts/msmodelslim_fixtures/setup_venv.sh
    .venv-msmodelslim/bin/python scripts/msmodelslim_fixtures/make_fixtures.py [--only a,b] [--list]

What it does
------------
1. Builds tiny, seeded, random HF source models from configs (no downloads) plus a
   char-level ``PreTrainedTokenizerFast`` tokenizer, into
   ``build/fixtures/msmodelslim/src/<model>/`` and copies them (they are small) to
   ``tests/fixtures/msmodelslim/_source_models/<model>/``.
2. For every case, runs msModelSlim in a *separate* Python process whose working
   directory is a scratch folder (v0 drops ``features.npy`` in the CWD):
   * v0 API: ``AntiOutlier`` (optional) + ``Calibrator(QuantConfig(...))`` + ``save``;
   * v1 CLI: ``msmodelslim quant --device cpu --config_path X.yaml`` called in-process
     through ``msmodelslim.cli.__main__.main`` with ``AscendV1Saver.post_run`` wrapped
     so that, after the saver has written the output, the in-memory fake-quant model is
     run once on the fixed input to capture msModelSlim's own fake-quant logits.
3. Copies the raw tool output (unchanged) into ``tests/fixtures/msmodelslim/<case>/``
   together with ``reference.safetensors`` and ``case.json``, and writes
   ``tests/fixtures/msmodelslim/MANIFEST.json`` (status, sizes, errors of every case).

``reference.safetensors`` holds
    input_ids          int64 [2, 12]   fixed, seeded (same for every case)
    fakequant_logits   fp32  [2, 12, V] msModelSlim's own fake-quant forward (see README)
    float_logits       fp32  [2, 12, V] the unquantised source model (weights in the
                                         case dtype, forward in fp32)
    int_infer_logits   fp32  [2, 12, V] (v0 only, when it works) after
                                         ``quant_tools.enable_int_infer(model)``
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "fixtures" / "msmodelslim"
FIXT = ROOT / "tests" / "fixtures" / "msmodelslim"
SRC = BUILD / "src"
SEED = 20261121
VOCAB = 128
REF_BATCH, REF_SEQ = 2, 12
N_CALIB, CALIB_SEQ = 4, 16
# token ids 4..98 are the printable ASCII characters 32..126 (see build_tokenizer)
TOK_LO, TOK_HI = 4, 99

# ---------------------------------------------------------------------------------------
# source models
# ---------------------------------------------------------------------------------------
LLAMA_BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
DSV3_BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
    n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=2.5,
    kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
    n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
    norm_topk_prob=True, max_position_embeddings=128, rope_scaling=None,
    rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)

# name -> (arch, config overrides, dtype, seed, extra)
MODELS = {
    "llama_fp32": ("llama", {}, "float32", SEED, {}),
    "llama_bf16": ("llama", {}, "bfloat16", SEED, {}),        # = llama_fp32 rounded to bf16
    "llama_fp16": ("llama", {}, "float16", SEED, {}),         # = llama_fp32 rounded to fp16
    "llama_bias_fp32": ("llama", {"attention_bias": True}, "float32", SEED + 1, {"outlier_channel": 5}),
    "llama_h128_fp32": ("llama", {"hidden_size": 128, "intermediate_size": 128}, "float32", SEED + 2, {}),
    "dsv3_fp32": ("deepseek_v3", {}, "float32", SEED + 3, {}),
}


def _deterministic_init(model, seed: int, outlier_channel=None):
    """Re-initialise every parameter from a seeded generator (independent of HF init)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / (p.shape[1] ** 0.5))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        if outlier_channel is not None:
            # one activation-outlier channel: every input/post-attention norm scales it up
            for name, p in model.named_parameters():
                if name.endswith("layernorm.weight"):
                    p[outlier_channel] = 8.0


def build_tokenizer(out_dir: Path):
    """Char-level WordLevel tokenizer that the v1 CLI loads with AutoTokenizer(use_fast=False)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i, c in enumerate(chr(x) for x in range(32, 127)):
        vocab[c] = 4 + i  # 4..98
    for i in range(len(vocab), VOCAB):
        vocab[f"<extra_{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.save_pretrained(str(out_dir))
    # save_pretrained writes "tokenizer_class": "PreTrainedTokenizer", which AutoTokenizer(use_fast=False)
    # resolves to the slow class (-> asks for protobuf).  The v1 CLI needs the fast class named explicitly.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def ids_to_text(ids) -> str:
    return "".join(chr(int(i) - 4 + 32) for i in ids)


def build_model(name: str, force: bool = False) -> Path:
    import torch
    from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig,
                              LlamaForCausalLM)

    arch, over, dtype, seed, extra = MODELS[name]
    out = SRC / name
    if (out / "model.safetensors").exists() and not force:
        return out
    if out.exists():
        _rmtree(out)
    out.mkdir(parents=True)
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = LlamaConfig(**{**LLAMA_BASE, **over})
        model = LlamaForCausalLM(cfg)
    else:
        cfg = DeepseekV3Config(**{**DSV3_BASE, **over})
        model = DeepseekV3ForCausalLM(cfg)
    _deterministic_init(model, seed, extra.get("outlier_channel"))
    tdt = getattr(torch, dtype)
    model = model.to(tdt)
    model.config.torch_dtype = tdt
    model.save_pretrained(str(out), safe_serialization=True)
    build_tokenizer(out)
    return out


def fixed_inputs():
    import torch

    g = torch.Generator().manual_seed(SEED)
    ref = torch.randint(TOK_LO, TOK_HI, (REF_BATCH, REF_SEQ), generator=g)
    calib = [torch.randint(TOK_LO, TOK_HI, (1, CALIB_SEQ), generator=g) for _ in range(N_CALIB)]
    return ref, calib


# ---------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------
def _yaml(process: str, label: str) -> str:
    return textwrap.dedent(
        """\
        apiversion: modelslim_v1
        metadata:
          config_id: fixture-{label}
          score: 0
          verified_model_types: []
          label:
            w_bit: 8
            a_bit: 8
            is_sparse: False
            kv_cache: False
        spec:
          process:
        {process}
          runner: "model_wise"
          save:
            - type: "ascendv1_saver"
              part_file_size: 0
          dataset: "@DATASET@"
        """
    ).format(label=label, process=textwrap.indent(textwrap.dedent(process).strip("\n"), "    "))


W8_PER_CHANNEL_SYM = """\
weight:
  scope: "per_channel"
  dtype: "int8"
  symmetric: True
  method: "minmax"
"""
ACT_PER_TENSOR_ASYM = """\
act:
  scope: "per_tensor"
  dtype: "int8"
  symmetric: False
  method: "minmax"
"""
ACT_PER_TOKEN_SYM = """\
act:
  scope: "per_token"
  dtype: "int8"
  symmetric: True
  method: "minmax"
"""


def _lq(qconfig: str, include='["*"]', exclude='["lm_head"]') -> str:
    return (
        '- type: "linear_quant"\n'
        "  qconfig:\n" + textwrap.indent(qconfig, "    ") +
        f"  include: {include}\n"
        f"  exclude: {exclude}\n"
    )


V1_W8A8_STATIC = _lq(ACT_PER_TENSOR_ASYM + W8_PER_CHANNEL_SYM)
V1_W8A8_DYNAMIC = _lq(ACT_PER_TOKEN_SYM + W8_PER_CHANNEL_SYM)
V1_W8A16 = _lq(W8_PER_CHANNEL_SYM)
V1_W8A16_PER_GROUP = _lq(
    'weight:\n  scope: "per_group"\n  dtype: "int8"\n  symmetric: True\n  method: "gptq"\n  ext:\n    group_size: 32\n'
)
V1_W4A8_PER_CHANNEL = _lq(
    ACT_PER_TOKEN_SYM + 'weight:\n  scope: "per_channel"\n  dtype: "int4"\n  symmetric: True\n  method: "minmax"\n'
)
V1_SMOOTH = '- type: "smooth_quant"\n  alpha: 0.5\n  symmetric: False\n  include: ["*"]\n'
V1_C8 = (
    '- type: "dynamic_cache"\n  qconfig:\n    scope: "per_channel"\n    dtype: "int8"\n'
    '    symmetric: {sym}\n    method: "minmax"\n  include: ["*"]\n'
)
V1_DSV3_MIX = (
    _lq(ACT_PER_TENSOR_ASYM + W8_PER_CHANNEL_SYM, include='["*self_attn*"]', exclude='["*kv_b_proj"]')
    + _lq(ACT_PER_TOKEN_SYM + W8_PER_CHANNEL_SYM, include='["*mlp*"]',
          exclude='["*gate", "*mlp.experts.*"]')
    + _lq(ACT_PER_TOKEN_SYM +
          'weight:\n  scope: "per_channel"\n  dtype: "int4"\n  symmetric: True\n  method: "minmax"\n',
          include='["*mlp.experts*"]', exclude="[]")
)
V1_DSV3_MIX = '- type: "group"\n  configs:\n' + textwrap.indent(V1_DSV3_MIX, "    ")

QC_W8A8 = 'QuantConfig(w_bit=8, a_bit=8, dev_type="cpu", act_method=1, mm_tensor=False)'
QC_W8A8_DYN = 'QuantConfig(w_bit=8, a_bit=8, dev_type="cpu", mm_tensor=False, is_dynamic=True)'
QC_W4A8_PG = ('QuantConfig(w_bit=4, a_bit=8, dev_type="cpu", mm_tensor=False, is_dynamic=True, '
              'is_lowbit=True, open_outlier=False, group_size=32)')
DSV3_DISABLE = ('["model.layers.0.self_attn.kv_b_proj", "model.layers.1.self_attn.kv_b_proj", "lm_head"]')

# name -> dict(api, model, desc, and qc/anti/save_type (v0) or yaml (v1))
CASES = {
    # ---------------- W8A16 ----------------
    "w8a16_sym_v0": dict(api="v0", model="llama_fp32", desc="W8A16 symmetric per-channel (offset 0)",
                         qc='QuantConfig(w_bit=8, a_bit=16, dev_type="cpu", w_sym=True, mm_tensor=False)'),
    "w8a16_asym_v0": dict(api="v0", model="llama_fp32", desc="W8A16 asymmetric per-channel (integral offsets)",
                          qc='QuantConfig(w_bit=8, a_bit=16, dev_type="cpu", w_sym=False, mm_tensor=False)'),
    "w8a16_pergroup_v0": dict(api="v0", model="llama_fp32", desc="W8A16 per-group gs=32 (v0 is_lowbit path)",
                              qc=('QuantConfig(w_bit=8, a_bit=16, dev_type="cpu", mm_tensor=False, is_lowbit=True, '
                                  'open_outlier=False, group_size=32)')),
    "w8a16_v1": dict(api="v1", model="llama_fp32", desc="W8A16 per-channel sym via v1 CLI",
                     yaml=_yaml(V1_W8A16, "w8a16")),
    "w8a16_pergroup_v1": dict(api="v1", model="llama_fp32", desc="W8A16 per-group gs=32 via v1 CLI (method gptq: the only per_group int8 weight quantizer in v1)",
                              yaml=_yaml(V1_W8A16_PER_GROUP, "w8a16-pergroup")),
    # ---------------- W8A8 static ----------------
    "w8a8_static_fp32_v0": dict(api="v0", model="llama_fp32", desc="W8A8 static, fp32 model -> int64 deq_scale",
                                qc=QC_W8A8),
    "w8a8_static_bias_fp32_v0": dict(api="v0", model="llama_bias_fp32",
                                     desc="W8A8 static, attention_bias=True -> bias folded into quant_bias",
                                     qc=QC_W8A8),
    "w8a8_static_bf16_v0": dict(api="v0", model="llama_bf16",
                                desc="W8A8 static, bf16 model -> float32 deq_scale, bf16 scales", qc=QC_W8A8),
    "w8a8_static_fp16_v0": dict(api="v0", model="llama_fp16",
                                desc="W8A8 static, fp16 model -> int64 deq_scale, fp16 scales", qc=QC_W8A8),
    "w8a8_static_fp32_v1": dict(api="v1", model="llama_fp32", desc="W8A8 static via v1 CLI (int64 deq_scale)",
                                yaml=_yaml(V1_W8A8_STATIC, "w8a8-static")),
    "w8a8_static_bf16_v1": dict(api="v1", model="llama_bf16",
                                desc="W8A8 static via v1 CLI, bf16 model -> float32 deq_scale",
                                yaml=_yaml(V1_W8A8_STATIC, "w8a8-static-bf16")),
    # ---------------- W8A8S / MIX / DYNAMIC ----------------
    "w8a8s_v0": dict(api="v0", model="llama_h128_fp32", desc="W8A8S sparse (hidden 128)",
                     qc=('QuantConfig(w_bit=4, a_bit=8, dev_type="cpu", act_method=2, mm_tensor=False, '
                         'co_sparse=True, fraction=0.011).sparse_quant(is_lowbit=True)')),
    "w8a8_mix_v0": dict(api="v0", model="llama_fp32", desc="W8A8_MIX (pdmix) saved as ascendV1",
                        qc='QuantConfig(w_bit=8, a_bit=8, dev_type="cpu", act_method=1, mm_tensor=False, pdmix=True)',
                        save_type="ascendV1"),
    "w8a8_dynamic_v0": dict(api="v0", model="llama_fp32", desc="W8A8_DYNAMIC (per-token act at runtime)",
                            qc=QC_W8A8_DYN),
    "w8a8_dynamic_v1": dict(api="v1", model="llama_fp32", desc="W8A8_DYNAMIC via v1 CLI",
                            yaml=_yaml(V1_W8A8_DYNAMIC, "w8a8-dynamic")),
    # ---------------- W4A8 ----------------
    "w4a8_dynamic_pergroup_v0": dict(api="v0", model="llama_fp32",
                                     desc="W4A8_DYNAMIC v0 per-group gs=32, safe_tensor (unpacked int4 in int8)",
                                     qc=QC_W4A8_PG),
    "w4a8_dynamic_pergroup_ascendv1_v0": dict(api="v0", model="llama_fp32",
                                              desc="same quantisation as w4a8_dynamic_pergroup_v0, ascendV1 (packed)",
                                              qc=QC_W4A8_PG, save_type="ascendV1"),
    "w4a8_dynamic_perchannel_v1": dict(api="v1", model="llama_fp32",
                                       desc="W4A8_DYNAMIC v1 per-channel, packed int4 + scale_bias",
                                       yaml=_yaml(V1_W4A8_PER_CHANNEL, "w4a8-per-channel")),
    # ---------------- anti-outlier / smoothing ----------------
    "w8a8_antioutlier_m2_v0": dict(api="v0", model="llama_bias_fp32",
                                   desc="AntiOutlier m2 + W8A8 static (norm .bias and .module.* tensors)",
                                   anti='AntiOutlierConfig(anti_method="m2", dev_type="cpu")', qc=QC_W8A8),
    "w8a8_smoothquant_v1": dict(api="v1", model="llama_bias_fp32",
                                desc="v1 smooth_quant (asym) + W8A8 static (norm weight+bias)",
                                yaml=_yaml(V1_SMOOTH + V1_W8A8_STATIC, "sq-w8a8")),
    # ---------------- KV cache C8 ----------------
    "w8a8_c8_sym_v0": dict(api="v0", model="llama_fp32", desc="W8A8 static + C8 KV symmetric",
                           qc=QC_W8A8 + ".kv_quant(kv_sym=True)"),
    "w8a8_c8_asym_v0": dict(api="v0", model="llama_fp32", desc="W8A8 static + C8 KV asymmetric",
                            qc=QC_W8A8 + ".kv_quant(kv_sym=False)"),
    "w8a8_c8_sym_v1": dict(api="v1", model="llama_fp32", desc="W8A8 static + C8 KV symmetric via v1 dynamic_cache",
                           yaml=_yaml(V1_W8A8_STATIC + V1_C8.format(sym="True"), "w8a8c8")),
    "w8a8_c8_asym_v1": dict(api="v1", model="llama_fp32",
                            desc="W8A8 static + C8 KV asymmetric via v1 dynamic_cache",
                            yaml=_yaml(V1_W8A8_STATIC + V1_C8.format(sym="False"), "w8a8c8-asym")),
    # ---------------- DeepseekV3 (MLA + MoE) ----------------
    "dsv3_w8a8_dynamic_v0": dict(api="v0", model="dsv3_fp32", desc="tiny DeepseekV3, W8A8_DYNAMIC (kv_b_proj FLOAT)",
                                 qc=QC_W8A8_DYN[:-1] + ", disable_names=" + DSV3_DISABLE + ")"),
    "dsv3_w8a8_static_v0": dict(api="v0", model="dsv3_fp32", desc="tiny DeepseekV3, W8A8 static (kv_b_proj FLOAT)",
                                qc=QC_W8A8[:-1] + ", disable_names=" + DSV3_DISABLE + ")"),
    "dsv3_mix_w8a8_w4a8_v1": dict(api="v1", model="dsv3_fp32",
                                  desc=("tiny DeepseekV3 via v1 CLI: attn W8A8 static (kv_b_proj FLOAT), "
                                        "dense/shared MLP W8A8_DYNAMIC, routed experts W4A8_DYNAMIC per-channel"),
                                  yaml=_yaml(V1_DSV3_MIX, "dsv3-mix")),
    # ---------------- attempts that are EXPECTED to fail on CPU (recorded in MANIFEST.json, no folder) --------
    "xfail_w8a8s_h64_v0": dict(api="v0", model="llama_fp32", desc="W8A8S on hidden 64",
                               qc=('QuantConfig(w_bit=4, a_bit=8, dev_type="cpu", act_method=2, mm_tensor=False, '
                                   'co_sparse=True, fraction=0.011).sparse_quant(is_lowbit=True)'),
                               expect_fail="outlier fraction x width rounds to 0 (notes section 2)"),
    "xfail_w8a16_pergroup_minmax_v1": dict(api="v1", model="llama_fp32", desc="v1 int8 per_group with method minmax",
                                           yaml=_yaml(V1_W8A16_PER_GROUP.replace('"gptq"', '"minmax"'), "xf-pg"),
                                           expect_fail="v1 registers int8 per_group only for method gptq"),
    "xfail_w8a8_smoothquant_bf16_v1": dict(api="v1", model="llama_bf16", desc="v1 smooth_quant on a bf16 model",
                                           yaml=_yaml(V1_SMOOTH + V1_W8A8_STATIC, "xf-sq-bf16"),
                                           expect_fail="mixed-dtype F.linear in the v1 smoothing forward on CPU"),
    "xfail_dsv3_deepseek_adapter_v1": dict(api="v1", model="dsv3_fp32", model_type="DeepSeek-V3",
                                           desc="tiny DeepseekV3 through the real DeepSeek-V3 adapter",
                                           yaml=_yaml(V1_W8A8_DYNAMIC, "xf-dsv3-adapter"),
                                           expect_fail="real DeepSeek adapter hard-codes npu / MTP shard files"),
}


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------
def _rmtree(p: Path):
    if p.exists():
        for root, dirs, files in os.walk(p):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o755)
            for f in files:
                os.chmod(os.path.join(root, f), 0o644)
        shutil.rmtree(p)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _versions():
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for pkg in ("msmodelslim", "torch", "transformers", "accelerate", "safetensors", "tokenizers", "numpy"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def _float_logits(model_dir: Path, input_ids):
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32,
                                             local_files_only=True).eval()
    with torch.no_grad():
        return m(input_ids).logits.float().contiguous()


def _logits(model, input_ids):
    import torch

    with torch.no_grad():
        out = model(input_ids.to(next(model.parameters()).device))
    return (out.logits if hasattr(out, "logits") else out[0]).detach().float().cpu().contiguous()


# ---------------------------------------------------------------------------------------
# child: one case
# ---------------------------------------------------------------------------------------
def run_case(name: str, out_dir: Path, ref_dir: Path):
    import torch
    from safetensors.torch import save_file

    case = CASES[name]
    model_dir = SRC / case["model"]
    dtype_name = MODELS[case["model"]][2]
    tdt = getattr(torch, dtype_name)
    input_ids, calib_ids = fixed_inputs()
    ref = {"input_ids": input_ids.contiguous(), "calib_input_ids": torch.cat(calib_ids).contiguous()}
    ref["float_logits"] = _float_logits(model_dir, input_ids)
    info = {
        "case": name, "description": case["desc"], "api": case["api"], "source_model": case["model"],
        "source_model_dtype": dtype_name, "seed": SEED, "model_seed": MODELS[case["model"]][3],
        "calib_input_ids": ("reference.safetensors['calib_input_ids'] (4 x 16); v0 gets them as "
                            "[[ids[i:i+1]] for i in range(4)], v1 as the jsonl texts chr(id-4+32)"),
        "versions": _versions(),
    }
    if case["api"] == "v0":
        from msmodelslim.pytorch.llm_ptq.anti_outlier import AntiOutlier, AntiOutlierConfig
        from msmodelslim.pytorch.llm_ptq.llm_ptq_tools import Calibrator, QuantConfig
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=tdt,
                                                     local_files_only=True).cpu().eval()
        calib = [[c] for c in calib_ids]
        ns = {"QuantConfig": QuantConfig, "AntiOutlierConfig": AntiOutlierConfig}
        code = []
        code.append(f'model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.{dtype_name}, '
                    'local_files_only=True).cpu().eval()')
        code.append("calib = [[ids] for ids in calib_input_ids]  # 4 x [1,16] int64")
        if case.get("anti"):
            anti_cfg = eval(case["anti"], ns)  # noqa: S307 - our own literal
            AntiOutlier(model, calib_data=calib, cfg=anti_cfg).process()
            code.append(f"AntiOutlier(model, calib_data=calib, cfg={case['anti']}).process()")
        qc = eval(case["qc"], ns)  # noqa: S307 - our own literal
        cal = Calibrator(model, qc, calib_data=calib, disable_level="L0")
        cal.run()
        save_type = case.get("save_type", "safe_tensor")
        cal.save(str(out_dir), save_type=[save_type])
        code.append(f"qc = {case['qc']}")
        code.append('cal = Calibrator(model, qc, calib_data=calib, disable_level="L0"); cal.run()')
        code.append(f'cal.save(out_dir, save_type=["{save_type}"])')
        code.append("fakequant_logits = model(input_ids).logits  # after save, under no_grad")
        info.update(quant_config=case["qc"], anti_outlier_config=case.get("anti"), save_type=save_type,
                    disable_level="L0", v0_code=code)
        ref["fakequant_logits"] = _logits(model, input_ids)
        ref["fakequant_logits_repeat_ok"] = torch.tensor(
            bool(torch.equal(ref["fakequant_logits"], _logits(model, input_ids))))
        try:
            from msmodelslim.pytorch.llm_ptq.llm_ptq_tools import quant_tools

            quant_tools.enable_int_infer(model)
            ref["int_infer_logits"] = _logits(model, input_ids)
            info["int_infer"] = "ok: quant_tools.enable_int_infer(model) then forward"
        except Exception as e:  # pragma: no cover - informational
            info["int_infer"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
        ref.pop("fakequant_logits_repeat_ok")
        # v0 does not write config.json; copy the source one so the folder is self-describing
        for f in ("config.json",):
            shutil.copy(model_dir / f, out_dir / f)
        info["config_json"] = "copied from the source model by make_fixtures.py (v0 writes none)"
    else:
        from msmodelslim.core.quant_service.modelslim_v1.save import ascendv1 as av1
        import msmodelslim.cli.__main__ as cli

        dataset = out_dir.parent / f"{name}.calib.jsonl"
        with open(dataset, "w") as f:
            for c in calib_ids:
                f.write(json.dumps({"inputs_pretokenized": ids_to_text(c[0])}) + "\n")
        yaml_text = case["yaml"].replace("@DATASET@", str(dataset))
        yaml_path = out_dir.parent / f"{name}.yaml"
        yaml_path.write_text(yaml_text)
        ref_dir.mkdir(parents=True, exist_ok=True)
        (ref_dir / "msmodelslim_config.yaml").write_text(yaml_text.replace(str(ROOT) + "/", ""))
        captured = {}
        orig = av1.AscendV1Saver.post_run

        def post_run(self):
            orig(self)
            m = self.model
            if dtype_name != "float32":
                m = m.float()  # CPU fake-quant forward fails in fp16/bf16 (quant/msmodelslim/README.md §2)
            m.eval()
            captured["logits"] = _logits(m, input_ids)
            captured["logits2"] = _logits(m, input_ids)

        av1.AscendV1Saver.post_run = post_run
        argv = ["msmodelslim", "quant", "--model_path", str(model_dir), "--save_path", str(out_dir),
                "--device", "cpu", "--model_type", case.get("model_type", "TinyFixture"), "--config_path", str(yaml_path),
                "--trust_remote_code", "False"]
        sys.argv = argv
        try:
            cli.main()
        except SystemExit as e:
            if e.code not in (0, None):
                raise
        if "logits" not in captured:
            raise RuntimeError("AscendV1Saver.post_run was not called; no fake-quant logits captured")
        ref["fakequant_logits"] = captured["logits"]
        info["fakequant_repeat_equal"] = bool(torch.equal(captured["logits"], captured["logits2"]))
        info.update(cli=" ".join(["msmodelslim"] + argv[1:]).replace(str(ROOT) + "/", ""),
                    yaml=yaml_text.replace(str(ROOT) + "/", ""),
                    fakequant_forward=("in-memory model after AscendV1Saver.post_run" +
                                       (" upcast with .float()" if dtype_name != "float32" else "")))
    ref_dir.mkdir(parents=True, exist_ok=True)
    save_file(ref, str(ref_dir / "reference.safetensors"),
              metadata={"case": name})  # one key only: multi-key metadata order is not deterministic
    with open(ref_dir / "case.json", "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")


# ---------------------------------------------------------------------------------------
# parent
# ---------------------------------------------------------------------------------------
def _dir_size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _copy_tree(src: Path, dst: Path):
    for f in sorted(src.rglob("*")):
        if f.is_file():
            rel = f.relative_to(src)
            (dst / rel.parent).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst / rel)
            os.chmod(dst / rel, 0o644)


def _error_summary(log: str) -> str:
    """Root-cause exception line (first raised) and the final one, from a Python traceback log."""
    import re

    lines = [l for l in log.splitlines() if l.strip()]
    errs = [l for l in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b", l)]
    orig = [l.split("Original exception:", 1)[1].strip() for l in lines if "Original exception:" in l]
    parts = []
    for e in (orig[:1] + errs[:1] + errs[-1:]):
        if e not in parts:
            parts.append(e)
    return (" <- ".join(reversed(parts)) if parts else (lines[-1] if lines else "no output"))[:700]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma separated case names")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--rebuild-models", action="store_true")
    ap.add_argument("--run-case", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ref", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.run_case:
        run_case(args.run_case, Path(args.out), Path(args.ref))
        return 0
    if args.list:
        for k, v in CASES.items():
            print(f"{k:40s} {v['api']}  {v['model']:16s} {v['desc']}")
        return 0

    names = [n for n in args.only.split(",") if n] or list(CASES)
    for n in names:
        if n not in CASES:
            raise SystemExit(f"unknown case {n}")

    # 1) source models (deterministic; also committed under _source_models/)
    for m in sorted({CASES[n]["model"] for n in names} if args.only else MODELS):
        d = build_model(m, force=args.rebuild_models)
        dst = FIXT / "_source_models" / m
        _rmtree(dst)
        _copy_tree(d, dst)

    manifest_path = FIXT / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    manifest.setdefault("cases", {})
    manifest["versions"] = _versions()
    manifest["seed"] = SEED
    manifest["source_models"] = {
        m: {f.name: _sha256(f) for f in sorted((FIXT / "_source_models" / m).glob("*.safetensors"))}
        for m in MODELS if (FIXT / "_source_models" / m).exists()
    }

    for n in names:
        case = CASES[n]
        work = BUILD / "work" / n
        out = BUILD / "out" / n
        ref = BUILD / "ref" / n
        for p in (work, out, ref):
            _rmtree(p)
        work.mkdir(parents=True)
        out.mkdir(parents=True)
        log_path = BUILD / "logs" / f"{n}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        env = dict(os.environ, PYTHONHASHSEED="0", TOKENIZERS_PARALLELISM="false")
        with open(log_path, "w") as log:
            rc = subprocess.call([sys.executable, str(Path(__file__).resolve()), "--run-case", n,
                                  "--out", str(out), "--ref", str(ref)],
                                 cwd=str(work), stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env)
        dt = time.time() - t0
        dst = FIXT / n
        _rmtree(dst)
        entry = {"api": case["api"], "model": case["model"], "description": case["desc"]}
        if case.get("expect_fail"):
            entry["expected_failure_reason"] = case["expect_fail"]
        if rc == 0 and (ref / "reference.safetensors").exists():
            if case.get("expect_fail"):
                entry["note"] = "UNEXPECTEDLY SUCCEEDED"
            _copy_tree(out, dst)
            _copy_tree(ref, dst)
            entry.update(status="ok", bytes=_dir_size(dst), files=sorted(
                str(f.relative_to(dst)) for f in dst.rglob("*") if f.is_file()))
            print(f"[ok]   {n:40s} {dt:6.1f}s {entry['bytes'] / 1024:8.1f} KiB")
        else:
            log = log_path.read_text(errors="replace").replace(str(ROOT) + "/", "")
            entry.update(status="xfail" if case.get("expect_fail") else "failed", returncode=rc, error=_error_summary(log),
                         log_tail=log.splitlines()[-25:])
            print(f"[{'xfail' if case.get('expect_fail') else 'FAIL'}] {n:40s} {dt:6.1f}s  {entry['error']}")
        manifest["cases"][n] = entry
        manifest["cases"] = dict(sorted(manifest["cases"].items()))
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")

    total = _dir_size(FIXT)
    print(f"fixtures total: {total / 1024 / 1024:.2f} MiB in {FIXT}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # child: print full traceback to the log
        traceback.print_exc()
        sys.exit(1)
