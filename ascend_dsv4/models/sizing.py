"""Sizing vocabulary shared by the model families: one checkpoint tensor (:class:`TensorSpec`) and the number
formats of the ``ascend-dsv4 info`` report. Each family's ``sizing.py`` lists its tensors and plans memory."""

from __future__ import annotations

import math
from dataclasses import dataclass

# safetensors dtype name -> bytes per stored element
DTYPE_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I64": 8, "I8": 1}

@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor (or ``count`` tensors of the same shape, e.g. the E routed experts).

    ``name`` may hold ``{e}`` for the expert index. ``group`` is the :func:`param_breakdown` bucket;
    ``scale`` marks quantisation scales and ``table`` the tid2eid lookup tables (neither counts as parameters).
    ``packed_fp4`` marks I8 tensors holding two FP4 values per byte (logical width ``2 * shape[-1]``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    group: str
    count: int = 1
    scale: bool = False
    table: bool = False
    packed_fp4: bool = False

    @property
    def numel(self) -> int:
        """Stored elements of one tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Stored bytes of all ``count`` tensors."""
        return self.count * self.numel * DTYPE_BYTES[self.dtype]

    @property
    def logical_numel(self) -> int:
        """Logical elements of all ``count`` tensors (packed FP4: two per stored byte)."""
        return self.count * self.numel * (2 if self.packed_fp4 else 1)

    @property
    def is_param(self) -> bool:
        return not (self.scale or self.table)


def fmt_ids(ids: list[int]) -> str:
    """Compact layer-id list: runs of step 1 as 'a-b', longer arithmetic runs as 'a,b,..,z' ('0-1,3,5,..,59')."""
    parts, i = [], 0
    while i < len(ids):
        j = i + 1
        if j < len(ids):
            step = ids[j] - ids[i]
            while j + 1 < len(ids) and ids[j + 1] - ids[j] == step:
                j += 1
            seg = ids[i:j + 1]
            if step == 1 and len(seg) >= 2:
                parts.append(f"{seg[0]}-{seg[-1]}")
            elif len(seg) >= 4:
                parts.append(f"{seg[0]},{seg[1]},..,{seg[-1]}")
            else:
                parts.append(",".join(map(str, seg[:-1])))
                j -= 1  # the last id may start the next run
            i = j + 1
        else:
            parts.append(str(ids[i]))
            i += 1
    return ",".join(parts) or "-"


def fmt_bytes(n: float) -> str:
    """Bytes with a binary unit ('1.50 GiB')."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):,.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):,.1f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):,.1f} KiB"
    return f"{n:,.0f} B"


def fmt_params(n: int) -> str:
    """A parameter count with a decimal unit ('37.55 B')."""
    if n >= 10**9:
        return f"{n / 1e9:,.2f} B"
    if n >= 10**6:
        return f"{n / 1e6:,.2f} M"
    return f"{n / 1e3:,.1f} K"
