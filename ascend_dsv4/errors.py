"""Exception types for every failure a user can cause. Messages name the file, tensor, field or request.

The root class and :class:`CheckpointError` come from :mod:`quant.errors` (the codec package stands alone, and
its checkpoint errors must be ours): ``AscendDSV4Error`` is :class:`quant.errors.ReportedError`, so the CLI
prints every one of them -- codec and file errors included -- as one line, without a stack trace.
"""

from quant.errors import CheckpointError, ReportedError as AscendDSV4Error

__all__ = ["AscendDSV4Error", "CapacityError", "CheckpointError", "ConfigError", "RequestError"]


class ConfigError(AscendDSV4Error, ValueError):
    """A model config is unknown, malformed, or its fields break a rule of the architecture."""


class RequestError(AscendDSV4Error, ValueError):
    """A request cannot be served as given (prompt too long, bad sampling parameters, ...)."""


class CapacityError(AscendDSV4Error, RuntimeError):
    """The KV pools have no room for what was asked."""


class RequestFailed(AscendDSV4Error, RuntimeError):
    """One request could not be computed (non-finite logits, a sampling or detokenising failure); the engine
    ends that request with this error and goes on serving the others."""
