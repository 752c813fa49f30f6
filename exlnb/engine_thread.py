"""The one thread that owns an engine.

Jupyter's kernel runs an asyncio loop; a forward pass must never block it. So the engine lives on its own
thread, which alternates between running commands sent by other threads (submit, cancel, snapshots) and
stepping the engine while it has work. Nothing else ever touches the engine, so engines need no locks,
and a cancel requested from a garbage-collector callback in the middle of a step simply waits its turn.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from exlnb.engines.base import Engine, StreamEvent

T = TypeVar("T")
log = logging.getLogger(__name__)

_STOP = object()


class EngineThread(threading.Thread):
    """Runs `engine.step()` while there is work and hands every batch of events to `deliver`."""

    def __init__(
        self,
        engine: Engine,
        deliver: Callable[[list[StreamEvent]], None],
        on_step_error: Callable[[BaseException], None],
    ) -> None:
        super().__init__(name=f"exlnb-{engine.name}-engine", daemon=True)
        self.engine = engine
        self._deliver = deliver
        self._on_step_error = on_step_error
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stepping = False

    def call(self, fn: Callable[[Engine], T]) -> T | None:
        """Run `fn(engine)` on the engine thread between steps and return its result (or raise its error).

        Called on the engine thread itself (a finaliser that ran inside a step), it can only queue the
        call: running it now would re-enter the engine mid-step. Then it returns None.
        """
        if threading.current_thread() is self:
            if self._stepping:
                self.post(fn)
                return None
            return fn(self.engine)
        future: Future[T] = Future()
        self._commands.put((fn, future))
        return future.result()

    def post(self, fn: Callable[[Engine], Any]) -> None:
        """Queue `fn(engine)` without waiting: safe from any thread, even from a finaliser mid-step."""
        self._commands.put((fn, None))

    def stop(self) -> None:
        self._commands.put(_STOP)
        if threading.current_thread() is not self:
            self.join()

    def run(self) -> None:
        while True:
            busy = self.engine.has_work()
            try:
                command = self._commands.get_nowait() if busy else self._commands.get()
            except queue.Empty:
                command = None
            if command is _STOP:
                return
            if command is not None:
                self._run_command(*command)
                continue  # drain every waiting command before the next step
            self._stepping = True
            try:
                events = self.engine.step()
            except BaseException as error:  # noqa: BLE001 - reported to every consumer, thread lives on
                self._on_step_error(error)
                continue
            finally:
                self._stepping = False
            if events:
                self._deliver(events)

    def _run_command(self, fn: Callable[[Engine], Any], future: Future | None) -> None:
        try:
            result = fn(self.engine)
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            if future is None:
                log.exception("exlnb: a queued engine command failed")
            else:
                future.set_exception(error)
            return
        if future is not None:
            future.set_result(result)
