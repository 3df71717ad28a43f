"""Stacked linears (parallel.linear.stack_linears_ / stacked_linear): linears that read the same input (the
compressor's wkv / wgate, the shared expert's w1 / w3, attention's wq_a / wkv) share one weight buffer and run as one GEMM on CUDA; each
keeps its row slice as its weight, so loading, state dicts and the unstacked path see the same parameters. The routed
experts stack their own w1 / w3 (Experts.stack_weights_: one grouped GEMM for gate and up)."""

from __future__ import annotations

import pytest
import torch

import atb_ops
from ascend_dsv4.engine.model_runner import ModelRunner
from ascend_dsv4.models.deepseek_v4.model import DeepseekV4Model
from ascend_dsv4.weights.random_init import init_random_
from parallel.layers import ColumnParallelLinear, RowParallelLinear
from parallel.linear import Linear, stack_linears_, stack_model_linears_, stacked_linear
from quant.fp4 import quant_fp4
from quant.fp8_block import quant_fp8_block
from v4_helpers import SMALL_POOLS, rel_err, toy_cfg, two_sequence_logits


def _pair(fmt: str, n=(256, 384), k=256, cls=Linear, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    mods = []
    for ni in n:
        m = cls(k, ni, torch.bfloat16, **kw)
        w = torch.randn(ni, k, generator=g) * 0.05
        if fmt == "fp8_block":
            m.set_weight(*quant_fp8_block(w), "fp8_block")
        elif fmt == "fp4":
            m.set_weight(*quant_fp4(w), "fp4")
        else:
            m.set_weight(w.to(torch.bfloat16))
        mods.append(m)
    return mods


@pytest.mark.parametrize("fmt", ["dense", "fp8_block", "fp4"])
def test_stacked_equals_separate(fmt):
    mods = _pair(fmt)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want = [m(x) for m in mods]
    assert stack_linears_(mods)
    assert mods[0].weight.data_ptr() == mods[0]._stack.weight.data_ptr()
    assert mods[1].weight.shape[0] == 384 and mods[1].weight.data_ptr() != mods[0].weight.data_ptr()
    got = stacked_linear(mods, x)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)  # the same per-column products and sums
    for m, w in zip(mods, want):  # each linear alone still computes from its slice
        torch.testing.assert_close(m(x), w, rtol=0, atol=0)


def test_what_is_not_stacked():
    assert not stack_linears_(_pair("fp8_block", n=(200, 256)))  # a scale block would straddle the two
    assert stack_linears_(_pair("fp8_block", n=(256, 200)))  # the last may end mid-block
    a, b = _pair("dense")[0], _pair("fp4")[1]
    assert not stack_linears_([a, b])  # formats differ
    assert not stack_linears_(_pair("dense", cls=RowParallelLinear))  # reduces its output
    assert not stack_linears_(_pair("dense", cls=ColumnParallelLinear, gather_output=True))
    assert stack_linears_(_pair("dense", cls=ColumnParallelLinear))
    assert not stack_linears_(_pair("dense")[:1])


def test_a_later_weight_unstacks():
    mods = _pair("dense")
    stack_linears_(mods)
    x = torch.randn(3, 256).to(torch.bfloat16)
    mods[1].set_weight(torch.zeros(384, 256, dtype=torch.bfloat16))  # a reload: its own storage again
    a, b = stacked_linear(mods, x)
    assert torch.equal(b, torch.zeros(3, 384, dtype=torch.bfloat16))
    torch.testing.assert_close(a, mods[0](x), rtol=0, atol=0)


def _model(device="cpu"):
    return init_random_(DeepseekV4Model(toy_cfg(index_topk=128), torch.float32, "exact"), 0).eval().to(device)


_logits = two_sequence_logits


def test_model_logits_and_state_dict_unchanged():
    model = _model()
    want = _logits(model)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    n = {k: sum(type(m).__name__ == k for m in model.modules())
         for k in ("Compressor", "SharedExpert", "Attention", "Experts")}
    assert all(n.values())
    assert stack_model_linears_(model) == sum(n.values())
    assert sorted(model.state_dict()) == sorted(sd)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())
    assert rel_err(_logits(model), want) < 1e-6
    fresh = _model()
    fresh.load_state_dict(model.state_dict())  # a stacked model's state dict loads into an unstacked one
    assert rel_err(_logits(fresh), want) < 1e-6


def test_cpu_runner_does_not_stack():
    model = _model()
    ModelRunner(model, SMALL_POOLS, "cpu")
    assert not any(hasattr(m, "_stack") or getattr(m, "_w13", None) is not None for m in model.modules())


@pytest.mark.cuda
def test_cuda_runner_stacks_and_logits_stay(monkeypatch):
    """A CUDA runner stacks (one GEMM per group) and the logits stay those of the unstacked model (1e-5)."""
    import parallel.linear

    model = _model("cuda")
    stacked = _logits(model, "cuda", backend="cuda")
    assert sum(hasattr(m, "_stack") for m in model.modules()) > 0
    assert all(m._w13 is not None for m in model.modules() if type(m).__name__ == "Experts")
    monkeypatch.setattr(parallel.linear, "stack_model_linears_", lambda model: 0)
    kept = _model("cuda")
    assert rel_err(_logits(kept, "cuda", backend="cuda"), stacked) < 1e-5
    assert not any(hasattr(m, "_stack") for m in kept.modules())


@pytest.mark.parametrize("q_lora", [True, False])
def test_v3_model_logits_unchanged(q_lora):
    """DeepSeek-V3: MLA's q_a_proj / kv_a_proj_with_mqa (when q is compressed) and the MLPs' gate / up."""
    from ascend_dsv4.kv import PoolSizes
    from ascend_dsv4.models import preset
    from ascend_dsv4.models.deepseek_v3.model import DeepseekV3Model

    cfg = preset("toy-v3") if q_lora else preset("toy-v3").replace(q_lora_rank=0)
    model = init_random_(DeepseekV3Model(cfg, torch.float32), 3).eval()
    pools = PoolSizes(block_size=16, num_blocks=64)

    def logits():
        runner = ModelRunner(model, pools)
        seq = runner.new_sequence()
        ids = torch.randint(0, cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(1)).tolist()
        return torch.cat([runner.step([seq], [ids[:20]], logits="all"), runner.step([seq], [ids[20:]], logits="all")])

    want = logits()
    n_mlp = sum(type(m).__name__ == "MLP" for m in model.modules())
    n_mla = sum(type(m).__name__ == "MLA" for m in model.modules())  # the MTP layers' too
    n_exp = sum(type(m).__name__ == "Experts" for m in model.modules())
    assert n_mlp and n_mla and n_exp
    assert stack_model_linears_(model) == n_mlp + (n_mla if q_lora else 0) + n_exp
    assert rel_err(logits(), want) < 1e-6


def test_which_groups(monkeypatch):
    model = _model()
    assert stack_model_linears_(model, "none") == 0
    n_shared = sum(type(m).__name__ == "SharedExpert" for m in model.modules())
    assert stack_model_linears_(model, "SharedExpert") == n_shared
    comps = [m for m in model.modules() if type(m).__name__ == "Compressor"]
    shared = [m for m in model.modules() if type(m).__name__ == "SharedExpert"]
    assert all(hasattr(m.w1, "_stack") for m in shared) and not any(hasattr(m.wkv, "_stack") for m in comps)
    monkeypatch.setenv("ASCEND_DSV4_STACK_LINEARS", "none")
    assert stack_model_linears_(_model()) == 0
    monkeypatch.setenv("ASCEND_DSV4_STACK_LINEARS", "SharedExperts")  # a typo is refused, naming the classes
    with pytest.raises(ValueError, match="ASCEND_DSV4_STACK_LINEARS.*SharedExpert"):
        stack_model_linears_(_model())


def _experts(fmt: str, inter: int = 256, seed: int = 0):
    from ascend_dsv4.layers.experts import Experts

    g = torch.Generator().manual_seed(seed)
    E, d = 5, 256
    ex = Experts(E, inter, d, 7.0, torch.bfloat16, reference=False)
    t = {}
    for n, shape in (("w1", (E, inter, d)), ("w3", (E, inter, d)), ("w2", (E, d, inter))):
        w = torch.randn(*shape, generator=g) * 0.05
        if fmt == "fp8_block":
            t[n], t[n + "_scale"] = quant_fp8_block(w)
        elif fmt == "fp4":
            t[n], t[n + "_scale"] = quant_fp4(w)
        else:
            t[n] = w.to(torch.bfloat16)
    ex.set_weights(fmt, t)
    return ex


def _route(T=9, k=2, E=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, 256, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    return x, torch.rand(T, k, generator=g), ids


@pytest.mark.parametrize("fmt", ["dense", "fp8_block", "fp4"])
def test_experts_gate_up_stacked(fmt, monkeypatch):
    """w1 / w3 in one buffer: the same outputs bitwise, one grouped GEMM for both, w1 / w3 still their halves."""
    import atb_ops

    ex = _experts(fmt)
    x, w, ids = _route()
    want = ex(x, w, ids)
    w1, w3 = ex.w1.clone(), ex.w3.clone()
    assert ex.stack_weights_() == 1
    assert torch.equal(ex.w1, w1) and torch.equal(ex.w3, w3) and ex.w1.data_ptr() == ex._w13[0].data_ptr()
    calls = []
    real = atb_ops.grouped_matmul
    monkeypatch.setattr(atb_ops, "grouped_matmul", lambda *a, **k: (calls.append(a[1].shape), real(*a, **k))[1])
    torch.testing.assert_close(ex(x, w, ids), want, rtol=0, atol=0)
    assert calls == [(5, 512) + tuple(ex.w1.shape[2:]), tuple(ex.w2.shape)]  # gate+up in one call, then w2
    ex.set_weights(fmt, {n: getattr(ex, n).detach().clone() for n in ("w1", "w2", "w3", "w1_scale", "w2_scale",
                                                                       "w3_scale") if getattr(ex, n) is not None})
    calls.clear()
    torch.testing.assert_close(ex(x, w, ids), want, rtol=0, atol=0)  # reloaded: unstacked, w1 and w3 apart
    assert len(calls) == 3


def test_experts_not_stacked_and_stale_stack():
    assert _experts("fp8_block", inter=192).stack_weights_() == 0  # a 128-row scale block would straddle
    ex = _experts("dense")
    x, w, ids = _route()
    ex.stack_weights_()
    ex.w3 = torch.nn.Parameter(torch.zeros_like(ex.w3), requires_grad=False)  # its own storage again
    ref = _experts("dense")
    ref.w3 = torch.nn.Parameter(torch.zeros_like(ref.w3), requires_grad=False)
    torch.testing.assert_close(ex(x, w, ids), ref(x, w, ids), rtol=0, atol=0)
    assert ex._w13 is None  # the stale buffer is let go


def test_which_includes_experts():
    model = _model()
    n_exp = sum(type(m).__name__ == "Experts" for m in model.modules())
    assert n_exp and stack_model_linears_(model, "Experts") == n_exp
    assert not any(hasattr(m, "_stack") for m in model.modules())


def test_reduce_moe_one_launch_is_the_float32_sum_rounded_once():
    """reduce_moe's one-launch form (no all-reduce): bitwise (routed + float(shared)).to(dtype), the three-launch form
    it replaces; float32 out and no shared expert as before."""
    from ascend_dsv4.layers.experts import reduce_moe
    from parallel.groups import Group

    ex = _experts("dense")
    g = torch.Generator().manual_seed(5)
    routed = torch.randn(6, 256, generator=g) * 3
    shared = (torch.randn(6, 256, generator=g) * 3).to(torch.bfloat16)
    want = (routed + shared.float()).to(torch.bfloat16)
    got = reduce_moe(routed, shared, ex, Group(), torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert torch.equal(reduce_moe(routed, shared, ex, Group()), routed + shared.float())
    assert torch.equal(reduce_moe(routed, None, ex, Group(), torch.bfloat16), routed.to(torch.bfloat16))


def test_moe_output_adds_the_shared_expert_inside_the_unpermute():
    """moe_output on one rank passes the shared output to moe_unpermute (skip, out_dtype): bitwise the routed sum
    + float(shared) rounded once, as reduce_moe computes it from the separate routed output; Experts refuses skip
    where it does not sum the rows itself (expert parallel)."""
    from ascend_dsv4.layers.experts import moe_output, reduce_moe
    from parallel.groups import Group

    ex = _experts("dense")
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 256, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(6)])
    w = torch.rand(6, 2, generator=g)
    shared = (torch.randn(6, 256, generator=g)).to(torch.bfloat16)
    calls = []
    real = atb_ops.moe_unpermute
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(atb_ops, "moe_unpermute", lambda *a: (calls.append(a[3:]), real(*a))[1])
        got = moe_output(ex, x, w, ids, shared, Group(), torch.bfloat16)
    assert len(calls) == 1 and calls[0][0] is shared and calls[0][1] == torch.bfloat16
    want = reduce_moe(ex(x, w, ids), shared, ex, Group(), torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert torch.equal(moe_output(ex, x, w, ids, None, Group(), torch.bfloat16), ex(x, w, ids).to(torch.bfloat16))
    ex.ep = Group(rank=0, size=2)
    with pytest.raises(ValueError, match="skip / out_dtype"):
        ex(x, w, ids, skip=shared)
