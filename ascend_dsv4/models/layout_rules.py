"""Divisibility rules a tensor-parallel layout must meet, as checks raising :class:`ConfigError` naming the field
(shared by :mod:`.parallel_plan` and the families' own layout checks)."""

from __future__ import annotations

from ..errors import ConfigError


def check_divisible(fld: str, value: int, by: int, what: str) -> None:
    if by > 1 and value % by:
        raise ConfigError(f"{fld} = {value} is not divisible by {what} {by}: "
                          f"choose a --tensor-parallel-size that divides it")


def check_blocks(fld: str, share: int, block: int, tp: int, fmt: str) -> None:
    """Each rank's ``share`` rows / columns of a block-quantised (``fmt``) weight must be whole scale blocks."""
    if tp > 1 and share % block:
        raise ConfigError(f"{fld}: each of the {tp} ranks would hold {share} rows/columns of a {fmt} weight, not a "
                          f"multiple of its {block}-wide scale blocks; use a smaller --tensor-parallel-size")
