"""Delivering one job's events to whoever consumes them, from the generator thread, through a queue.

Field report 3: nesting async iteration lets results pile up and arrive in bursts. Here the producer
(the session's generator thread) only ever puts events on a queue; a sync consumer blocks on a
`queue.Queue`, an async consumer awaits an `asyncio.Queue` fed with `call_soon_threadsafe`. Either way
an event is deliverable the moment it is produced.

Field report 1: a job nobody consumes any more must not keep running. A stream cancels its job when the
consumer stops early (break, exception, KeyboardInterrupt, task cancellation) and when the stream object
itself is garbage-collected.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from exlnb.engines.base import EosReason, StreamEvent


@dataclass(frozen=True)
class GenerationResult:
    """Everything a finished (or cancelled) job produced, for `--out VAR` and the experiments."""

    job_id: int
    text: str
    token_ids: tuple[int, ...]
    eos_reason: EosReason | None
    prompt_tokens: int
    cached_tokens: int
    new_tokens: int
    time_to_first_token_s: float | None
    prefill_tokens_per_s: float | None
    decode_tokens_per_s: float | None
    elapsed_s: float  # submit -> last event

    @classmethod
    def from_events(cls, job_id: int, events: list[StreamEvent]) -> GenerationResult:
        last = events[-1] if events else None
        return cls(
            job_id=job_id,
            text="".join(e.text for e in events),
            token_ids=tuple(t for e in events for t in e.token_ids),
            eos_reason=last.eos_reason if last else None,
            prompt_tokens=last.prompt_tokens if last else 0,
            cached_tokens=last.cached_tokens if last else 0,
            new_tokens=last.new_tokens if last else 0,
            time_to_first_token_s=last.time_to_first_token_s if last else None,
            prefill_tokens_per_s=last.prefill_tokens_per_s if last else None,
            decode_tokens_per_s=last.decode_tokens_per_s if last else None,
            elapsed_s=(last.time_produced - last.time_enqueued) if last else 0.0,
        )


class EventInbox:
    """The producer's end of one job's stream. Lives in the session, not in the consumer's hands."""

    def __init__(self) -> None:
        self._sync: queue.Queue[StreamEvent | BaseException] = queue.Queue()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async: asyncio.Queue[StreamEvent | BaseException] | None = None
        self.consuming = False  # a consumer is iterating right now
        self.finished = False

    def put(self, event: StreamEvent | BaseException) -> None:
        """Deliver an event, or an engine error that the consumer will raise."""
        with self._lock:
            if isinstance(event, BaseException) or event.eos:
                self.finished = True
            if self._loop is None:
                self._sync.put(event)
                return
            loop, target = self._loop, self._async
        try:
            loop.call_soon_threadsafe(target.put_nowait, event)
        except RuntimeError:  # the consumer's loop is closed: nobody will read this
            pass

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> asyncio.Queue[StreamEvent | BaseException]:
        """Switch delivery to `loop`, moving over anything already produced."""
        with self._lock:
            if self._loop is not None and self._loop is not loop:
                raise RuntimeError("this stream is already consumed from another event loop")
            if self._async is None:
                self._loop, self._async = loop, asyncio.Queue()
                while not self._sync.empty():
                    self._async.put_nowait(self._sync.get_nowait())
            return self._async

    def get(self, timeout: float | None) -> StreamEvent | BaseException:
        return self._sync.get(timeout=timeout)


class JobStream:
    """The consumer's handle on one job: iterate it (sync or async), or ask for its result.

    Iterating yields `StreamEvent`s until the job ends. Leaving the loop early cancels the job. So does
    dropping the last reference to the stream, unless the job was submitted with
    `cancel_when_abandoned=False` (used to reproduce field report 1 on purpose).
    """

    def __init__(
        self,
        job_id: int,
        inbox: EventInbox,
        cancel: Callable[[int], bool],
        request_cancel: Callable[[int], None],
        cancel_when_abandoned: bool = True,
    ) -> None:
        self.job_id = job_id
        self._inbox = inbox
        self._cancel = cancel
        self._events: list[StreamEvent] = []
        self.cancel_when_abandoned = cancel_when_abandoned
        if cancel_when_abandoned:
            # a finaliser must not block (it may run on the engine thread itself), so it only asks
            weakref.finalize(self, _cancel_unless_finished, inbox, request_cancel, job_id)

    @property
    def done(self) -> bool:
        return bool(self._events) and self._events[-1].eos

    @property
    def events(self) -> list[StreamEvent]:
        """Events received so far."""
        return list(self._events)

    def cancel(self) -> bool:
        """Stop the job now; its cache pages are freed at once."""
        return self._cancel(self.job_id)

    def _receive(self, item: StreamEvent | BaseException) -> StreamEvent:
        if isinstance(item, BaseException):
            raise RuntimeError(f"the engine failed while running job {self.job_id}") from item
        self._events.append(item)
        return item

    def __iter__(self) -> Iterator[StreamEvent]:
        if self.done:
            return
        self._inbox.consuming = True
        try:
            while True:
                event = self._receive(self._inbox.get(timeout=None))
                yield event
                if event.eos:
                    return
        finally:
            self._inbox.consuming = False
            if not self.done and self.cancel_when_abandoned:
                self.cancel()

    async def __aiter__(self) -> AsyncIterator[StreamEvent]:
        if self.done:
            return
        inbox = self._inbox.attach_loop(asyncio.get_running_loop())
        self._inbox.consuming = True
        try:
            while True:
                event = self._receive(await inbox.get())
                yield event
                if event.eos:
                    return
        finally:
            self._inbox.consuming = False
            if not self.done and self.cancel_when_abandoned:
                self.cancel()

    def result(self) -> GenerationResult:
        """Consume the rest of the stream and return the whole result."""
        for _ in self:
            pass
        return GenerationResult.from_events(self.job_id, self._events)

    async def aresult(self) -> GenerationResult:
        async for _ in self:
            pass
        return GenerationResult.from_events(self.job_id, self._events)

    def text(self) -> str:
        return self.result().text

    def __repr__(self) -> str:
        state = "done" if self.done else f"{len(self._events)} events so far"
        return f"<JobStream job {self.job_id}: {state}>"


def _cancel_unless_finished(inbox: EventInbox, request_cancel: Callable[[int], None], job_id: int) -> None:
    if not inbox.finished:
        request_cancel(job_id)
