"""Load testing the kernel's session from a notebook: `exlnb.bench(...)`, vLLM's `benchmark_serving` in-process.

A request is one job of the session, submitted when its planned arrival comes (`exlnb.workload`) and a
concurrency slot is free; requests due at the same moment go in one `submit_together`, so a burst reaches
the engine in one step rather than straddling several. One thread per request in flight reads its stream
and hands back its record (`exlnb.metrics`); the calling thread only submits and waits, so Ctrl-C lands
there, and every job the run started is cancelled before the interrupt goes on.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import pandas as pd

from exlnb.engines.base import SamplerSettings, wall_clock
from exlnb.metrics import RequestRecord, ServingMetrics, request_record, serving_metrics
from exlnb.session import Session, get_session
from exlnb.streaming import JobStream
from exlnb.workload import Length, PlannedRequest, Workload, plan_requests, rate_label

POLL_S = 0.25  # longest wait between looks at the clock: a duration ends at most this late
_run_numbers = itertools.count()


@dataclass(frozen=True)
class RateRun:
    """One request rate's run: its plan, the records of the requests sent, and their summary."""

    request_rate: float
    planned: tuple[PlannedRequest, ...]
    records: tuple[RequestRecord, ...]  # in request order; a duration leaves later requests unsent
    started_at: float  # wall_clock() when the first request could go
    metrics: ServingMetrics
    stopped: bool = False  # ended early by `stop`: requests in flight were cancelled, later ones never sent


class LoadRun:
    """Sends one rate's plan to the session and collects a record per request."""

    def __init__(
        self,
        session: Session,
        planned: Sequence[PlannedRequest],
        max_concurrency: int | None,
        stop: threading.Event | None = None,
    ) -> None:
        self.session = session
        self.max_concurrency = max_concurrency
        self.stop = stop or threading.Event()
        self.stopped = False  # the stop was seen: unsent requests dropped, those in flight cancelled
        self.tag = f"bench-{next(_run_numbers)}"  # job tables show (tag, request index)
        self.pending = deque(planned)
        self.in_flight: dict[int, threading.Thread] = {}
        self.records: dict[int, RequestRecord] = {}
        self.started_at = 0.0  # wall_clock() when the first request could go
        self._finished: queue.SimpleQueue[tuple[int, RequestRecord | BaseException]] = queue.SimpleQueue()

    def run(self, duration_s: float | None, on_finish: Callable[[RequestRecord], None]) -> float:
        """Send and wait until every sent request has ended; returns the run's duration in seconds.

        Any exception, KeyboardInterrupt included, cancels every job of the run before it propagates. The
        loop lives in its own method: on CPython 3.11.7 a Ctrl-C landing on a `continue` escaped an
        `except BaseException` wrapped round the loop in the same function.
        """
        self.started_at = wall_clock()
        try:
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
                # the readers then hand back cancelled records, which end the loop as failed requests
                self.stopped = True
                self.pending.clear()
                self._cancel_jobs()
            self._submit_due(now)
            if not self.in_flight and not self.pending:
                return
            try:
                index, outcome = self._finished.get(timeout=self._wait_s(now))
            except queue.Empty:
                continue
            self.in_flight.pop(index).join()
            if isinstance(outcome, BaseException):
                raise RuntimeError(f"request {index} failed: {outcome}") from outcome
            self.records[index] = outcome
            on_finish(outcome)

    def _submit_due(self, now: float) -> None:
        due: list[PlannedRequest] = []
        while self.pending and self.pending[0].arrival_s <= now and self._has_slot(len(due)):
            due.append(self.pending.popleft())
        if not due:
            return
        specs = [
            self.session.job_spec(
                list(r.prompt_ids), max_new_tokens=r.output_tokens, sampler=SamplerSettings.greedy(),
                stop_at_eos=False, identifier=(self.tag, r.index),
            )
            for r in due
        ]
        submitted_at = wall_clock()
        streams = self.session.submit_together(specs)
        for request, stream in zip(due, streams):
            thread = threading.Thread(target=self._read, args=(request.index, stream, submitted_at), daemon=True,
                                      name=f"exlnb-{self.tag}-{request.index}")
            self.in_flight[request.index] = thread
            thread.start()

    def _cancel_jobs(self) -> None:
        """By the run's tag, so a job whose stream an interrupt kept from being registered goes too."""
        for row in self.session.jobs():
            identifier = row.info.identifier
            if isinstance(identifier, tuple) and identifier[:1] == (self.tag,):
                self.session.cancel(row.info.job_id)

    def _has_slot(self, about_to_submit: int) -> bool:
        return self.max_concurrency is None or len(self.in_flight) + about_to_submit < self.max_concurrency

    def _wait_s(self, now: float) -> float:
        """Until the next arrival where a slot is free for it, else until a request ends (checked every POLL_S)."""
        if self.pending and self._has_slot(0):
            return min(POLL_S, max(0.0, self.pending[0].arrival_s - now))
        return POLL_S

    def _read(self, index: int, stream: JobStream, submitted_at: float) -> None:
        try:
            for _ in stream:
                pass
            outcome = request_record(stream.events, submitted_at=submitted_at, identifier=(self.tag, index))
        except BaseException as error:  # noqa: BLE001 - handed to the submitting thread, which raises it
            outcome = error
        self._finished.put((index, outcome))

    def cancel(self) -> None:
        """Cancel every job of this run and wait for its readers."""
        self._cancel_jobs()
        for thread in self.in_flight.values():
            thread.join(timeout=5)  # each reader ends on its job's cancelled event
        self.in_flight.clear()


@dataclass(frozen=True)
class BenchResult:
    """A load test's outcome: `requests` (one row per request), `summary` (one row per rate), `table()`
    (vLLM's printout), `figure()`, and `as_dict()` for JSON."""

    workload: Workload
    engine: str  # the session's status line: engine, model, device, paging, cache, batch
    runs: tuple[RateRun, ...]

    @property
    def requests(self) -> pd.DataFrame:
        rows = []
        for run in self.runs:
            for record in run.records:
                index = record.identifier[1]
                itls = [1000 * gap for gap in record.itl_s]
                rows.append({
                    "rate": rate_label(run.request_rate),
                    "request_rate": run.request_rate,
                    "request": index,
                    "job_id": record.job_id,
                    "arrival_s": run.planned[index].arrival_s,
                    "submitted_s": record.submitted_at - run.started_at,
                    "prompt_tokens": record.prompt_tokens,
                    "output_tokens": record.output_tokens,
                    "ttft_ms": _ms(record.ttft_s),
                    "tpot_ms": _ms(record.tpot_s),
                    "itl_mean_ms": sum(itls) / len(itls) if itls else math.nan,
                    "itl_count": len(itls),
                    "e2el_ms": 1000 * record.e2e_latency_s,
                    "eos_reason": record.eos_reason.value if record.eos_reason else None,
                    "succeeded": record.succeeded,
                })
        return pd.DataFrame(rows)

    @property
    def summary(self) -> pd.DataFrame:
        """vLLM's summary per rate: counts, duration, throughputs, and mean, median and p99 latencies."""
        rows = []
        for run in self.runs:
            m = run.metrics
            row = {
                "rate": rate_label(run.request_rate),
                "successful_requests": m.successful_requests,
                "failed_requests": m.failed_requests,
                "duration_s": m.duration_s,
                "request_throughput": m.request_throughput,
                "output_token_throughput": m.output_token_throughput,
                "total_token_throughput": m.total_token_throughput,
            }
            for name in ("ttft", "tpot", "itl", "e2el"):
                dist = getattr(m, f"{name}_ms")
                row.update({f"{name}_{stat}_ms": getattr(dist, stat) for stat in ("mean", "median", "p99")})
            if m.goodput is not None:
                row["goodput"] = m.goodput.rate
                row["goodput_fraction"] = m.goodput.fraction
            rows.append(row)
        return pd.DataFrame(rows).set_index("rate")

    def table(self) -> str:
        """vLLM's printout for every rate, headed by what ran."""
        parts = [self.engine]
        for run in self.runs:
            stopped = " (stopped early: requests in flight cancelled, later ones not sent)" if run.stopped else ""
            parts.append(f"Traffic request rate: {rate_label(run.request_rate)}{stopped}\n{run.metrics.table()}")
        return "\n".join(parts)

    def figure(self):
        """Latency against request rate where several were swept; against submission time for one rate."""
        import matplotlib.pyplot as plt
        import seaborn as sns

        data = self.requests
        data = data[data.succeeded] if len(data) else data
        measures = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("e2el_ms", "end-to-end latency (ms)"))
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for ax, (column, label) in zip(axes, measures):
            if len(self.runs) > 1:
                order = [rate_label(run.request_rate) for run in self.runs]
                sns.pointplot(data=data, x="rate", y=column, order=order, estimator="median", errorbar=("pi", 80),
                              ax=ax)
                ax.set(xlabel="request rate (req/s)", ylabel=label, title="median, 10th to 90th percentile")
            else:
                sns.scatterplot(data=data, x="submitted_s", y=column, ax=ax)
                ax.set(xlabel="submitted (s after the start)", ylabel=label,
                       title=f"{label} at {rate_label(self.runs[0].request_rate)} req/s")
            ax.set_ylim(bottom=0)
        fig.suptitle(self.engine, fontsize=9)
        fig.tight_layout()
        return fig

    def as_dict(self) -> dict:
        """Settings, engine, and per rate the summary and every request's raw times, in plain JSON values."""
        return _plain({
            "workload": self.workload.as_dict(),
            "engine": self.engine,
            "runs": [
                {
                    "request_rate": rate_label(run.request_rate),
                    "metrics": run.metrics.as_dict(),
                    "requests": [
                        {
                            "request": r.identifier[1],
                            "job_id": r.job_id,
                            "arrival_s": run.planned[r.identifier[1]].arrival_s,
                            "submitted_s": r.submitted_at - run.started_at,
                            "prompt_tokens": r.prompt_tokens,
                            "output_tokens": r.output_tokens,
                            "token_times_s": list(r.token_times),
                            "e2e_latency_s": r.e2e_latency_s,
                            "eos_reason": r.eos_reason.value if r.eos_reason else None,
                        }
                        for r in run.records
                    ],
                }
                for run in self.runs
            ],
        })

    def __repr__(self) -> str:
        return self.table()


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
    progress: bool = True,
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
    `tpot_ms`, `e2el_ms`) add goodput. `on_finish(record)` is called as each request ends.

    Ctrl-C (or an exception from `on_finish`) cancels every job the run started, then propagates. Setting
    `stop` (a Stop button, another thread) ends the run without an error: requests in flight are cancelled
    and count as failed, later requests and rates are not sent, and the result holds what ran.
    """
    rates = tuple(float(r) for r in request_rate) if isinstance(request_rate, Sequence) else (float(request_rate),)
    workload = Workload(
        request_rates=rates, burstiness=burstiness, max_concurrency=max_concurrency, prompt_len=prompt_len,
        output_len=output_len, dataset=dataset, num_requests=num_requests, duration_s=duration_s, seed=seed,
        slos=slos,
    )
    session = session or get_session()
    status = session.status()
    plans = [plan_requests(workload, rate, session.tokenizer, status.cache_tokens) for rate in rates]
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
    progress: bool,
    on_finish: Callable[[RequestRecord], None] | None,
    stop: threading.Event | None = None,
) -> RateRun:
    """Send one rate's plan with a progress bar (a widget in a notebook, text elsewhere)."""
    from tqdm.auto import tqdm

    total = None if workload.duration_s is not None else len(planned)
    load = LoadRun(session, planned, workload.max_concurrency, stop)
    with tqdm(total=total, desc=f"{rate_label(request_rate)} req/s", unit="req", disable=not progress) as bar:

        def finished(record: RequestRecord) -> None:
            bar.update(1)
            if on_finish is not None:
                on_finish(record)

        duration = load.run(workload.duration_s, finished)
    records = tuple(load.records[i] for i in sorted(load.records))
    return RateRun(request_rate, tuple(planned), records, load.started_at,
                   serving_metrics(records, duration, workload.slos), load.stopped)


def _ms(seconds: float | None) -> float:
    return math.nan if seconds is None else 1000 * seconds


def _plain(value):
    """NaN and infinity as None, tuples as lists: JSON that every parser reads."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
