"""mla_decode_split (the MLA latent kept as two caches) is mla_decode over the concatenated rows; the split pool
layout stores and reads back the same latents as the reference layout."""

import torch

import atb_ops

g = torch.Generator().manual_seed(5)


def test_mla_decode_split_equals_mla_decode():
    t, h, c, r, p = 6, 3, 16, 4, 40
    qa, qp = torch.randn(t, h, c, generator=g), torch.randn(t, h, r, generator=g)
    ckv, kpe = torch.randn(p, c, generator=g), torch.randn(p, r, generator=g)
    idx = torch.randint(0, p, (t, 7), generator=g)
    idx[torch.rand(t, 7, generator=g) < 0.3] = -1
    idx[1] = -1
    got = atb_ops.mla_decode_split(qa, qp, ckv, kpe, idx, 0.3)
    want = atb_ops.mla_decode(qa, qp, torch.cat([ckv, kpe], -1), idx, 0.3)
    assert torch.equal(got, want) and bool((got[1] == 0).all())
    assert atb_ops.mla_decode_split(qa[:0], qp[:0], ckv, kpe, idx[:0], 0.3).shape == (0, h, c)


def test_split_pool_layout_round_trip():
    from ascend_dsv4.kv.blocks import PoolSizes
    from ascend_dsv4.kv.latent_pool import MLAKVPools
    from ascend_dsv4.models import preset

    cfg = preset("toy-v3")
    sizes = PoolSizes(num_blocks=4, block_size=16)
    a = MLAKVPools(cfg, sizes, torch.float32)
    b = MLAKVPools(cfg, sizes, torch.float32, split_rope=True)
    C, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    slot = torch.tensor([3, 17, 40])
    c, k = torch.randn(3, C, generator=g), torch.randn(3, R, generator=g)
    for pool in (a, b):
        pool.write(1, slot, c, k)
        pool.copy_page("token", 1, 3)  # slot 17 -> 49
    for s in ([3, 17, 40, 49], [0, 5]):
        s = torch.tensor(s)
        assert torch.equal(a.rows(1, s), b.rows(1, s))
    assert a.nbytes() == b.nbytes()
    ckv, kpe = b.layer_split(1)
    assert torch.equal(torch.cat([ckv, kpe], -1), a.layer(1))
