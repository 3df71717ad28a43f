"""Exception types for every failure a user can cause. Messages name the file, tensor, field or request."""


class AscendDSV4Error(Exception):
    """Base class: the CLI prints these as one line, without a stack trace."""


class ConfigError(AscendDSV4Error, ValueError):
    """A model config is unknown, malformed, or its fields break a rule of the architecture."""


class CheckpointError(AscendDSV4Error):
    """A checkpoint folder is missing tensors or holds tensors of the wrong name, shape or dtype."""


class RequestError(AscendDSV4Error, ValueError):
    """A request cannot be served as given (prompt too long, bad sampling parameters, ...)."""


class CapacityError(AscendDSV4Error, RuntimeError):
    """The KV pools have no room for what was asked."""


class RequestFailed(AscendDSV4Error, RuntimeError):
    """One request could not be computed (non-finite logits, a sampling or detokenising failure); the engine
    ends that request with this error and goes on serving the others."""
