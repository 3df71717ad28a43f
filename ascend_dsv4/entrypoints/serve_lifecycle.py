"""How ``ascend-dsv4 serve`` starts and stops: the listening socket is bound before the model loads, and SIGTERM
drains instead of cutting streams.

* :func:`bind_socket` -- the listening socket of ``host:port``; a port in use (or a bad address) is an
  :class:`~ascend_dsv4.errors.AscendDSV4Error` naming both, so the CLI prints one ``error:`` line and exits 2, before
  minutes of weight loading.
* :class:`DrainingServer` -- uvicorn's server with a different first SIGTERM: the app's :class:`DrainState` turns
  ``draining`` on (every new request is answered 503 ``server_shutting_down`` with ``Connection: close``), requests in
  flight get ``grace_s`` seconds to finish, whatever is still running then is ended by the engine with an error
  (a stream gets an error event and ``[DONE]``), and the server exits normally (status 0). A second SIGTERM, or
  SIGINT, stops at once as uvicorn does.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time

from ..errors import AscendDSV4Error

log = logging.getLogger("ascend_dsv4.server")

__all__ = ["bind_socket", "DrainState", "DrainingServer"]


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (IPv6 when ``host`` has a colon), ready for uvicorn to listen on."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(fam, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT port, not one in use, is reusable
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = "address already in use" if e.errno in (98, 48, 10048) else (e.strerror or str(e))
        raise AscendDSV4Error(f"cannot listen on {host}:{port}: {why}") from None
    return sock


class DrainState:
    """Shared by the app (which refuses new requests while ``draining`` and counts ``in_flight``) and the server."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            self.in_flight += 1

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1


def _uvicorn_server_class():
    import uvicorn

    return uvicorn.Server


class DrainingServer(_uvicorn_server_class()):  # type: ignore[misc]
    """uvicorn.Server whose first SIGTERM drains (see the module docstring) and exits with status 0."""

    def __init__(self, config, drain: DrainState, fail_all, grace_s: float = 30.0):
        super().__init__(config)
        self.drain, self.fail_all, self.grace_s = drain, fail_all, grace_s
        self._drain_thread: threading.Thread | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if sig != signal.SIGTERM or self._drain_thread is not None:
            return super().handle_exit(sig, frame)  # SIGINT, or a second SIGTERM: uvicorn's own way
        log.info("SIGTERM: draining (no new requests; %d in flight get %.0f s to finish)", self.drain.in_flight,
                 self.grace_s)
        self.drain.draining = True
        self._drain_thread = threading.Thread(target=self._drain, name="ascend-dsv4-drain", daemon=True)
        self._drain_thread.start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.grace_s
        while self.drain.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.drain.in_flight > 0:
            log.warning("drain: %d request(s) still running after %.0f s: ending them with an error",
                        self.drain.in_flight, self.grace_s)
            self.fail_all("the server is shutting down")
            t = time.monotonic() + 5.0
            while self.drain.in_flight > 0 and time.monotonic() < t:
                time.sleep(0.05)
        log.info("drain complete: shutting down")
        self.should_exit = True
