"""Layers both model families share: RMSNorm and float32 parameters (:mod:`.norm`), stacked routed experts
(:mod:`.experts`). Linear layers (dense, FP8 block, FP4) live in :mod:`parallel.linear`, beside the tensor-parallel
ones."""
