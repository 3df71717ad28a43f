"""DeepSeek-V4's pool layout: paged window / compressor-state / compressed-entry pools
(:class:`ascend_dsv4.kv.compressed_pools.V4KVPools`), with token pages trimmed to the live span."""

from __future__ import annotations

from .config import DeepseekV4Config


def token_pages_per_sequence(cfg: DeepseekV4Config, block_size: int, max_model_len: int,
                             max_num_batched_tokens: int) -> int:
    """Token pages one sequence holds at most: its window and open compression blocks (older pages are trimmed
    after every step) plus the pages of a prefill chunk in flight."""
    keep = max(cfg.window_size, 128 if 128 in cfg.compress_ratios else 8) + block_size
    return -(-(keep + max_num_batched_tokens) // block_size) + 1
