"""Divisibility rules a tensor / expert-parallel layout must satisfy, shared by the family-specific rules
(``deepseek_v4/tp_rules.py``, ``deepseek_v3/tp_rules.py``) and :mod:`ascend_dsv4.parallel_plan`."""

from __future__ import annotations

from ..errors import ConfigError


def divisible(fld: str, value: int, by: int, what: str) -> None:
    """ConfigError naming ``fld`` unless ``value`` splits evenly over ``by`` ranks."""
    if by > 1 and value % by:
        raise ConfigError(f"{fld} = {value} is not divisible by {what} {by}: "
                          f"choose a --tensor-parallel-size that divides it")


def whole_blocks(fld: str, share: int, block: int, tp: int, fmt: str) -> None:
    """ConfigError unless each rank's ``share`` of a block-quantised weight is a whole number of scale blocks."""
    if tp > 1 and share % block:
        raise ConfigError(f"{fld}: each of the {tp} ranks would hold {share} rows/columns of a {fmt} weight, not a "
                          f"multiple of its {block}-wide scale blocks; use a smaller --tensor-parallel-size")
