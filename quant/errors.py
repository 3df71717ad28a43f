"""Errors raised by the weight-format codecs in :mod:`quant`.

Every message names the tensor (checkpoint key) it is about, so that a bad
checkpoint can be traced to one entry of one file.
"""

from __future__ import annotations


class ReportedError(Exception):
    """Root of every error a user's input can cause, here and in :mod:`ascend_dsv4` (whose ``AscendDSV4Error``
    is this class: :mod:`quant` imports nothing of the serving package, so the root lives in the package below
    it). A command line prints it as one line, without a stack trace."""


class CheckpointError(ReportedError):
    """A checkpoint folder or file is broken, incomplete, or holds tensors of the wrong name, shape or dtype."""


class QuantFormatError(ReportedError, ValueError):
    """A quantised tensor or its scale has the wrong dtype, shape or a forbidden value.

    Also a ``ValueError``. The message always names the tensor.
    """


def tensor_label(name: str) -> str:
    """Return how a tensor is named in error messages: ``'key'`` or ``<unnamed tensor>``."""
    return repr(name) if name else "<unnamed tensor>"


__all__ = ["CheckpointError", "QuantFormatError", "ReportedError", "tensor_label"]
