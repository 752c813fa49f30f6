"""A notebook's generation request: one prompt, rendered through a template (and a chat), sampled N times.

This is the plain Python behind `%%exl_generate`, with no display in it: `start()` renders the prompt,
submits the jobs and consumes each stream on its own thread, so a widget can watch without ever blocking
the kernel's event loop. Listeners hear every event as it arrives. A `Generation` owned by a cell cancels
the one that cell started before, and `--loop-guard` cancels a sample caught repeating itself (field
report 1, cause B: small models loop until max_new_tokens).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field

from exlnb.analysis import Loop, find_tail_loop
from exlnb.chat import Chat, get_chat
from exlnb.engines.base import EosReason, SamplerSettings, StreamEvent, Tokenizer, wall_clock
from exlnb.session import Session, get_session
from exlnb.streaming import GenerationResult, JobStream
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
    last: StreamEvent | None = None
    stopped_by: str | None = None  # "stop button", "interrupted", "loop guard", "re-run", ... when cancelled
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
        return GenerationResult.from_events(self.stream.job_id, self.stream.events)


class Generation:
    """N samples of one prompt, consumed in the background; `wait()` for the results."""

    def __init__(self, session: Session, prompt_text: str, prompt_ids: list[int], streams: list[JobStream],
                 *, user_turn: str | None = None, chat: Chat | None = None, loop_guard: bool = False,
                 prompt_findings: Sequence[LintFinding] = ()) -> None:
        self.session = session
        self.prompt_text = prompt_text
        self.prompt_ids = prompt_ids
        self.prompt_findings = list(prompt_findings)  # template mistakes in the prompt as the model gets it
        self.samples = [Sample(i, s) for i, s in enumerate(streams)]
        self.chat = chat
        self.loop_guard = loop_guard
        self._user_turn = user_turn
        self._listeners: list[Listener] = []
        self._followers: list[queue.Queue] = []  # follow()'s inboxes, told when the last sample ends
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._running = len(streams)
        self._threads = [
            threading.Thread(target=self._consume, args=(sample,), name=f"exlnb-job-{sample.stream.job_id}", daemon=True)
            for sample in self.samples
        ]

    # -- consumption (one thread per sample) ----------------------------------------------------------

    def _begin(self) -> None:
        for thread in self._threads:
            thread.start()

    def _consume(self, sample: Sample) -> None:
        try:
            for event in sample.stream:
                self._receive(sample, event)
        finally:
            with self._lock:
                self._running -= 1
                last = self._running == 0
            if last:
                self._finish()

    def _receive(self, sample: Sample, event: StreamEvent) -> None:
        with self._lock:
            sample.text += event.text
            sample.token_ids += event.token_ids
            sample.last = event
            listeners = list(self._listeners)
        if self.loop_guard and not event.eos and _due_for_loop_check(sample, event):
            sample.loop = find_tail_loop(sample.token_ids)
            if sample.loop is not None:
                self._cancel_sample(sample, "loop guard")
        for listener in listeners:
            listener(sample, event)

    def _finish(self) -> None:
        if self.chat is not None and self._user_turn is not None:
            self.chat.add_turn(self._user_turn, self.samples[0].text)
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

    def cancel(self, reason: str = "cancelled") -> int:
        """Cancel every sample still running; returns how many were."""
        return sum(self._cancel_sample(s, reason) for s in self.samples)

    def _cancel_sample(self, sample: Sample, reason: str) -> bool:
        if sample.done:
            return False
        sample.stopped_by = sample.stopped_by or reason
        return sample.stream.cancel()

    def __repr__(self) -> str:
        state = "done" if self.done else "running"
        return f"<Generation of {len(self.samples)} sample(s), {len(self.prompt_ids)} prompt tokens: {state}>"


def _due_for_loop_check(sample: Sample, event: StreamEvent) -> bool:
    before = len(sample.token_ids) - len(event.token_ids)
    return len(sample.token_ids) // LOOP_CHECK_EVERY > before // LOOP_CHECK_EVERY


_owned: dict[Hashable, Generation] = {}
_owned_lock = threading.Lock()


def start(
    prompt: str,
    *,
    system: str | None = None,
    template: str = "auto",
    chat: str | None = None,
    amnesia: bool = False,
    n: int = 1,
    max_new_tokens: int = 256,
    sampler: SamplerSettings | None = None,
    stop: Sequence[str | int] = (),
    seed: int | None = None,
    loop_guard: bool = False,
    owner: Hashable | None = None,
    session: Session | None = None,
    **sampler_overrides: float,
) -> Generation:
    """Render `prompt` as a user turn (after `system` and the chat's earlier turns) and start `n` samples.

    `template` is "auto" (the model's own chat template), "chatml", "llama3", "mistral" or "raw". With
    `chat`, the named conversation supplies the history and records this exchange when it ends;
    `amnesia=True` forgets the history first (field report 4). Samples use seeds `seed`, `seed + 1`, ...
    A new generation with the same `owner` (a notebook cell) cancels the previous one.
    """
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    if chat is not None and n > 1:
        raise ValueError(f"a chat records one answer per turn: use n=1 with chat={chat!r} (got n={n})")
    session = session or get_session()
    tokenizer = session.tokenizer
    conv = _conversation_for(chat, system, amnesia)
    text = conv.prompt(prompt, template, tokenizer) if conv else render(template, conversation(prompt, system), tokenizer)
    ids = tokenizer.encode(text, special=True)
    findings = lint_rendered(ids, template, tokenizer)
    stops = [_stop_as_id(s, tokenizer) for s in stop]
    if owner is not None:
        with _owned_lock:
            previous = _owned.pop(owner, None)
        if previous is not None:
            previous.cancel("re-run")
    streams = []
    try:  # a Ctrl-C anywhere in here leaves no job behind
        specs = [
            session.job_spec(
                ids, max_new_tokens=max_new_tokens, sampler=sampler, stop=stops,
                seed=None if seed is None else seed + i, identifier=f"sample {i}" if n > 1 else None,
                **sampler_overrides,
            )
            for i in range(n)
        ]
        streams = session.submit_together(specs)  # the samples start in one step and share the prompt's pages
        generation = Generation(session, text, ids, streams, user_turn=prompt if conv else None, chat=conv,
                                loop_guard=loop_guard, prompt_findings=findings)
        if owner is not None:
            with _owned_lock:
                _owned[owner] = generation
        generation._begin()
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise
    return generation


def _conversation_for(name: str | None, system: str | None, amnesia: bool) -> Chat | None:
    if name is None:
        if amnesia:
            raise ValueError("amnesia forgets a chat's history: name the chat too (chat=...)")
        return None
    conv = get_chat(name)
    if system is not None:
        conv.system = system
    if amnesia:
        conv.clear()
    return conv


def _stop_as_id(stop: str | int, tokenizer: Tokenizer) -> str | int:
    """A stop string that is a special token (e.g. "<|im_end|>") stops on its id: it is never decoded as text."""
    if isinstance(stop, str) and stop in tokenizer.special_tokens():
        return tokenizer.special_tokens()[stop]
    return stop
