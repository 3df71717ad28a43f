"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over :class:`~ascend_dsv4.engine.async_engine.AsyncEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream over server-sent events when
``"stream": true``: ``data: {json}\\n\\n`` chunks, then ``data: [DONE]\\n\\n``), ``GET /v1/models``,
``GET /v1/models/{name}``, ``GET /health`` and ``GET /metrics`` (Prometheus text format).

The OpenAI layer lives in :mod:`.openai`: ``protocol`` (errors, request fields and their checks), ``serving``
(output streams, SSE, usage, metrics) and ``routes`` (the app, its middleware and routes). This module runs it.

* ``create_app(async_engine, model_name, api_key=None, max_model_len=None, ...)`` builds the app; tests drive
  it through ``httpx.ASGITransport`` or :class:`ServerThread` (uvicorn on 127.0.0.1 in a background thread).
* ``run_server(llm, host="127.0.0.1", port=8000, ...)`` wraps an :class:`~ascend_dsv4.LLM` in an AsyncEngine
  and serves until interrupted (``ascend-dsv4 serve``).

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid requests (the
offending field in ``param``), 401 for a missing / wrong API key (``Authorization: Bearer <key>``, only on
``/v1/*``), 429 when the engine queue is full, 503 when the engine thread died, 500 for anything unexpected.
A client that disconnects (streaming or not) aborts its request, which frees its KV pages.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Sequence

from ..engine.async_engine import AsyncEngine
from ..errors import AscendDSV4Error
from .openai.protocol import MAX_LOGPROBS, ApiError
from .openai.routes import create_app
from .serve_lifecycle import DrainingServer, DrainState, bind_socket

log = logging.getLogger("ascend_dsv4.server")

__all__ = ["create_app", "run_server", "ServerThread", "ApiError", "MAX_LOGPROBS"]


# ---- running ------------------------------------------------------------------------------------------------
class ServerThread:
    """uvicorn serving ``app`` on ``host:port`` (``port=0``: a free port) in a background thread.

    ``with ServerThread(app) as srv: ... srv.url ...``; :meth:`stop` asks uvicorn to exit and joins the thread."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(fam, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        cfg = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2, lifespan="off")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="ascend-dsv4-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{h}:{self.port}"

    def start(self, timeout: float = 20.0) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_server(llm, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               served_model_name: str | Sequence[str] | None = None, max_queue: int = 256,
               model_dir: str | None = None, chat_template: str | None = None, log_level: str = "info",
               sock=None, shutdown_timeout: float = 30.0) -> None:
    """Serve ``llm`` (an :class:`~ascend_dsv4.LLM`) until interrupted; the engine thread stops on exit.

    ``sock``: a socket from :func:`~.serve_lifecycle.bind_socket` (bound before the model loaded); else
    ``host:port`` is bound here. SIGTERM drains: new requests get 503, those in flight get ``shutdown_timeout``
    seconds, then the server exits normally."""
    import uvicorn

    if not isinstance(max_queue, int) or max_queue < 1:
        raise AscendDSV4Error(f"max_queue must be a positive integer, got {max_queue!r}")
    sock = sock if sock is not None else bind_socket(host, port)
    engine = AsyncEngine(llm.engine, max_queue=max_queue, ops_context=llm._ops)
    try:
        names = served_model_name or getattr(llm.cfg, "name", None) or "ascend-dsv4"
        drain = DrainState()
        app = create_app(engine, names, api_key, llm.max_model_len, model_dir=model_dir, chat_template=chat_template,
                         drain=drain)
        port = sock.getsockname()[1]
        where = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        # listen before saying so: a client that connects as soon as it reads the line below waits in the backlog
        # until uvicorn accepts, where an unlistened socket refused it (bound at startup, before the model loaded,
        # so that connections during the load are still refused)
        cfg = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
        sock.listen(cfg.backlog)
        log.info("serving %s on %s (max_model_len %d, max_queue %d, API key %s)",
                 names if isinstance(names, str) else ", ".join(names), where, llm.max_model_len, max_queue,
                 "required" if api_key else "off")
        server = DrainingServer(cfg, drain, engine.fail_all, shutdown_timeout)
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()
