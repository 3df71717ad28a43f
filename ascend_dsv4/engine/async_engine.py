"""AsyncEngine: the synchronous :class:`LLMEngine` driven by one background thread, for asyncio servers.

``async for out in engine.generate(prompt, params): ...`` yields a :class:`RequestOutput` each time the request
produces tokens (the last one has ``finished=True``). Cancelling the iteration (a client that disconnects)
aborts the request and frees its pages. Admission is bounded: beyond ``max_queue`` waiting requests,
:meth:`generate` raises :class:`EngineOverloaded` (servers answer 429/503).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import AsyncIterator

from ..errors import AscendDSV4Error
from .engine import LLMEngine
from .request import RequestOutput
from .sampling import SamplingParams


class EngineOverloaded(AscendDSV4Error):
    """Too many requests are queued."""


class EngineDead(AscendDSV4Error):
    """The engine thread stopped after an internal error."""


class EngineShuttingDown(AscendDSV4Error):
    """The server is shutting down: the request was ended before it finished."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue: int = 256, ops_context=None):
        self.engine = engine
        self.max_queue = max_queue
        self._ops_context = ops_context
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # adds and aborts are handed to the engine thread: the event loop never waits for an engine step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="ascend-dsv4-engine", daemon=True)
        self._thread.start()
        self.started = time.time()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ---- the engine thread -------------------------------------------------------------------------------
    def _loop(self) -> None:
        import contextlib

        ctx = self._ops_context() if self._ops_context else contextlib.nullcontext()
        with ctx:
            while not self._stop:
                self._drain_inbox()
                with self._lock:
                    busy = self.engine.has_unfinished()
                if not busy:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                try:
                    with self._lock:
                        outs = self.engine.step()
                except BaseException as e:  # keep serving errors visible instead of hanging clients
                    self._error = e
                    for loop, q in list(self._queues.values()):
                        loop.call_soon_threadsafe(q.put_nowait, e)
                    return
                for o in outs:
                    item = self._queues.get(o.request_id)
                    if item is not None:
                        loop, q = item
                        loop.call_soon_threadsafe(q.put_nowait, o)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                if kind == "add":
                    try:
                        self.engine.enqueue(item)
                    except Exception as e:  # a duplicate id: tell that request's caller
                        entry = self._queues.get(item.request_id)
                        if entry is not None:
                            entry[0].call_soon_threadsafe(entry[1].put_nowait, e)
                else:
                    self.engine.abort_request(item)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)

    # ---- API -----------------------------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        if self._error is not None:
            raise EngineDead(f"the engine stopped: {self._error!r}")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        waiting = self.engine.num_waiting + self._inbox.qsize()  # a racy read is fine for admission control
        if waiting >= self.max_queue:
            raise EngineOverloaded(f"{waiting} requests are already waiting (max_queue {self.max_queue}); retry later")
        req = self.engine.make_request(prompt, params, request_id)  # validation errors raise here, at once
        rid = req.request_id
        self._queues[rid] = (loop, q)
        self._inbox.put(("add", req))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, AscendDSV4Error):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDead(f"the engine stopped: {item!r}")
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self._inbox.put(("abort", rid))
                self._wake.set()

    def fail_all(self, message: str) -> int:
        """End every request in flight with :class:`EngineShuttingDown` (``message``); their callers' iterations
        raise it and abort their requests (safe from any thread). Returns how many were ended."""
        items = list(self._queues.values())
        for loop, q in items:
            loop.call_soon_threadsafe(q.put_nowait, EngineShuttingDown(message))
        return len(items)

    async def abort(self, request_id: str) -> bool:
        self._inbox.put(("abort", request_id))
        self._wake.set()
        return True

    def stats(self) -> dict:
        """A snapshot of the engine's counters (for /metrics)."""
        with self._lock:
            e = self.engine
            s = e.stats
            return {
                "num_waiting": e.num_waiting, "num_running": e.num_running, "kv_usage": e.kv_usage(),
                "prompt_tokens": s.prompt_tokens, "generation_tokens": s.generation_tokens,
                "finished": s.finished, "aborted": s.aborted, "preemptions": e.scheduler.num_preemptions,
                "ttft": list(s.ttft), "tpot": list(s.tpot),
                "prefix_hit_rate": s.prefix_hit_tokens / s.prefix_query_tokens if s.prefix_query_tokens else 0.0,
                "mtp_acceptance": s.mtp_accepted / s.mtp_proposed if s.mtp_proposed else 0.0,
                "steps": s.steps, "uptime_s": time.time() - self.started,
            }
