"""Pure-PyTorch reference implementations: THE definition of every atb_ops op.

Importing this package registers each function as the ``reference`` backend of its op.
"""

from . import attention, compressor, hc, indexer, kv_quant, linear, mla, moe, norm, quant_linear, quant_sim, rope, routing  # noqa: F401
