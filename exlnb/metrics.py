"""Serving latency metrics, defined as vLLM's `benchmarks/benchmark_serving.py` defines them.

Per request (`RequestRecord`, from one job's stream events):

- TTFT, time to first token: from submitting the request to the arrival of the first event that carries a
  token.
- E2E latency (vLLM's "e2el"): from submitting the request to the arrival of its last event.
- TPOT, time per output token excluding the first: (E2E latency - TTFT) / (output tokens - 1). Undefined
  (None) for a request with one output token; vLLM leaves such requests out of the TPOT statistics and
  counts their TPOT as 0 when checking a TPOT objective, and so does `serving_metrics`.
- ITL, inter-token latencies: the gaps between consecutive arrivals of events that carry tokens. vLLM's
  client appends one gap per streamed chunk, whatever the chunk holds, and so does this module: an event
  that delivers three tokens adds one ITL, not three. Where every event carries one token (every engine
  in the kernel), a request of n tokens has n - 1 ITLs and their sum is E2E latency - TTFT; where events carry
  several tokens (speculative decoding), mean ITL exceeds TPOT. For a server, whose frames may each carry
  several tokens, the record's `delivery` gives ITL per token as well (`exlnb.engines.delivery`).

Over a run (`ServingMetrics`): the mean, median, standard deviation (population, as numpy's default) and
percentiles (numpy's linear interpolation) of TTFT, TPOT and E2E latency over successful requests, and of ITL
over every gap of every successful request pooled, as vLLM pools them. Request throughput is successful
requests per second of run duration, output token throughput their output tokens per second. Goodput is the
rate of successful requests meeting every given objective (vLLM: the objective is met when the value is at
most the objective), also given as the fraction of successful requests.

Times come from the events' `time_produced`: the engine's clock after the device synchronised, not the
moment a consumer thread got round to reading the event, so a slow reader does not inflate them.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from exlnb.engines.base import EosReason, StreamEvent
from exlnb.engines.delivery import Delivery

# the objectives goodput accepts, in milliseconds, and the per-request value each one bounds
SLO_METRICS = ("ttft_ms", "tpot_ms", "e2el_ms")


@dataclass(frozen=True)
class RequestRecord:
    """One request's timings in seconds, as the metrics need them; `token_times` are relative to submission."""

    job_id: int
    identifier: Hashable | None
    prompt_tokens: int
    output_tokens: int
    submitted_at: float  # perf_counter when the request was submitted
    token_times: tuple[float, ...]  # arrival of each event that carried tokens, seconds after submission
    e2e_latency_s: float
    eos_reason: EosReason | None
    delivery: Delivery | None = None  # a server's answer: its frames as the client received them
    error: str | None = None  # why it failed, in one line, where eos_reason is FAILED

    @property
    def succeeded(self) -> bool:
        """Ran to its end: not cancelled, not failed, and produced at least one token."""
        return self.eos_reason not in (EosReason.CANCELLED, EosReason.FAILED) and self.output_tokens > 0

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def tpot_s(self) -> float | None:
        """(E2E latency - TTFT) / (output tokens - 1); None for fewer than two output tokens."""
        if self.output_tokens < 2 or self.ttft_s is None:
            return None
        return (self.e2e_latency_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> tuple[float, ...]:
        """Gaps between consecutive token-carrying events: one per event after the first, not per token."""
        return tuple(b - a for a, b in zip(self.token_times, self.token_times[1:]))


def request_record(
    events: Sequence[StreamEvent],
    *,
    submitted_at: float | None = None,
    identifier: Hashable | None = None,
    error: str | None = None,
) -> RequestRecord:
    """A finished job's record from its stream's events (`JobStream.events`).

    `submitted_at` is when the caller submitted the job (a `wall_clock()` reading); by default the engine's
    own `time_enqueued`. The engine stamps a job when it takes it between two steps, so a request that
    arrives mid-step has already waited for that step: a load generator passes its own clock reading so the
    wait counts, as it would for a client.
    """
    if not events:
        raise ValueError("no events: a record needs the stream of a job that has at least started")
    last = events[-1]
    start = last.time_enqueued if submitted_at is None else submitted_at
    return RequestRecord(
        job_id=last.job_id,
        identifier=identifier,
        prompt_tokens=last.prompt_tokens,
        output_tokens=sum(len(e.token_ids) for e in events),
        submitted_at=start,
        token_times=tuple(e.time_produced - start for e in events if e.token_ids),
        e2e_latency_s=last.time_produced - start,
        eos_reason=last.eos_reason,
        delivery=last.delivery,
        error=error,
    )


@dataclass(frozen=True)
class Distribution:
    """Summary statistics of samples in milliseconds; NaN throughout where there were no samples."""

    n: int
    mean: float
    median: float
    std: float
    p90: float
    p99: float

    @classmethod
    def of_seconds(cls, samples: Sequence[float]) -> Distribution:
        if len(samples) == 0:
            return cls(0, *[math.nan] * 5)
        ms = np.asarray(samples, dtype=float) * 1000
        p90, p99 = np.percentile(ms, [90, 99])
        return cls(len(ms), float(ms.mean()), float(np.median(ms)), float(ms.std()), float(p90), float(p99))


@dataclass(frozen=True)
class Goodput:
    """Successful requests meeting every objective: how many, what fraction, and per second of the run."""

    slos: Mapping[str, float]  # e.g. {"ttft_ms": 500, "tpot_ms": 50}
    good_requests: int
    fraction: float
    rate: float  # requests per second


@dataclass(frozen=True)
class ServingMetrics:
    """A run's summary: what vLLM's benchmark_serving prints, plus p90 and the counts behind every number."""

    successful_requests: int
    failed_requests: int  # cancelled, failed, or ended without a token
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # successful requests per second
    output_token_throughput: float  # output tokens of successful requests per second
    total_token_throughput: float  # input and output tokens of successful requests per second
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution
    goodput: Goodput | None = None

    def table(self) -> str:
        """The summary laid out as vLLM prints it."""
        rows: list[tuple[str, object]] = [
            ("Successful requests:", self.successful_requests),
            ("Failed requests:", self.failed_requests),
            ("Benchmark duration (s):", self.duration_s),
            ("Total input tokens:", self.total_input_tokens),
            ("Total generated tokens:", self.total_output_tokens),
            ("Request throughput (req/s):", self.request_throughput),
            ("Output token throughput (tok/s):", self.output_token_throughput),
            ("Total token throughput (tok/s):", self.total_token_throughput),
        ]
        if self.goodput is not None:
            rows.append(("Request goodput (req/s):", self.goodput.rate))
            rows.append(("Requests meeting every SLO (%):", 100 * self.goodput.fraction))
        lines = [" Serving Benchmark Result ".center(50, "=")] + [_row(*row) for row in rows]
        for title, name, dist in (
            ("Time to First Token", "TTFT", self.ttft_ms),
            ("Time per Output Token (excl. 1st token)", "TPOT", self.tpot_ms),
            ("Inter-token Latency", "ITL", self.itl_ms),
            ("End-to-end Latency", "E2EL", self.e2el_ms),
        ):
            lines.append(f"{title}".center(50, "-"))
            for label in ("mean", "median", "p90", "p99"):
                lines.append(_row(f"{label.capitalize()} {name} (ms):", getattr(dist, label)))
        lines.append("=" * 50)
        return "\n".join(lines)

    def as_dict(self) -> dict:
        """Plain values for JSON."""
        return asdict(self)


def serving_metrics(
    records: Sequence[RequestRecord], duration_s: float, slos: Mapping[str, float] | None = None
) -> ServingMetrics:
    """Summarise a run's requests over its duration; `slos` (milliseconds) adds goodput."""
    if duration_s <= 0:
        raise ValueError(f"duration_s={duration_s}: a run's duration must be positive")
    checked = check_slos(slos) if slos else None
    ok = [r for r in records if r.succeeded]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    goodput = None
    if checked is not None:
        good = sum(meets_slos(r, checked) for r in ok)
        goodput = Goodput(dict(checked), good, good / len(ok) if ok else math.nan, good / duration_s)
    return ServingMetrics(
        successful_requests=len(ok),
        failed_requests=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration_s,
        output_token_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        ttft_ms=Distribution.of_seconds([r.ttft_s for r in ok]),
        tpot_ms=Distribution.of_seconds([r.tpot_s for r in ok if r.tpot_s is not None]),
        itl_ms=Distribution.of_seconds([gap for r in ok for gap in r.itl_s]),
        e2el_ms=Distribution.of_seconds([r.e2e_latency_s for r in ok]),
        goodput=goodput,
    )


def check_slos(slos: Mapping[str, float]) -> dict[str, float]:
    """Objectives by name, each a positive number of milliseconds; a misspelt name fails with the valid ones."""
    unknown = set(slos) - set(SLO_METRICS)
    if unknown:
        raise ValueError(f"unknown SLO {sorted(unknown)}: use {', '.join(SLO_METRICS)} (milliseconds)")
    for name, value in slos.items():
        if not value > 0:
            raise ValueError(f"SLO {name}={value!r}: an objective is a positive number of milliseconds")
    return {name: float(value) for name, value in slos.items()}


def meets_slos(record: RequestRecord, slos: Mapping[str, float]) -> bool:
    """Every objective met (value <= objective); a one-token request's TPOT counts as 0, as in vLLM."""
    values = {"ttft_ms": record.ttft_s, "tpot_ms": record.tpot_s or 0.0, "e2el_ms": record.e2e_latency_s}
    return all(values[name] is not None and 1000 * values[name] <= limit for name, limit in slos.items())


def _row(label: str, value: object) -> str:
    shown = f"{value:<10.2f}" if isinstance(value, float) else f"{value:<10}"
    return f"{label:<40} {shown}"


@dataclass(frozen=True)
class DecodeSpan:
    """Several jobs' decoding taken together: the tokens they decoded after their first, over the time during
    which at least one of them was decoding (the union of their decode intervals, first token -> last event).

    Jobs decoded side by side share that time and jobs served one after another (a server that runs one request
    at a time) add theirs, so the rate is what the engine delivered. The sum of each job's own rate was not: four
    samples served in turn read "65.8 tok/s" for 104 tokens in 7.8 s."""

    tokens: int
    seconds: float
    jobs: int

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.tokens and self.seconds > 0 else None

    @classmethod
    def of(cls, events: Sequence[StreamEvent]) -> DecodeSpan:
        """From each job's latest event: its decode interval and the tokens it decoded (as `job_event` counts them)."""
        intervals, tokens = [], 0
        for event in events:
            if event.time_to_first_token_s is None or event.new_tokens < 2:
                continue
            first = event.time_enqueued + event.time_to_first_token_s
            if event.time_produced > first:
                intervals.append((first, event.time_produced))
                tokens += event.new_tokens - 1
        seconds, reached = 0.0, -math.inf
        for start, end in sorted(intervals):
            seconds += max(0.0, end - max(start, reached))
            reached = max(reached, end)
        return cls(tokens, seconds, len(intervals))
