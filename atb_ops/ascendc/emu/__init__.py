"""Host harness for the AscendC kernels: our emulation of the AscendC API subset they use (kernel_operator_emu.h),
a g++ build cached by source hash (build.py), the ctypes launcher (runner.py) and the ``ascendc_emu`` atb_ops
backend (backend.py). Importing this package registers the backend; the library compiles on the first kernel call.
"""

from . import backend  # noqa: F401  (registers compressor_pool / sparse_attention / mla_decode on "ascendc_emu")
