"""AsyncLLMEngine: the engine's step loop on its own thread, fed from the event loop.

`LLMEngine` is not thread-safe, so exactly one thread (the step thread) ever calls it. The
event loop hands it adds and aborts through a command queue; the step thread hands outputs
back with `loop.call_soon_threadsafe`, one batch per step, into per-request asyncio queues.

Everything that touches `_streams` or `_pending` runs on the event loop thread; everything
that touches the engine runs on the step thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

from ssmserve.engine.engine import RequestFailedError
from ssmserve.outputs import RequestOutput
from ssmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop crashed or the server is shutting down; no request can be served."""


class RequestAbortedError(RuntimeError):
    """The request was aborted before it finished (by the client or at shutdown)."""


class ServerStoppingError(RequestAbortedError):
    """The server is shutting down: a running request was cut, or a new one refused."""


class RequestStream:
    """Outputs of one request, in order. Iterate it; `abort()` frees its blocks and slot.

    The last item is the output with `finished=True`; an exception put in the queue is
    raised to the reader instead.
    """

    def __init__(self, request_id: str, owner: AsyncLLMEngine) -> None:
        self.request_id = request_id
        self.finished = False
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def abort(self) -> None:
        """Abort the request if it is still running; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._owner._abort(self.request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._queue.empty() and self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


class AsyncLLMEngine:
    """Async front of one `LLMEngine`; `start()` it inside a running event loop."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.model_config.max_model_len
        self.sampling_defaults: dict[str, Any] = engine.sampling_defaults
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}
        self._pending: set[asyncio.Future] = set()
        self._dead: EngineDeadError | None = None
        self._stopping: ServerStoppingError | None = None
        self._stats: dict[str, int] = dict(engine.stats())

    @classmethod
    def from_config(cls, config: Any) -> AsyncLLMEngine:
        from ssmserve.engine.collector import freeze_engine_objects
        from ssmserve.engine.engine import LLMEngine

        engine = LLMEngine(config)
        freeze_engine_objects()  # the server keeps this engine for its life
        return cls(engine)

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the step thread; call from the event loop that will read the outputs."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="ssmserve-step-loop", daemon=True)
        self._thread.start()

    def stop_requests(self, error: ServerStoppingError) -> None:
        """Fail every running request with `error` (freeing its cache) and refuse new ones
        with it; the step thread keeps running."""
        self._stopping = error
        for stream in list(self._streams.values()):
            stream._put(error)
            stream.abort()

    async def shutdown(self) -> None:
        """Abort whatever still runs, stop the step thread and wait for it."""
        self.stop_requests(ServerStoppingError("the server is shutting down"))
        self._stop = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        self._fail_pending(EngineDeadError("the server is shutting down"))

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    def stats(self) -> dict[str, int]:
        """Engine counters as of the end of the last step, add or abort."""
        return self._stats

    # ----------------------------------------------------------------- requests

    async def add_request(
        self, request_id: str, prompt: Any, params: SamplingParams
    ) -> RequestStream:
        """Queue a request; return its stream once the engine has accepted it.

        Raises the engine's InvalidRequestError (a ValueError) for bad input,
        ServerStoppingError once the server is stopping, and EngineDeadError when the step
        loop is not running.
        """
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream
        try:
            await self._submit(("add", request_id, prompt, params))
        except BaseException:
            # Rejected, engine died, or the caller was cancelled while waiting.
            stream.abort()
            raise
        return stream

    async def generate(
        self, request_id: str, prompt: Any, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs; abort it if the caller stops early."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.abort()

    # ----------------------------------------------------------------- event-loop side

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._thread is None:
            raise EngineDeadError("the engine is not running (not started or shut down)")
        if self._stopping is not None:
            raise self._stopping

    async def _submit(self, command: tuple) -> Any:
        assert self._loop is not None
        future = self._loop.create_future()
        self._pending.add(future)
        try:
            self._commands.put((*command, future))
            self._wakeup.set()
            return await future
        finally:
            self._pending.discard(future)

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None and self._thread is not None:
            self._commands.put(("abort", request_id, None))
            self._wakeup.set()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted while this step ran
            if output.finished:
                del self._streams[output.request_id]
            stream._put(output)

    def _fail_requests(self, failures: dict[str, Exception]) -> None:
        for request_id, exc in failures.items():
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream._put(RequestFailedError({request_id: exc}, []))

    def _fail_everything(self, error: EngineDeadError) -> None:
        self._dead = error
        for stream in self._streams.values():
            stream._put(error)
        self._streams.clear()
        self._fail_pending(error)

    def _fail_pending(self, error: BaseException) -> None:
        for future in self._pending:
            if not future.done():
                future.set_exception(error)
        self._pending.clear()

    @staticmethod
    def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
        if future.done():
            return  # the waiter was cancelled
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    # ----------------------------------------------------------------- step thread

    def _run(self) -> None:
        assert self._loop is not None
        loop = self._loop
        engine = self.engine
        try:
            while not self._stop:
                self._run_commands()
                if self._stop:
                    break
                if not engine.has_unfinished_requests():
                    self._stats = dict(engine.stats())
                    self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                try:
                    outputs = engine.step()
                except RequestFailedError as exc:
                    # Those requests are gone from the engine; everything else goes on.
                    outputs = exc.outputs
                    loop.call_soon_threadsafe(self._fail_requests, exc.failures)
                self._stats = dict(engine.stats())
                if outputs:
                    loop.call_soon_threadsafe(self._deliver, outputs)
            # Shutdown: run the aborts queued by shutdown(), refuse adds that raced it.
            self._run_commands(accept_adds=False)
            self._stats = dict(engine.stats())
        except BaseException as exc:  # noqa: BLE001 - any crash must reach every waiter
            logger.exception("the engine step loop crashed; failing all requests")
            error = EngineDeadError(f"the engine crashed: {type(exc).__name__}: {exc}")
            try:
                loop.call_soon_threadsafe(self._fail_everything, error)
            except RuntimeError:
                pass  # the event loop is already closed

    def _run_commands(self, accept_adds: bool = True) -> None:
        loop = self._loop
        assert loop is not None
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "abort":
                self._engine_abort(command[1])
                self._stats = dict(self.engine.stats())
            elif kind == "add":
                _, request_id, prompt, params, future = command
                result, error = None, None
                try:
                    if not accept_adds:
                        raise ServerStoppingError("the server is shutting down")
                    self.engine.add_request(request_id, prompt, params)
                except ServerStoppingError as exc:
                    error = exc
                except ValueError as exc:  # InvalidRequestError and SamplingParams errors
                    error = exc
                except Exception as exc:  # noqa: BLE001 - one bad request must not kill the loop
                    logger.exception("adding request %s failed", request_id)
                    error = exc
                loop.call_soon_threadsafe(self._resolve, future, result, error)

    def _engine_abort(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:  # noqa: BLE001 - aborting an already-finished request is harmless
            logger.debug("abort of %s failed", request_id, exc_info=True)
