"""The KV layer beneath models and engine: page bookkeeping (:mod:`.blocks`), the step context the models read
(:mod:`.context`; for graph-captured decode steps derived on the device from compact inputs, :mod:`.decode_inputs`),
DeepSeek-V4's paged window / compressed pools (:mod:`.compressed_pools`), DeepSeek-V3's MLA
latent pool (:mod:`.latent_pool`) and the protocol both satisfy (:mod:`.protocol`). Imports nothing of models,
engine or weights."""

from .blocks import BlockAllocator, EntrySpace, PoolSizes, SeqBlocks
from .compressed_pools import V4KVPools
from .context import CompressCtx, StepContext
from .latent_pool import MLAKVPools, MLAStepContext
from .protocol import KVPool

__all__ = ["BlockAllocator", "CompressCtx", "EntrySpace", "KVPool", "MLAKVPools", "MLAStepContext", "PoolSizes",
           "SeqBlocks", "StepContext", "V4KVPools"]
