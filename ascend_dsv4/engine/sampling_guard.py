"""Guards that keep one request's bad numbers from reaching the sampler (and from stopping the engine).

* :func:`bad_logit_rows` -- which rows of a logits batch [R, V] the sampler must not see: a row holding NaN or
  +inf, or no finite value at all. ``-inf`` entries alone are a legitimate mask and pass. One reduction over
  the batch (the row maximum: NaN if the row holds a NaN, +inf if it holds +inf, -inf if nothing in it is
  finite, else finite), on the logits' device.
* :func:`check_distribution` -- a row of probabilities [V] (or a batch [R, V]) is a distribution
  ``torch.multinomial`` can draw from: every entry finite and >= 0, the sum > 0. Raises
  :class:`~ascend_dsv4.errors.RequestFailed` otherwise (e.g. logits that overflowed after the division by a
  small temperature).

The engine turns a :class:`RequestFailed` (or any other exception raised while computing one request) into the
end of that request with ``finish_reason="abort"`` and ``error`` set; the other requests go on.
"""

from __future__ import annotations

import torch

from ..errors import RequestFailed

__all__ = ["bad_logit_rows", "bad_rows_of_max", "check_distribution", "describe_bad_row"]


@torch.no_grad()
def bad_logit_rows(logits: torch.Tensor) -> list[int]:
    """Indices of the rows of ``logits`` [R, V] holding NaN or +inf, or no finite value."""
    if logits.numel() == 0:
        return []
    return bad_rows_of_max(torch.amax(logits, dim=-1))  # amax propagates NaN


def bad_rows_of_max(row_max: torch.Tensor) -> list[int]:
    """The bad rows given each row's maximum [R]: NaN (a NaN in the row), +inf, or -inf (nothing finite)."""
    return torch.nonzero(~torch.isfinite(row_max)).flatten().tolist()


def describe_bad_row(row: torch.Tensor) -> str:
    """'3 NaN, 1 +inf, 0 finite of 1024' for a logits row [V]."""
    n_nan = int(torch.isnan(row).sum())
    n_pinf = int(torch.isposinf(row).sum())
    n_fin = int(torch.isfinite(row).sum())
    return f"{n_nan} NaN, {n_pinf} +inf, {n_fin} finite of {row.numel()}"


@torch.no_grad()
def check_distribution(probs: torch.Tensor, what: str = "sampling") -> None:
    """Raise RequestFailed unless every row of ``probs`` ([V] or [R, V]) is finite, >= 0 and sums to > 0."""
    p = probs if probs.dim() == 2 else probs[None]
    if p.numel() == 0:
        return
    ok = torch.isfinite(p).all(-1) & (p >= 0).all(-1) & (p.sum(-1) > 0)
    if not bool(ok.all()):
        r = int(torch.nonzero(~ok)[0, 0])
        raise RequestFailed(f"{what}: the probabilities are not a distribution ({describe_bad_row(p[r])}; "
                            f"sum {float(p[r].sum())!r}): the logits overflowed after penalties / temperature")
