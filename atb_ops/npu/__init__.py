"""Ascend NPU backend (torch_npu fused ops and custom-op packages).

Registers implementations with ``atb_ops._dispatch.register(op, "npu")`` when torch_npu is importable.
No NPU kernel has landed yet: NPU tensors run the reference implementation on the device (the dispatcher
logs this once per op). NPU hardware is not available to this project; see DESIGN.md for how this
backend is tested (emulated torch_npu ops plus the wheel's meta functions).
"""

# Our AscendC kernels (atb_ops/ascendc), when their library is built, replace composed paths for their ops. Keep last.
from ..ascendc.loader import register_npu_kernels  # noqa: E402

register_npu_kernels()
