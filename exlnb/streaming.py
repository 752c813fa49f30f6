"""Delivering each job's events from the engine thread to whoever consumes them, through queues.

Field report 3: nesting async iteration lets results pile up and arrive in bursts. Here the producer (the
session's engine thread) only ever puts events on a queue; a sync consumer blocks on a `queue.Queue`, an
async consumer awaits an `asyncio.Queue` fed with `call_soon_threadsafe`. Either way an event is
deliverable the moment it is produced.

Field report 1: a job nobody consumes any more must not keep running. A stream cancels its job when the
consumer stops early (break, exception, KeyboardInterrupt, task cancellation) and when the stream object
itself is garbage-collected.

Every stream ends: with its last event, or with an error (the job failed, the model was unloaded). The
`Deliveries` table is the one place that knows which streams are still open.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Protocol

from exlnb.engines.base import EosReason, Stage, StreamEvent, wall_clock
from exlnb.engines.constraint import OutputConstraint
from exlnb.engines.token_info import TokenInfo
from exlnb.near_ties import NoiseFloor, floor_value, margin_frame
from exlnb.token_records import TokenRecord, token_frame, token_records


class JobError(RuntimeError):
    """A job ended with an error instead of a result; the session and every other job carry on."""


class ModelUnloaded(JobError):
    """The model was unloaded (or replaced) while the job ran."""


@dataclass(frozen=True)
class StreamFailure:
    """What a stream receives instead of an event when its job fails."""

    job_id: int
    error: JobError


Delivered = StreamEvent | StreamFailure


class Origin(Protocol):
    """What ran a result, kept by the generation layer, which can run it again from any of its tokens
    (`GenerationResult.branch`); this layer only asks it."""

    lead: tuple[int, ...]  # tokens the result starts with that its job was given, not generated (a forced token)
    lead_text: str
    lead_info: tuple[TokenInfo, ...]  # their records, where known

    def branch(self, result: GenerationResult, at: int, token: int | str | None) -> GenerationResult: ...

    def noise_floor(self) -> NoiseFloor: ...  # the engine's, measured once per loaded model (exlnb.noise_floor)


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
    token_records: tuple[TokenRecord, ...] = ()  # per token, when the job asked for top_tokens
    constraint: OutputConstraint | None = field(default=None, repr=False)  # the job's json_schema or regex
    error: str | None = None  # why the job failed, in one line, where eos_reason is FAILED
    origin: Origin | None = field(default=None, repr=False, compare=False)  # its request and prompt, for `branch`

    def branch(self, at: int, token: int | str | None = None) -> GenerationResult:
        """Run again from the prompt and this result's first `at` tokens, with `token` (an id, or the text of one
        token; default: the likeliest alternative the token view recorded at `at`) in place of token `at`, then on
        with the same settings; the prompt's cached pages are reused. The branch's text starts with `token`."""
        if self.origin is None:
            raise ValueError(
                f"job {self.job_id}'s result does not keep its request: only results of a generation "
                "(exlnb.generate_live, %%exl_generate --out) can branch"
            )
        return self.origin.branch(self, at, token)

    def tokens(self):
        """One row per generated token: probability, alternatives, arrival and latency (a pandas DataFrame)."""
        return token_frame(self.token_records)

    def margins(self, floor: float | NoiseFloor | None = None):
        """One row per generated token: its margin (the top logit minus the runner-up's, nats; exlnb.near_ties), the
        runner-up, and with a `floor`, whether the margin is at or under it (`likely_flip`). A pandas DataFrame."""
        return margin_frame(self.token_records, None if floor is None else floor_value(floor))

    def near_ties(self, floor: float | NoiseFloor | None = None):
        """The positions likely to flip: those whose margin is at or under the engine's noise floor (default: the
        floor measured once for the model that ran this, `exlnb.noise_floor`), as `margins()` rows."""
        if floor is None:
            if self.origin is None:
                raise ValueError(
                    f"job {self.job_id}'s result does not keep the session that ran it: pass floor= (a NoiseFloor from "
                    "exlnb.noise_floor.noise_floor(session), or nats)"
                )
            floor = self.origin.noise_floor()
        frame = self.margins(floor)
        return frame[frame.likely_flip].reset_index(drop=True)

    @property
    def parsed(self):
        """The answer read by its constraint: the JSON value (dict, list, ...) for a JSON schema, an instance of
        the pydantic model when one was given, the `re.Match` of the whole text for a regex; None without a
        constraint. ValueError when the answer does not satisfy it: it ended before its constraint did."""
        if self.constraint is None:
            return None
        try:
            return self.constraint.parse(self.text)
        except ValueError as error:
            ended = self.eos_reason.words if self.eos_reason else "no event"
            first = str(error).splitlines()[0]
            raise ValueError(
                f"job {self.job_id}'s answer does not satisfy its {self.constraint.describe()} "
                f"(it ended: {ended}): {first}"
            ) from None

    @classmethod
    def from_events(
        cls,
        job_id: int,
        events: list[StreamEvent],
        constraint: OutputConstraint | None = None,
        error: str | None = None,
        origin: Origin | None = None,
    ) -> GenerationResult:
        last = events[-1] if events else None
        lead, lead_text, lead_info = (origin.lead, origin.lead_text, origin.lead_info) if origin else ((), "", ())
        return cls(
            job_id=job_id,
            text=lead_text + "".join(e.text for e in events),
            token_ids=lead + tuple(t for e in events for t in e.token_ids),
            eos_reason=last.eos_reason if last else None,
            prompt_tokens=last.prompt_tokens if last else 0,
            cached_tokens=last.cached_tokens if last else 0,
            new_tokens=len(lead) + (last.new_tokens if last else 0),
            time_to_first_token_s=last.time_to_first_token_s if last else None,
            prefill_tokens_per_s=last.prefill_tokens_per_s if last else None,
            decode_tokens_per_s=last.decode_tokens_per_s if last else None,
            elapsed_s=(last.time_produced - last.time_enqueued) if last else 0.0,
            # a given token's record says it was given; the generated ones keep their places in token_ids
            token_records=tuple(TokenRecord(i, info, 0.0, 0.0, forced=True) for i, info in enumerate(lead_info))
            + tuple(replace(r, position=r.position + len(lead)) for r in token_records(events)),
            constraint=constraint,
            error=error,
            origin=origin,
        )


class EventInbox:
    """The producer's end of one job's stream. Lives in the session's `Deliveries`, not in the consumer's hands.

    With `shared`, events go to a queue that several inboxes feed (one consumer thread for all the samples
    of a generation, rather than a thread each).
    """

    def __init__(self, shared: queue.SimpleQueue[Delivered] | None = None) -> None:
        self._sync: queue.SimpleQueue[Delivered] = shared if shared is not None else queue.SimpleQueue()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async: asyncio.Queue[Delivered] | None = None
        self.consuming = False  # a consumer is taking its events right now (`reading`)
        self.finished = False

    def put(self, item: Delivered) -> None:
        with self._lock:
            if isinstance(item, StreamFailure) or item.eos:
                self.finished = True
            if self._loop is None:
                self._sync.put(item)
                return
            loop, target = self._loop, self._async
        try:
            loop.call_soon_threadsafe(target.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody will read this
            pass

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> asyncio.Queue[Delivered]:
        """Switch delivery to `loop`, moving over anything already produced."""
        with self._lock:
            if self._loop is not None and self._loop is not loop:
                raise RuntimeError("this stream is already consumed from another event loop")
            if self._async is None:
                self._loop, self._async = loop, asyncio.Queue()
                while not self._sync.empty():
                    self._async.put_nowait(self._sync.get_nowait())
            return self._async

    def get(self) -> Delivered:
        return self._sync.get()


ENDED_KEPT = 1024  # the latest jobs' last events kept after they end, for views that settle into their record


class Deliveries:
    """Which inbox receives each open job's events, each job's last event, and which jobs may run unread.

    Written by the engine thread (`deliver`, `fail`) and read by any thread (`consumed`, `detached`, `ended`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inboxes: dict[int, EventInbox] = {}
        self._last: dict[int, StreamEvent] = {}
        self._ended: OrderedDict[int, StreamEvent] = OrderedDict()
        self._detached: set[int] = set()

    def register(self, job_id: int, inbox: EventInbox, *, detached: bool) -> None:
        with self._lock:
            self._inboxes[job_id] = inbox
            if detached:
                self._detached.add(job_id)

    def deliver(self, events: Iterable[StreamEvent]) -> None:
        with self._lock:
            for event in events:
                inbox = self._inboxes.get(event.job_id)
                if event.eos:
                    self._close(event.job_id)
                    self._ended[event.job_id] = event
                    if len(self._ended) > ENDED_KEPT:
                        self._ended.popitem(last=False)
                else:
                    self._last[event.job_id] = event
                if inbox is not None:
                    inbox.put(event)

    def end(self, job_id: int, reason: EosReason) -> None:
        """End a job's stream from outside the engine (cancelled): a last event with its counts so far."""
        with self._lock:
            last = self._last.get(job_id)
        now = wall_clock()
        final = (
            last.ended(reason, now)
            if last
            else StreamEvent(
                job_id=job_id, stage=Stage.DONE, time_produced=now, eos=True, eos_reason=reason, time_enqueued=now
            )
        )
        self.deliver([final])

    def fail(self, job_ids: Iterable[int], error: JobError) -> None:
        """End these jobs' streams with `error`."""
        with self._lock:
            inboxes = [(job_id, self._inboxes.get(job_id)) for job_id in job_ids]
            for job_id, _ in inboxes:
                self._close(job_id)
        for job_id, inbox in inboxes:
            if inbox is not None:
                inbox.put(StreamFailure(job_id, error))

    def fail_all(self, error_for: Callable[[int], JobError]) -> None:
        """End every open stream with an error made for its job."""
        with self._lock:
            open_jobs = list(self._inboxes)
        for job_id in open_jobs:
            self.fail([job_id], error_for(job_id))

    def open_inboxes(self, owned: Iterable[EventInbox]) -> list[int]:
        """The open jobs whose inbox is one of `owned`."""
        mine = {id(inbox) for inbox in owned}
        with self._lock:
            return [job_id for job_id, inbox in self._inboxes.items() if id(inbox) in mine]

    def consumed(self, job_id: int) -> bool:
        with self._lock:
            inbox = self._inboxes.get(job_id)
        return inbox is not None and inbox.consuming

    def detached(self, job_id: int) -> bool:
        with self._lock:
            return job_id in self._detached

    def ended(self, job_id: int) -> StreamEvent | None:
        """The last event of a job that has ended lately (one of the latest ENDED_KEPT), else None."""
        with self._lock:
            return self._ended.get(job_id)

    def new_tokens(self, job_id: int) -> int:
        with self._lock:
            last = self._last.get(job_id)
        return last.new_tokens if last else 0

    def _close(self, job_id: int) -> None:
        self._inboxes.pop(job_id, None)
        self._last.pop(job_id, None)
        self._detached.discard(job_id)


class JobStream:
    """The consumer's handle on one job: iterate it (sync or async), or ask for its result.

    Iterating yields `StreamEvent`s until the job ends, or raises `JobError` if it fails. Leaving the loop
    early cancels the job. So does dropping the last reference to the stream, unless the job was submitted
    with `cancel_when_abandoned=False` (used to reproduce field report 1 on purpose).
    """

    def __init__(
        self,
        job_id: int,
        inbox: EventInbox,
        cancel: Callable[[int], bool],
        request_cancel: Callable[[int], None],
        cancel_when_abandoned: bool = True,
        constraint: OutputConstraint | None = None,
    ) -> None:
        self.job_id = job_id
        self.constraint = constraint  # what its result's `parsed` reads the answer with
        self._inbox = inbox
        self._cancel = cancel
        self._request_cancel = request_cancel
        self._events: list[StreamEvent] = []
        self.error: JobError | None = None
        self.cancel_when_abandoned = cancel_when_abandoned
        if cancel_when_abandoned:
            # a finaliser must not block (it may run on the engine thread itself), so it only asks
            weakref.finalize(self, _cancel_unless_finished, inbox, request_cancel, job_id)

    @property
    def done(self) -> bool:
        return self.error is not None or (bool(self._events) and self._events[-1].eos)

    @property
    def events(self) -> list[StreamEvent]:
        """Events received so far."""
        return list(self._events)

    def cancel(self) -> bool:
        """Stop the job now; its cache pages are free when this returns. False if it had already ended."""
        # an ended stream's id may belong to a job of a model loaded since: never cancel by a stale id
        return not self._inbox.finished and self._cancel(self.job_id)

    def request_cancel(self) -> None:
        """Ask for the job to stop without waiting for the engine's current step (safe on an event loop)."""
        if not self._inbox.finished:
            self._request_cancel(self.job_id)

    def failed_end(self) -> StreamEvent:
        """The last event of a job that failed: its counts and timings so far (none before its first event)."""
        now = wall_clock()
        last = (
            self._events[-1]
            if self._events
            else StreamEvent(job_id=self.job_id, stage=Stage.PENDING, time_produced=now, time_enqueued=now)
        )
        return last.ended(EosReason.FAILED, now)

    def receive(self, item: Delivered) -> StreamEvent:
        """Record one delivered item; raises the job's error if it failed."""
        if isinstance(item, StreamFailure):
            self.error = item.error
            raise item.error
        self._events.append(item)
        return item

    def __iter__(self) -> Iterator[StreamEvent]:
        if self.done:
            self._raise_error()
            return
        try:
            with reading([self]):
                while True:
                    event = self.receive(self._inbox.get())
                    yield event
                    if event.eos:
                        return
        finally:
            if not self.done and self.cancel_when_abandoned:
                self.cancel()

    async def __aiter__(self) -> AsyncIterator[StreamEvent]:
        if self.done:
            self._raise_error()
            return
        inbox = self._inbox.attach_loop(asyncio.get_running_loop())
        try:
            with reading([self]):
                while True:
                    event = self.receive(await inbox.get())
                    yield event
                    if event.eos:
                        return
        finally:
            if not self.done and self.cancel_when_abandoned:
                self.request_cancel()  # never wait for an engine step on the event loop

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def result(self) -> GenerationResult:
        """Consume the rest of the stream and return the whole result."""
        for _ in self:
            pass
        self._raise_error()
        return GenerationResult.from_events(self.job_id, self._events, self.constraint)

    async def aresult(self) -> GenerationResult:
        async for _ in self:
            pass
        self._raise_error()
        return GenerationResult.from_events(self.job_id, self._events, self.constraint)

    def text(self) -> str:
        return self.result().text

    def __repr__(self) -> str:
        state = "failed" if self.error else "done" if self.done else f"{len(self._events)} events so far"
        return f"<JobStream job {self.job_id}: {state}>"


@contextmanager
def reading(streams: Sequence[JobStream]) -> Iterator[None]:
    """These streams count as read while the block runs: a consumer takes their events (iterating one stream,
    or one thread reading the shared queue of a generation's samples). The job table marks a job that nobody
    reads, and that mark must catch a leaked job (field report 1), not every job a widget streams."""
    inboxes = [stream._inbox for stream in streams]
    for inbox in inboxes:
        inbox.consuming = True
    try:
        yield
    finally:
        for inbox in inboxes:
            inbox.consuming = False


def _cancel_unless_finished(inbox: EventInbox, request_cancel: Callable[[int], None], job_id: int) -> None:
    if not inbox.finished:
        request_cancel(job_id)
