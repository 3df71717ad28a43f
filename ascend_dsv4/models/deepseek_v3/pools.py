"""DeepSeek-V3's pool layout: the paged MLA latent pool (:class:`ascend_dsv4.kv.latent_pool.MLAKVPools`);
attention is full, so a sequence keeps every position's page until it is freed."""

from __future__ import annotations

from .config import DeepseekV3Config


def token_pages_per_sequence(cfg: DeepseekV3Config, block_size: int, max_model_len: int,
                             max_num_batched_tokens: int) -> int:
    """Token pages one sequence holds at most: every position up to ``max_model_len``."""
    return -(-max_model_len // block_size) + 1
