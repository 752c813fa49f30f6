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
from exlnb.branching import check_still_loaded, plan_branch
from exlnb.engines.base import LOOP_DETECTOR, EosReason, JobSpec, StreamEvent, wall_clock
from exlnb.engines.options import EngineOptions
from exlnb.engines.token_info import TokenInfo
from exlnb.near_ties import NoiseFloor
from exlnb.noise_floor import measured_floor
from exlnb.prepared_prompt import PreparedPrompt, prepare_prompt
from exlnb.request import GenerationRequest, takes_request_options
from exlnb.session import Session, get_session
from exlnb.streaming import Delivered, GenerationResult, JobError, JobStream, reading

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
    lineage: Lineage | None = None  # what ran it, which its result keeps so that it can branch

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
        return GenerationResult.from_events(
            self.stream.job_id, self.events, self.stream.constraint, error, self.lineage
        )


@dataclass(frozen=True)
class Lineage:
    """A result's `origin`: the request and prompt that ran it and, for a branch, its parent, the position and the
    token forced there. Every result of one answer's tree shares `family`, its branches in the order they ran."""

    session: Session = field(repr=False)
    request: GenerationRequest
    prompt_ids: tuple[int, ...]  # what the result's first token follows
    seed: int | None  # the sample's own
    model: EngineOptions | None  # what was loaded when it ran
    parent: GenerationResult | None = field(default=None, repr=False)
    at: int | None = None  # the position in the parent's tokens where the branch left it
    lead: tuple[int, ...] = ()  # the forced token
    lead_text: str = ""
    lead_info: tuple[TokenInfo, ...] = ()  # its record, where the parent recorded its alternatives there
    kept_text: str = ""  # the parent's tokens before `at`, as text
    replaced_text: str = ""  # the parent's token at `at`, which the forced token replaced
    family: list[GenerationResult] = field(default_factory=list, repr=False, compare=False)

    def branch(self, result: GenerationResult, at: int, token: int | str | None) -> GenerationResult:
        generation = start_branch(result, at=at, token=token)
        generation.wait()
        if generation.errors:
            raise generation.errors[0]
        return branch_result(generation)

    def noise_floor(self) -> NoiseFloor:
        """The noise floor of the model that ran this, measured once (`exlnb.noise_floor.measured_floor`)."""
        self.check_loaded("measure its engine's noise floor")
        return measured_floor(self.session)

    def check_loaded(self, to: str) -> None:
        """Refuse, in one line, to act on a result whose model is no longer the one loaded."""
        session = self.session
        if session.options != self.model:
            now = (
                "nothing" if session.options is None else f"{session.options.model_dir.name} ({session.options.engine})"
            )
            raise ValueError(
                f"this result ran on {self.model.model_dir.name} ({self.model.engine}), but {now} is loaded now: "
                f"load that model again to {to}"
            )


class Generation:
    """N samples of one prompt, consumed in the background on one thread; `wait()` for the results."""

    def __init__(
        self,
        session: Session,
        request: GenerationRequest,
        prompt: PreparedPrompt,
        streams: list[JobStream],
        events: queue.SimpleQueue[Delivered],
        lineages: list[Lineage],
    ) -> None:
        self.session = session
        self.request = request
        self.prompt_text = prompt.text
        self.prompt_ids = prompt.ids
        self.prompt_findings = prompt.findings  # template mistakes in the prompt as the model gets it
        self.branch_refusal = session.engine.branch_refusal  # why its answers cannot branch here, if they cannot
        self.samples = [Sample(i, s, lineage=lineage) for i, (s, lineage) in enumerate(zip(streams, lineages))]
        for sample in self.samples:  # a branch's view starts with its forced token
            sample.text, sample.token_ids = sample.lineage.lead_text, list(sample.lineage.lead)
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
        with reading([sample.stream for sample in self.samples]):  # the job table: these streams are read
            self._consume_all()

    def _consume_all(self) -> None:
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
                    event = sample.stream.failed_end()
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


_owned: dict[Hashable, Generation] = {}
_owned_lock = threading.Lock()


@takes_request_options
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


@takes_request_options
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


def _prepare(
    request: GenerationRequest, session: Session, owner: Hashable | None
) -> tuple[PreparedPrompt, list[JobSpec]]:
    options = session.options
    if options is not None and request.n > options.max_batch_size:
        raise ValueError(
            f"n={request.n} is more than the engine decodes at once (max_batch_size {options.max_batch_size}): "
            "use fewer samples, or load with a larger max_batch_size"
        )
    prompt = prepare_prompt(request, session)
    stop_on_loop = LOOP_DETECTOR if prompt.loop_guard_by_engine else None
    specs = request.job_specs(prompt.ids, session.tokenizer, stop_on_loop=stop_on_loop)
    if owner is not None:
        with _owned_lock:
            previous = _owned.pop(owner, None)
        if previous is not None:
            previous.cancel("re-run", wait=False)
    return prompt, specs


def _launch(
    session: Session,
    request: GenerationRequest,
    prompt: PreparedPrompt,
    streams: list[JobStream],
    events: queue.SimpleQueue[Delivered],
    owner: Hashable | None,
    lineages: list[Lineage] | None = None,
) -> Generation:
    if lineages is None:
        lineages = [
            Lineage(
                session, request, tuple(prompt.ids), None if request.seed is None else request.seed + i, session.options
            )
            for i in range(len(streams))
        ]
    try:  # a Ctrl-C anywhere in here leaves no job behind
        generation = Generation(session, request, prompt, streams, events, lineages)
        if owner is not None:
            with _owned_lock:
                _owned[owner] = generation
        generation._begin()
    except BaseException:
        for stream in streams:
            stream.request_cancel()
        raise
    return generation


def start_branch(
    result: GenerationResult, *, at: int, token: int | str | None = None, owner: Hashable | None = None
) -> Generation:
    """Start `result`'s branch at `at` (`GenerationResult.branch`) as a one-sample `Generation`, to watch."""
    session, plan, prompt, specs, child = _prepare_branch(result, at, token)
    events: queue.SimpleQueue[Delivered] = queue.SimpleQueue()
    streams = session.submit_together(specs, shared=events)
    return _launch(session, plan.request, prompt, streams, events, owner, [child])


async def astart_branch(
    result: GenerationResult, *, at: int, token: int | str | None = None, owner: Hashable | None = None
) -> Generation:
    """`start_branch` for a coroutine: the event loop runs on while the engine finishes its step."""
    session, plan, prompt, specs, child = _prepare_branch(result, at, token)
    events: queue.SimpleQueue[Delivered] = queue.SimpleQueue()
    streams = await session.asubmit_together(specs, shared=events)
    return _launch(session, plan.request, prompt, streams, events, owner, [child])


def _prepare_branch(result: GenerationResult, at: int, token: int | str | None) -> tuple:
    lineage = result.origin
    if not isinstance(lineage, Lineage):
        raise ValueError(
            f"job {result.job_id}'s result does not keep its request: only results of a generation "
            "(exlnb.generate_live, %%exl_generate --out) can branch"
        )
    session = lineage.session
    check_still_loaded(result.job_id, lineage.model, session.options)
    if session.engine.branch_refusal is not None:
        raise ValueError(session.engine.branch_refusal)
    plan = plan_branch(
        result,
        at,
        token,
        request=lineage.request,
        prompt_ids=lineage.prompt_ids,
        lead=lineage.lead,
        seed=lineage.seed,
        tokenizer=session.tokenizer,
    )
    by_engine = plan.request.loop_guard and session.engine.loop_guard_by_engine
    prompt = PreparedPrompt(session.tokenizer.decode(plan.input_ids), list(plan.input_ids), [], None, by_engine)
    specs = plan.request.job_specs(plan.input_ids, session.tokenizer, stop_on_loop=LOOP_DETECTOR if by_engine else None)
    child = Lineage(
        session,
        plan.request,
        plan.prefix,
        plan.request.seed,
        session.options,
        parent=result,
        at=at,
        lead=(plan.forced,),
        lead_text=plan.forced_text,
        lead_info=(plan.forced_info,) if plan.forced_info else (),
        kept_text=plan.kept_text,
        replaced_text=plan.replaced_text,
        family=lineage.family,
    )
    return session, plan, prompt, specs, child


def branch_result(generation: Generation) -> GenerationResult:
    """A finished branch's result, recorded in its tree's family."""
    result = generation.samples[0].result()
    result.origin.family.append(result)
    return result
