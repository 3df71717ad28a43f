"""Layers both model families and the loaders share: RMSNorm and float32 parameters (:mod:`.norm`), stacked routed
experts (:mod:`.experts`), the msModelSlim quantised linear / experts / smoothed norm (:mod:`.quantized`).

The linear layer (dense, FP8 block, FP4 weights through :func:`atb_ops.linear`) is :class:`parallel.linear.Linear`:
it lives beside the tensor-parallel column / row / vocab linears that subclass it.
"""
