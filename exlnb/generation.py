"""A notebook's generation request: one prompt, rendered through a template (and a chat), sampled N times.

This is the plain Python behind `%%exl_generate`, with no display in it: `start()` renders the prompt once
(and lints it once), submits the jobs and consumes their streams on one background thread, so a widget can
watch without ever blocking the kernel's event loop. Listeners hear every event as it arrives. A
`Generation` owned by a cell cancels the one that cell started before, and `--loop-guard` cancels a sample
caught repeating itself (field report 1, cause B: small models loop until max_new_tokens).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field

from exlnb.analysis import Loop, find_tail_loop
from exlnb.chat import Chat, get_chat
from exlnb.engines.base import LOOP_DETECTOR, EosReason, JobSpec, Stage, StreamEvent, Tokenizer, wall_clock
from exlnb.request import GenerationRequest
from exlnb.session import Session, get_session
from exlnb.streaming import Delivered, GenerationResult, JobError, JobStream
from exlnb.templates import LintFinding, conversation, lint_rendered, render

LOOP_CHECK_EVERY = 8  # tokens between loop checks; find_tail_loop looks at the last 32

Listener = Callable[["Sample", StreamEvent], None]


@dataclass
class Sample:
    """One of a generation's N jobs, as far as it has got."""

    index: int
    stream: JobStream
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    events: list[StreamEvent] = field(default_factory=list)
    last: StreamEvent | None = None
    stopped_by: str | None = None  # "stop button", "interrupted", "loop guard", "re-run", ... when cancelled
    error: JobError | None = None  # why the sample failed (its last event then says EosReason.FAILED)
    loop: Loop | None = None

    @property
    def done(self) -> bool:
        return self.last is not None and self.last.eos

    @property
    def eos_reason(self) -> EosReason | None:
        return self.last.eos_reason if self.last else None

    def elapsed_s(self) -> float:
        if self.last is None or not self.last.time_enqueued:
            return 0.0
        end = self.last.time_produced if self.done else wall_clock()
        return end - self.last.time_enqueued

    def result(self) -> GenerationResult:
        error = None if self.error is None else str(self.error)
        return GenerationResult.from_events(self.stream.job_id, self.events, self.stream.constraint, error)


class Generation:
    """N samples of one prompt, consumed in the background on one thread; `wait()` for the results."""

    def __init__(self, session: Session, request: GenerationRequest, prompt: PreparedPrompt,
                 streams: list[JobStream], events: queue.SimpleQueue[Delivered]) -> None:
        self.session = session
        self.request = request
        self.prompt_text = prompt.text
        self.prompt_ids = prompt.ids
        self.prompt_findings = prompt.findings  # template mistakes in the prompt as the model gets it
        self.samples = [Sample(i, s) for i, s in enumerate(streams)]
        self.chat = prompt.chat
        self.loop_guard = request.loop_guard and not prompt.loop_guard_by_engine  # exlnb's own check, else none
        self._events = events
        self._listeners: list[Listener] = []
        self._followers: list[queue.Queue] = []  # follow()'s inboxes, told when the last sample ends
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._consume, name="exlnb-generation", daemon=True)

    # -- consumption (one thread for every sample) -------------------------------------------------------

    def _begin(self) -> None:
        self._thread.start()

    def _consume(self) -> None:
        by_job = {sample.stream.job_id: sample for sample in self.samples}
        running = len(self.samples)
        try:
            while running:
                item = self._events.get()
                sample = by_job[item.job_id]
                try:
                    event = sample.stream.receive(item)
                except JobError as error:
                    sample.error = error
                    event = (sample.last or _first_event(sample)).ended(EosReason.FAILED, wall_clock())
                self._receive(sample, event)
                running -= event.eos
        finally:
            self._finish()

    def _receive(self, sample: Sample, event: StreamEvent) -> None:
        with self._lock:
            sample.text += event.text
            sample.token_ids += event.token_ids
            sample.events.append(event)
            sample.last = event
            listeners = list(self._listeners)
        if self.loop_guard and not event.eos and _due_for_loop_check(sample, event):
            sample.loop = find_tail_loop(sample.token_ids)
            if sample.loop is not None:
                self._cancel_sample(sample, "loop guard", wait=False)
        for listener in listeners:
            listener(sample, event)

    def _finish(self) -> None:
        first = self.samples[0]
        if self.chat is not None and first.error is None:
            self.chat.add_turn(self.request.prompt, first.text)
        with self._lock:
            self._finished.set()
            for inbox in self._followers:
                inbox.put(None)

    # -- the caller's side ----------------------------------------------------------------------------

    def listen(self, listener: Listener) -> None:
        """Call `listener(sample, event)` on the consumer threads for every event from now on."""
        with self._lock:
            self._listeners.append(listener)

    def follow(self) -> Iterator[tuple[Sample, StreamEvent]]:
        """Every event from now on, on the calling thread, until all samples are done."""
        inbox: queue.Queue[tuple[Sample, StreamEvent] | None] = queue.Queue()
        with self._lock:
            self._listeners.append(lambda sample, event: inbox.put((sample, event)))
            self._followers.append(inbox)
            if self.done:
                inbox.put(None)
        while (item := inbox.get()) is not None:  # None: the last sample has ended
            yield item

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    def wait_done(self, timeout: float | None = None) -> bool:
        """Block until every sample has ended or `timeout` seconds pass; whether they have ended."""
        return self._finished.wait(timeout)

    def wait(self, timeout: float | None = None) -> list[GenerationResult]:
        """Block until every sample has ended; the results, one per sample."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the generation is still running after {timeout} s")
        return self.results

    @property
    def results(self) -> list[GenerationResult]:
        return [s.result() for s in self.samples]

    @property
    def texts(self) -> list[str]:
        return [s.text for s in self.samples]

    @property
    def errors(self) -> list[JobError]:
        """Why samples failed (empty when none did)."""
        return [s.error for s in self.samples if s.error is not None]

    def cancel(self, reason: str = "cancelled", *, wait: bool = True) -> int:
        """Cancel every sample still running; returns how many were.

        With `wait=False` the cancels are only queued: what a button handler or an event loop should do,
        since waiting means waiting for the engine's current step.
        """
        return sum(self._cancel_sample(s, reason, wait=wait) for s in self.samples)

    def _cancel_sample(self, sample: Sample, reason: str, *, wait: bool) -> bool:
        if sample.done:
            return False
        sample.stopped_by = sample.stopped_by or reason
        if wait:
            return sample.stream.cancel()
        sample.stream.request_cancel()
        return True

    def __repr__(self) -> str:
        state = "done" if self.done else "running"
        return f"<Generation of {len(self.samples)} sample(s), {len(self.prompt_ids)} prompt tokens: {state}>"


def _due_for_loop_check(sample: Sample, event: StreamEvent) -> bool:
    before = len(sample.token_ids) - len(event.token_ids)
    return len(sample.token_ids) // LOOP_CHECK_EVERY > before // LOOP_CHECK_EVERY


def _first_event(sample: Sample) -> StreamEvent:
    """What a sample that failed before its first event ends from."""
    now = wall_clock()
    return StreamEvent(job_id=sample.stream.job_id, stage=Stage.PENDING, time_produced=now, time_enqueued=now)


@dataclass(frozen=True)
class PreparedPrompt:
    """The prompt exactly as the model gets it, rendered and linted once."""

    text: str
    ids: list[int]
    findings: list[LintFinding]
    chat: Chat | None
    loop_guard_by_engine: bool = False  # the jobs carry the engine's own loop detector (`--loop-guard`)


_owned: dict[Hashable, Generation] = {}
_owned_lock = threading.Lock()


def start(
    request: GenerationRequest | str,
    *,
    owner: Hashable | None = None,
    session: Session | None = None,
    **options,
) -> Generation:
    """Render the request's prompt as a user turn (after its system prompt and the chat's earlier turns)
    and start its `n` samples; options are `GenerationRequest`'s when `request` is a plain prompt.

    Samples use seeds `seed`, `seed + 1`, ... A new generation with the same `owner` (a notebook cell)
    cancels the previous one.
    """
    request, session = as_request(request, options), session or get_session()
    prompt, specs = _prepare(request, session, owner)
    events: queue.SimpleQueue[Delivered] = queue.SimpleQueue()
    streams = session.submit_together(specs, shared=events)  # one step: the samples share the prompt's pages
    return _launch(session, request, prompt, streams, events, owner)


async def astart(
    request: GenerationRequest | str,
    *,
    owner: Hashable | None = None,
    session: Session | None = None,
    **options,
) -> Generation:
    """`start` for a coroutine (a notebook cell): the event loop runs on while the engine finishes its step."""
    request, session = as_request(request, options), session or get_session()
    prompt, specs = _prepare(request, session, owner)
    events: queue.SimpleQueue[Delivered] = queue.SimpleQueue()
    streams = await session.asubmit_together(specs, shared=events)
    return _launch(session, request, prompt, streams, events, owner)


def as_request(request: GenerationRequest | str, options: dict) -> GenerationRequest:
    """The entrance check: a request as given, or built from a prompt and options (unknown names refused)."""
    if isinstance(request, GenerationRequest):
        if options:
            return request.with_options(**options)
        return request
    return GenerationRequest.build(request, **options)


def _prepare(request: GenerationRequest, session: Session, owner: Hashable | None) -> tuple[PreparedPrompt, list[JobSpec]]:
    options = session.options
    if options is not None and request.n > options.max_batch_size:
        raise ValueError(
            f"n={request.n} is more than the engine decodes at once (max_batch_size {options.max_batch_size}): "
            "use fewer samples, or load with a larger max_batch_size"
        )
    tokenizer = session.tokenizer
    conv = _conversation_for(request)
    text = (conv.prompt(request.prompt, request.template, tokenizer) if conv
            else render(request.template, conversation(request.prompt, request.system), tokenizer))
    ids = tokenizer.encode(text, special=True)
    # a class attribute, read without the engine's thread: it never changes
    by_engine = request.loop_guard and session.engine.loop_guard_by_engine
    prompt = PreparedPrompt(text, ids, lint_rendered(ids, request.template, tokenizer), conv, by_engine)
    stops = [_stop_as_id(s, tokenizer) for s in request.stop]
    specs = [
        session.job_spec(
            ids, max_new_tokens=request.max_new_tokens, sampler=request.sampler, stop=stops,
            seed=None if request.seed is None else request.seed + i,
            identifier=f"sample {i}" if request.n > 1 else None,
            min_new_tokens=request.min_new_tokens, banned_strings=request.banned_strings, top_tokens=request.tokens,
            json_schema=request.json_schema, regex=request.regex, stop_on_loop=LOOP_DETECTOR if by_engine else None,
        )
        for i in range(request.n)
    ]
    if owner is not None:
        with _owned_lock:
            previous = _owned.pop(owner, None)
        if previous is not None:
            previous.cancel("re-run", wait=False)
    return prompt, specs


def _launch(session: Session, request: GenerationRequest, prompt: PreparedPrompt, streams: list[JobStream],
            events: queue.SimpleQueue[Delivered], owner: Hashable | None) -> Generation:
    try:  # a Ctrl-C anywhere in here leaves no job behind
        generation = Generation(session, request, prompt, streams, events)
        if owner is not None:
            with _owned_lock:
                _owned[owner] = generation
        generation._begin()
    except BaseException:
        for stream in streams:
            stream.request_cancel()
        raise
    return generation


def _conversation_for(request: GenerationRequest) -> Chat | None:
    if request.chat is None:
        return None
    conv = get_chat(request.chat)
    if request.system is not None:
        conv.system = request.system
    if request.amnesia:
        conv.clear()
    return conv


def _stop_as_id(stop: str | int, tokenizer: Tokenizer) -> str | int:
    """A stop string that is a special token (e.g. "<|im_end|>") stops on its id: it is never decoded as text."""
    if isinstance(stop, str) and stop in tokenizer.special_tokens():
        return tokenizer.special_tokens()[stop]
    return stop
