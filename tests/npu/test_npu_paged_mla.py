"""DeepSeek-V3 paged MLA on the NPU backend: the pool layout the backend asks for (``atb_ops.kv_layout``: separate
c_kv / k_pe caches, block sizes a multiple of 16) and ``mla_decode_split`` through the paged form of
``npu_fused_infer_attention_score`` (block_table over the caches themselves), against the reference op and the
reference backend's logits, under the emulation and the wheel's contracts."""

import pytest
import torch

import atb_ops
from atb_ops._dispatch import _registry

g = torch.Generator().manual_seed(11)


@pytest.fixture(autouse=True)
def _contracts(checker):
    yield
    assert not checker.violations, checker.violations


@pytest.fixture
def fia_calls(emu, monkeypatch):
    """Records whether each FIA call used the paged form (a block_table)."""
    calls = []
    real = emu.npu_fused_infer_attention_score

    def spy(*a, **kw):
        calls.append(kw.get("block_table") is not None)
        return real(*a, **kw)

    monkeypatch.setattr(emu, "npu_fused_infer_attention_score", spy)
    return calls


def _contexts(lens, bs, blocks):
    """Per-token context rows of sequences of ``lens`` tokens on shuffled pages of ``bs`` rows: token i of a
    sequence reads its positions 0..i (as MLAKVPools.build_context lays them out), -1 padded."""
    perm = torch.randperm(blocks, generator=g).tolist()
    rows, lmax = [], max(lens)
    for n in lens:
        pages = [perm.pop() for _ in range(-(-n // bs))]
        slots = [pages[p // bs] * bs + p % bs for p in range(n)]
        for i in range(n):
            rows.append(slots[: i + 1] + [-1] * (lmax - i - 1))
    return torch.tensor(rows)


def _case(idx, p, h=4, c=32, r=8, dtype=torch.float32):
    t = idx.shape[0]
    return (torch.randn(t, h, c, generator=g).to(dtype), torch.randn(t, h, r, generator=g).to(dtype),
            torch.randn(p, c, generator=g).to(dtype), torch.randn(p, r, generator=g).to(dtype), idx, 0.2)


def _check(args, tol=1e-5):
    with atb_ops.use_backend("npu"):
        got = atb_ops.mla_decode_split(*args)
    want = _registry["reference"]["mla_decode_split"](*args)
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.numel():
        assert float((got.float() - want.float()).abs().max()) <= tol * max(1.0, float(want.float().abs().max()))


@pytest.mark.parametrize("bs", [16, 32])
def test_paged_form_on_whole_pages(fia_calls, bs):
    idx = _contexts([1, 19, 40], bs, blocks=8)  # one token, a partial last page, several pages
    _check(_case(idx, 8 * bs))
    assert fia_calls and all(fia_calls)


def test_gathered_form_when_rows_are_not_pages(fia_calls):
    idx = torch.randint(0, 64, (5, 9), generator=g)
    idx[torch.rand(5, 9, generator=g) < 0.3] = -1  # -1 scattered, not only at the end
    idx[2] = -1  # a token without any row returns 0
    _check(_case(idx, 64))
    assert fia_calls and not any(fia_calls)


def test_edge_cases(emu):
    _check(_case(torch.zeros(0, 4, dtype=torch.long), 32))  # empty batch
    _check(_case(torch.full((2, 0), -1, dtype=torch.long), 32))  # no context columns
    _check(_case(_contexts([3], 16, 2), 32, dtype=torch.bfloat16), tol=2e-2)


def test_layouts_by_backend(emu):
    assert atb_ops.kv_layout("reference") == atb_ops.kv_layout(device="cpu") == atb_ops.KVLayout()
    lay = atb_ops.kv_layout("npu")
    assert lay.mla_split_rope and lay.block_size_multiple == 16


def test_toy_v3_runs_on_split_caches(fia_calls):
    from ascend_dsv4 import LLM
    from atb_ops.npu import optable

    ids = [1, 5, 9, 100, 33, 7, 81, 14, 2, 3, 99, 100, 17]
    ref = LLM(model="toy-v3", backend="reference", device="cpu", progress=False)
    assert not ref.runner.pools.split_rope
    want = ref.logits(ids, prefill_len=9)
    optable.reset()
    llm = LLM(model="toy-v3", backend="npu", device="cpu", progress=False)
    pools = llm.runner.pools
    assert pools.split_rope and pools.latent is None
    assert pools.nbytes() == ref.runner.pools.nbytes()  # same bytes, two tensors
    got = llm.logits(ids, prefill_len=9)
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-4
    assert optable.table()["mla_decode_split"].calls > 0 and optable.table()["mla_decode"].calls == 0
    assert any(fia_calls)  # decode steps read the caches in place through the paged form


def test_npu_block_size_must_be_a_multiple_of_16(emu):
    from ascend_dsv4 import LLM
    from ascend_dsv4.errors import ConfigError

    with pytest.raises(ConfigError, match="block_size 8 is not a multiple of 16"):
        LLM(model="toy-v3", backend="npu", device="cpu", progress=False, block_size=8)
