"""Our AscendC kernels (KV compressor pooling, MLA / sparse decode attention).

- ``kernels/``: the kernel sources (AscendC), their tiling structs and host tiling;
- ``emu/``: the host harness (backend ``ascendc_emu``) that compiles the same sources against our own emulation
  of the AscendC API subset they use;
- ``binding/`` + ``CMakeLists.txt`` + ``scripts/build_ascendc.sh``: the CANN build and torch binding
  (``torch.ops.ascend_dsv4.*``), loaded by :func:`atb_ops.ascendc.loader.load_ascendc_ops`.

Importing this package does not import torch_npu or compile anything.
"""
