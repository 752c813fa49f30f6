"""The one thread that owns an engine.

Jupyter's kernel runs an asyncio loop; a forward pass must never block it. So the engine lives on its own
thread, which alternates between running commands sent by other threads (submit, cancel, snapshots) and
stepping the engine while it has work. Nothing else ever touches the engine, so engines need no locks,
and a cancel requested from a garbage-collector callback in the middle of a step simply waits its turn.

A command is answered through a `Future`: a thread waits on it (`call`), a coroutine awaits it (`submit`
wrapped with `asyncio.wrap_future`), so the event loop never waits for a step. Once stopped, the thread
refuses new commands at once instead of leaving their callers waiting for an answer that never comes.

Views of the jobs and the cache (`views`) need no command: a command waits for the step in progress, and
`%exl_cache` once held the kernel 3-5 s while a long prompt was prefilled. The thread holds a lock while it
runs a command or a step; between them any thread reads the engine under that lock, and during a step gets
what the thread published when it last let go of the engine.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from exlnb.engines.base import CacheView, Engine, JobFailed, JobInfo, StreamEvent, wall_clock

T = TypeVar("T")
log = logging.getLogger(__name__)

_STOP = object()
# how long a view waits for the step in progress before it takes the published one; and at most how long a
# run of short steps goes unpublished (a step that ends a job, and every command, is published at once)
VIEW_WAIT_S = 0.05


@dataclass(frozen=True)
class EngineViews:
    """The engine's jobs and cache as they were at one moment between two steps."""

    jobs: tuple[JobInfo, ...]
    cache: CacheView
    at: float  # wall_clock() when they were read

    @classmethod
    def of(cls, engine: Engine) -> EngineViews:
        return cls(tuple(engine.jobs()), engine.cache_view(), wall_clock())


class EngineStopped(RuntimeError):
    """The engine thread was stopped (the model unloaded) before this command could run."""


class EngineThread(threading.Thread):
    """Runs `engine.step()` while there is work and hands every batch of events to `deliver`.

    `on_job_failure(job_ids, error)` hears of jobs the engine failed one by one (`JobFailed`);
    `on_step_error(error)` of a step that failed as a whole; `on_stop(engine)` runs on this thread after
    the last command, before it ends: where the session ends every stream still open.
    """

    def __init__(
        self,
        engine: Engine,
        deliver: Callable[[list[StreamEvent]], None],
        on_job_failure: Callable[[tuple[int, ...], BaseException], None],
        on_step_error: Callable[[Engine, BaseException], None],
        on_stop: Callable[[Engine], None],
    ) -> None:
        super().__init__(name=f"exlnb-{engine.name}-engine", daemon=True)
        self.engine = engine
        self._deliver = deliver
        self._on_job_failure = on_job_failure
        self._on_step_error = on_step_error
        self._on_stop = on_stop
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._accepting = threading.Lock()  # orders "refuse from now on" against every put
        self._queued = 0  # commands put and not yet run to their end (changed under `_accepting`)
        self._stopped = False
        self._stepping = False
        self._engine_lock = threading.RLock()  # held by this thread through each command and step
        self._ended = False  # `on_stop` has run: the engine is being closed, nothing may read it
        self._views = EngineViews.of(engine)  # the last published; replaced whole, never changed

    def submit(self, fn: Callable[[Engine], T]) -> Future[T]:
        """Queue `fn(engine)` to run between steps; its result (or error) arrives on the returned future."""
        future: Future[T] = Future()
        if threading.current_thread() is self and not self._stepping:
            with self._engine_lock:
                _run(fn, self.engine, future, self._publish)
            return future
        with self._accepting:
            if self._stopped:
                future.set_exception(EngineStopped("the model was unloaded"))
            else:
                self._commands.put((fn, future))
                self._queued += 1
        return future

    def call(self, fn: Callable[[Engine], T]) -> T | None:
        """Run `fn(engine)` on the engine thread between steps and return its result (or raise its error).

        Called on the engine thread itself in the middle of a step (a finaliser), it can only queue the
        call: running it now would re-enter the engine mid-step. Then it returns None.
        """
        if threading.current_thread() is self and self._stepping:
            self.post(fn)
            return None
        return self.submit(fn).result()

    def post(self, fn: Callable[[Engine], Any]) -> None:
        """Queue `fn(engine)` without waiting: safe from any thread, even from a finaliser mid-step.
        After the thread has stopped there is no engine left to act on, and the call is dropped."""
        with self._accepting:
            if not self._stopped:
                self._commands.put((fn, None))
                self._queued += 1

    def views(self) -> EngineViews:
        """The jobs and the cache without waiting for the step in progress: read now where the engine is
        between steps (or will be within VIEW_WAIT_S), else as published at the last command, the last step
        that ended a job, or at most VIEW_WAIT_S of short steps before the one in progress. A command queued
        before the view (a cancel asked for without waiting) shows in it: then the view waits its turn."""
        if threading.current_thread() is self and self._stepping:
            return self._views  # a finaliser mid-step: the engine's state is half-way through the step
        if not self._engine_lock.acquire(timeout=VIEW_WAIT_S):
            return self.call(EngineViews.of) if self._queued else self._views
        try:
            if self._ended:
                raise EngineStopped("the model was unloaded")
            if not self._queued:
                return self._publish()
        finally:
            self._engine_lock.release()
        # a command queued before this view, perhaps taken off the queue and not yet run: wait behind it
        return self.call(EngineViews.of)

    def _publish(self) -> EngineViews:
        self._views = EngineViews.of(self.engine)
        return self._views

    def stop(self) -> None:
        """Run every command already queued, then `on_stop`, then end. Later commands are refused."""
        with self._accepting:
            if not self._stopped:
                self._stopped = True
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
            with self._engine_lock:
                if command is _STOP:
                    self._on_stop(self.engine)
                    self._ended = True
                    return
                if command is not None:
                    fn, future = command
                    _run(fn, self.engine, future, self._publish)
                    with self._accepting:
                        self._queued -= 1
                    continue  # drain every waiting command before the next step
                self._step()

    def _step(self) -> None:
        """One step, its views published before anyone hears of its events (a consumer told that its job
        ended, then reading the job table, finds it gone)."""
        self._stepping = True
        try:
            events = self.engine.step()
        except JobFailed as failure:  # the engine named the jobs: only they fail
            self._publish_after_step()
            self._deliver(list(failure.events))
            self._on_job_failure(failure.job_ids, failure.cause)
            return
        except BaseException as error:  # noqa: BLE001 - reported to every consumer, thread lives on
            self._on_step_error(self.engine, error)
            self._publish_after_step()
            return
        finally:
            self._stepping = False
        if any(event.eos for event in events) or wall_clock() - self._views.at >= VIEW_WAIT_S:
            self._publish_after_step()
        if events:
            self._deliver(events)

    def _publish_after_step(self) -> None:
        """A view that fails after a step is reported and the last one kept: the thread must live on."""
        try:
            self._publish()
        except Exception:  # noqa: BLE001 - logged; a view read between steps raises it to its caller
            log.exception("exlnb: reading the engine's jobs and cache after a step failed")


def _run(fn: Callable[[Engine], Any], engine: Engine, future: Future | None, publish: Callable[[], Any]) -> None:
    """Run a command and publish the views it leaves before its caller hears the answer."""
    if future is not None and not future.set_running_or_notify_cancel():
        # the caller stopped waiting (a cancelled task): run the command all the same, since an enqueue must
        # meet the cancel its caller queued behind it, but nobody takes the answer
        future = None
    try:
        try:
            result = fn(engine)
        finally:
            publish()
    except BaseException as error:  # noqa: BLE001 - handed to the caller
        if future is None:
            log.exception("exlnb: a queued engine command failed")
        else:
            future.set_exception(error)
        return
    if future is not None:
        future.set_result(result)
