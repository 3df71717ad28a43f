"""The OpenAI-compatible HTTP API: :mod:`.protocol` (errors and request fields), :mod:`.serving` (streams, SSE,
usage, metrics), :mod:`.routes` (the FastAPI app). :mod:`ascend_dsv4.entrypoints.server` runs it."""
