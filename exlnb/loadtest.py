"""Load testing the kernel's session from a notebook: `exlnb.bench(...)`, vLLM's `benchmark_serving` in-process.

A request is one job of the session, submitted when its planned arrival comes (`exlnb.workload`) and a
concurrency slot is free; requests due at the same moment go in one `submit_together`, so a burst reaches
the engine in one step rather than straddling several. Every request's events go to one queue, which the
calling thread reads between submissions: no thread per request (a run of 10,000 requests once held 9,619),
and Ctrl-C lands on that thread, where every job the run started is cancelled, in one engine command,
before the interrupt goes on.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack

from exlnb.bench_result import BenchResult, RateRun
from exlnb.engines.base import SamplerSettings, wall_clock
from exlnb.engines.job_options import JobOptions
from exlnb.metrics import RequestRecord, request_record, serving_metrics
from exlnb.session import Session, get_session
from exlnb.streaming import JobError, JobStream, ModelUnloaded, reading
from exlnb.workload import Length, PlannedRequest, Workload, plan_requests, rate_label

POLL_S = 0.02  # longest wait between looks at the clock and the stop: a Stop or a duration acts at most this late
_run_numbers = itertools.count()


class Progress:
    """Told what a running load test does, as it does it, on the thread that runs it; ignores it all.

    `TextProgress` draws a text bar per rate; the notebook widget (`exlnb.widgets.loadtest`) draws its own.
    """

    def started(self, workload: Workload) -> None:
        """The test begins: its rates, requests and settings."""

    def rate_started(self, request_rate: float, requests: int | None) -> None:
        """A rate's run begins: `requests` to send, or None where it sends for a duration."""

    def sent(self, count: int) -> None:
        """`count` requests were submitted together."""

    def finished(self, record: RequestRecord) -> None:
        """A request ended; a cancelled or failed one too (`record.succeeded` is False)."""

    def rate_ended(self, run: RateRun | None) -> None:
        """The rate's run is over; None where an error or an interrupt ended it."""


class TextProgress(Progress):
    """A tqdm bar per rate: a widget where ipywidgets renders, text elsewhere."""

    def __init__(self) -> None:
        self._bar = None

    def rate_started(self, request_rate: float, requests: int | None) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=requests, desc=f"{rate_label(request_rate)} req/s", unit="req")

    def finished(self, record: RequestRecord) -> None:
        self._bar.update(1)

    def rate_ended(self, run: RateRun | None) -> None:
        self._bar.close()


class LoadRun:
    """Sends one rate's plan to the session and collects a record per request."""

    def __init__(
        self,
        session: Session,
        planned: Sequence[PlannedRequest],
        max_concurrency: int | None,
        stop: threading.Event | None = None,
        progress: Progress | None = None,
    ) -> None:
        self.session = session
        self.max_concurrency = max_concurrency
        self.stop = stop or threading.Event()
        self.progress = progress or Progress()
        self.stopped = False  # the stop was seen: unsent requests dropped, those in flight cancelled
        self.tag = f"bench-{next(_run_numbers)}"  # job tables show (tag, request index)
        self.pending = deque(planned)
        self.in_flight: dict[int, tuple[JobStream, float]] = {}  # request index -> its stream, when submitted
        self.records: dict[int, RequestRecord] = {}
        self.started_at = 0.0  # wall_clock() when the first request could go
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # every request's events, read by this one thread
        self._requests: dict[int, int] = {}  # job id -> request index
        self._reading = ExitStack()  # the streams count as read (the job table) while the run takes their events

    def run(self, duration_s: float | None, on_finish: Callable[[RequestRecord], None]) -> float:
        """Send and wait until every sent request has ended; returns the run's duration in seconds.

        Any exception, KeyboardInterrupt included, cancels every job of the run before it propagates. The
        loop lives in its own method: on CPython 3.11.7 a Ctrl-C landing on a `continue` escaped an
        `except BaseException` wrapped round the loop in the same function.
        """
        self.started_at = wall_clock()
        try:
            with self._reading:
                self._send_and_collect(duration_s, on_finish)
        except BaseException:
            self.cancel()
            raise
        return wall_clock() - self.started_at

    def _send_and_collect(self, duration_s: float | None, on_finish: Callable[[RequestRecord], None]) -> None:
        while self.pending or self.in_flight:
            now = wall_clock() - self.started_at
            if duration_s is not None and now >= duration_s:
                self.pending.clear()
            if self.stop.is_set() and not self.stopped:
                # the cancelled jobs' last events are then read below, and end the loop as failed requests
                self.stopped = True
                self.pending.clear()
                self.cancel()
            self._submit_due(now)
            if not self.in_flight and not self.pending:
                return
            try:
                delivered = self._events.get(timeout=self._wait_s(now))
            except queue.Empty:
                continue
            self._receive(delivered, on_finish)

    def _submit_due(self, now: float) -> None:
        due: list[PlannedRequest] = []
        while self.pending and self.pending[0].arrival_s <= now and self._has_slot(len(due)):
            due.append(self.pending.popleft())
        if not due:
            return
        specs = [
            self.session.spec_for(
                r.prompt_ids,
                JobOptions(
                    max_new_tokens=r.output_tokens,
                    sampler=SamplerSettings.greedy(),
                    stop_at_eos=False,
                    identifier=(self.tag, r.index),
                ),
            )
            for r in due
        ]
        submitted_at = wall_clock()
        streams = self.session.submit_together(specs, shared=self._events)
        self._reading.enter_context(reading(streams))
        for request, stream in zip(due, streams):
            self.in_flight[request.index] = (stream, submitted_at)
            self._requests[stream.job_id] = request.index
        self.progress.sent(len(due))

    def _receive(self, delivered, on_finish: Callable[[RequestRecord], None]) -> None:
        """One event (or failure) of one request; a request's last event makes its record. A request that failed
        alone (a server's bad answer) is recorded as failed and the run goes on; an unloaded model ends the run."""
        index = self._requests[delivered.job_id]
        stream, submitted_at = self.in_flight[index]
        error = None
        try:
            event = stream.receive(delivered)
        except ModelUnloaded as unloaded:
            raise RuntimeError(f"request {index} failed: {unloaded}") from unloaded
        except JobError as failure:
            event, error = stream.failed_end(), str(failure)
        if not event.eos:
            return
        del self.in_flight[index]
        events = stream.events if error is None else [*stream.events, event]
        record = request_record(events, submitted_at=submitted_at, identifier=(self.tag, index), error=error)
        self.records[index] = record
        self.progress.finished(record)
        on_finish(record)

    def _has_slot(self, about_to_submit: int) -> bool:
        return self.max_concurrency is None or len(self.in_flight) + about_to_submit < self.max_concurrency

    def _wait_s(self, now: float) -> float:
        """Until the next arrival where a slot is free for it, else until a request ends (checked every POLL_S)."""
        if self.pending and self._has_slot(0):
            return min(POLL_S, max(0.0, self.pending[0].arrival_s - now))
        return POLL_S

    def cancel(self) -> int:
        """Cancel every job of this run in one engine command; how many were running.

        By the run's tag, so a job whose stream an interrupt kept from being registered goes too; in one
        command, because each command waits for the engine's step in progress (one cancel per job made a
        Stop with 3,000 requests in flight take 326 s)."""
        return self.session.cancel_where(
            lambda info: isinstance(info.identifier, tuple) and info.identifier[:1] == (self.tag,)
        )


def bench(
    request_rate: float | Sequence[float] = math.inf,
    *,
    burstiness: float = Workload.burstiness,
    max_concurrency: int | None = None,
    prompt_len: Length = Workload.prompt_len,
    output_len: Length = Workload.output_len,
    dataset: str | None = None,
    num_requests: int | None = None,
    duration_s: float | None = None,
    seed: int = Workload.seed,
    slos: Mapping[str, float] | None = None,
    progress: bool | Progress = True,
    on_finish: Callable[[RequestRecord], None] | None = None,
    stop: threading.Event | None = None,
    session: Session | None = None,
) -> BenchResult:
    """Load-test the loaded model: send requests at `request_rate` per second (several rates: one run each,
    same seeded requests) and measure TTFT, TPOT, ITL and end-to-end latency as vLLM's benchmark_serving does.

    Arrivals are Poisson (`burstiness=1`) or gamma-distributed (`<1` burstier, `>1` more even); `inf` sends
    everything at once. `max_concurrency` caps requests in flight. `prompt_len` and `output_len` are token
    counts or (low, high) ranges; `dataset` takes prompts from data/prompts/<name>.json instead of random
    tokens. Outputs have exactly their length (greedy, end-of-sequence ignored), so runs compare. Send
    `num_requests` (default 16) per rate, or send for `duration_s` seconds. `slos` in ms (`ttft_ms`,
    `tpot_ms`, `e2el_ms`) add goodput. `progress`: a bar per rate (True), nothing (False), or a `Progress`
    told of every step. `on_finish(record)` is called as each request ends.

    Ctrl-C (or an exception from `on_finish`) cancels every job the run started, then propagates. Setting
    `stop` (a Stop button, another thread) ends the run without an error: requests in flight are cancelled
    and count as failed, later requests and rates are not sent, and the result holds what ran. A request that
    fails alone (a server's bad answer) counts as failed, with its error in the result, and the run goes on.
    """
    rates = tuple(float(r) for r in request_rate) if isinstance(request_rate, Sequence) else (float(request_rate),)
    workload = Workload(
        request_rates=rates,
        burstiness=burstiness,
        max_concurrency=max_concurrency,
        prompt_len=prompt_len,
        output_len=output_len,
        dataset=dataset,
        num_requests=num_requests,
        duration_s=duration_s,
        seed=seed,
        slos=slos,
    )
    session = session or get_session()
    status = session.status()
    plans = [plan_requests(workload, rate, session.tokenizer, status.cache_tokens) for rate in rates]
    if not isinstance(progress, Progress):
        progress = TextProgress() if progress else Progress()
    progress.started(workload)
    runs: list[RateRun] = []
    for rate, plan in zip(rates, plans):
        runs.append(run_rate(session, workload, rate, plan, progress, on_finish, stop))
        if runs[-1].stopped:
            break
    return BenchResult(workload, status.line(), tuple(runs))


def run_rate(
    session: Session,
    workload: Workload,
    request_rate: float,
    planned: list[PlannedRequest],
    progress: Progress,
    on_finish: Callable[[RequestRecord], None] | None,
    stop: threading.Event | None = None,
) -> RateRun:
    """Send one rate's plan, telling `progress` as it goes."""
    requested = None if workload.duration_s is not None else len(planned)
    load = LoadRun(session, planned, workload.max_concurrency, stop, progress)
    progress.rate_started(request_rate, requested)
    run = None
    try:
        duration = load.run(workload.duration_s, on_finish or (lambda record: None))
        records = tuple(load.records[i] for i in sorted(load.records))
        run = RateRun(
            request_rate,
            tuple(planned),
            records,
            load.started_at,
            serving_metrics(records, duration, workload.slos),
            load.stopped,
            requested,
        )
    finally:
        progress.rate_ended(run)
    return run
