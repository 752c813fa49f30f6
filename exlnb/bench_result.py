"""What a load test measured (`exlnb.bench`), and its views: one row per request, one per rate, vLLM's
printout, a figure and JSON. A run ended early by Stop or an interrupt says so in each, with its counts; requests
that failed alone are counted as failed, with their errors; a server's answers add the delivery audit
(`exlnb.engines.delivery`: chunks per token, frames against tokens per second, inter-token latency per token)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import pandas as pd

from exlnb.engines.base import EosReason
from exlnb.engines.delivery import DeliveryAudit
from exlnb.metrics import RequestRecord, ServingMetrics
from exlnb.workload import PlannedRequest, Workload, rate_label


@dataclass(frozen=True)
class RateRun:
    """One request rate's run: its plan, the records of the requests sent, and their summary."""

    request_rate: float
    planned: tuple[PlannedRequest, ...]
    records: tuple[RequestRecord, ...]  # in request order; a duration leaves later requests unsent
    started_at: float  # wall_clock() when the first request could go
    metrics: ServingMetrics
    stopped: bool = False  # ended early by `stop`: requests in flight were cancelled, later ones never sent
    requested: int | None = None  # requests it was to send; None where it sent for a duration

    @property
    def unsent_requests(self) -> int:
        """Requests a stop kept from being sent (a duration names no number of requests, so none there)."""
        return 0 if self.requested is None else self.requested - len(self.records)

    @property
    def slo_missed(self) -> bool:
        """Objectives were given and a request that ran to its end missed them."""
        g = self.metrics.goodput
        return g is not None and g.good_requests < self.metrics.successful_requests

    def compact_row(self) -> dict[str, str]:
        """The rate as one row of the compact table: what finished, throughput, latencies and the SLO's share."""
        m = self.metrics
        of = f" of {self.requested}" if self.requested is not None else ""
        row = {
            "rate (req/s)": rate_label(self.request_rate),
            "finished": f"{m.successful_requests}{of}",
            "req/s": f"{m.request_throughput:.2f}",
            "output tok/s": f"{m.output_token_throughput:.1f}",
            "TTFT median / p99 (ms)": f"{_ms_cell(m.ttft_ms.median)} / {_ms_cell(m.ttft_ms.p99)}",
            "TPOT median (ms)": _ms_cell(m.tpot_ms.median),
            "E2EL median (ms)": _ms_cell(m.e2el_ms.median),
        }
        if m.goodput is not None:
            row["SLO met"] = slo_words(m.goodput.good_requests, m.successful_requests)
        return row

    def count_words(self) -> str:
        """'5 of 8 requests finished, 1 failed, 1 cancelled in flight, 1 never sent'."""
        m = self.metrics
        of = f" of {self.requested}" if self.requested is not None else ""
        failed = len(self.failures) if self.stopped else m.failed_requests
        parts = [f"{m.successful_requests}{of} requests finished"]
        if failed:
            parts.append(f"{failed} failed")
        if m.failed_requests - failed:
            parts.append(f"{m.failed_requests - failed} cancelled in flight")
        if self.unsent_requests:
            parts.append(f"{self.unsent_requests} never sent")
        return ", ".join(parts)

    @property
    def failures(self) -> tuple[RequestRecord, ...]:
        """The requests that failed alone (a server's bad answer, an engine's error), each with its error."""
        return tuple(r for r in self.records if r.eos_reason is EosReason.FAILED)

    def failure_lines(self, most: int = 3) -> list[str]:
        """'request 4 failed: the server at ...', for the first `most` failures, and how many more there were."""
        lines = [f"request {r.identifier[1]} failed: {r.error}" for r in self.failures[:most]]
        if len(self.failures) > most:
            lines.append(f"... and {len(self.failures) - most} more failed")
        return lines

    @cached_property
    def delivery(self) -> DeliveryAudit | None:
        """How the answers that finished reached the client from a server (None on an engine in the kernel)."""
        return DeliveryAudit.of(r.delivery for r in self.records if r.succeeded)


@dataclass(frozen=True)
class BenchResult:
    """A load test's outcome: `requests` (one row per request), `summary` (one row per rate), `table()`
    (vLLM's printout), `figure()`, and `as_dict()` for JSON."""

    workload: Workload
    engine: str  # the session's status line: engine, model, device, paging, cache, batch
    runs: tuple[RateRun, ...]

    @property
    def stopped(self) -> bool:
        """Ended early by Stop or an interrupt: its last rate is cut short and later rates were not run."""
        return any(run.stopped for run in self.runs)

    def stop_words(self) -> str | None:
        """'stopped at 4 req/s: 5 of 8 requests finished, 2 cancelled in flight, 1 never sent; rate inf not
        run', or None for a run that went to its end."""
        if not self.stopped:
            return None
        last = self.runs[-1]
        words = f"stopped at {rate_label(last.request_rate)} req/s: {last.count_words()}"
        not_run = [rate_label(rate) for rate in self.workload.request_rates[len(self.runs) :]]
        if not_run:
            words += f"; rate{'s' if len(not_run) > 1 else ''} {', '.join(not_run)} not run"
        return words

    @property
    def requests(self) -> pd.DataFrame:
        rows = []
        for run in self.runs:
            for record in run.records:
                index = record.identifier[1]
                itls = [1000 * gap for gap in record.itl_s]
                rows.append(
                    {
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
                        "error": record.error,
                        **_delivery_columns(record),
                    }
                )
        return pd.DataFrame(rows)

    @property
    def summary(self) -> pd.DataFrame:
        """vLLM's summary per rate: counts, duration, throughputs, and mean, median and p99 latencies; whether
        a stop cut the rate short and how many requests it kept from being sent."""
        rows = []
        for run in self.runs:
            m = run.metrics
            row = {
                "rate": rate_label(run.request_rate),
                "successful_requests": m.successful_requests,
                "failed_requests": m.failed_requests,
                "unsent_requests": run.unsent_requests,
                "stopped": run.stopped,
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
            if run.delivery is not None:
                audit = run.delivery
                row.update(
                    chunks_per_token=audit.chunks_per_token,
                    frames_per_s=audit.frames_per_s,
                    tokens_per_s=audit.tokens_per_s,
                    itl_per_token_median_ms=audit.itl_per_token_ms,
                    first_frame_lead_median_ms=audit.first_frame_lead_ms,
                )
            rows.append(row)
        return pd.DataFrame(rows).set_index("rate")

    def table(self) -> str:
        """vLLM's printout for every rate, headed by what ran; a stopped run says where and what finished."""
        parts = [self.engine]
        for run in self.runs:
            stopped = f" (stopped: {run.count_words()})" if run.stopped else ""
            parts.append(f"Traffic request rate: {rate_label(run.request_rate)}{stopped}\n{run.metrics.table()}")
            if run.delivery is not None:
                parts.append(run.delivery.line())
            parts += run.failure_lines()
        if self.stopped:
            parts.append(self.stop_words())
        return "\n".join(parts)

    def figure(self):
        """Latency against request rate where several were swept; against submission time for one rate.
        Only requests that ran to their end are drawn; a stopped run says so in the title."""
        import matplotlib.pyplot as plt
        import seaborn as sns

        data = self.requests
        data = data[data.succeeded] if len(data) else data
        measures = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("e2el_ms", "end-to-end latency (ms)"))
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for ax, (column, label) in zip(axes, measures):
            if data.empty:
                ax.set(ylabel=label, title="no request ran to its end")
            elif len(self.runs) > 1:
                order = [rate_label(run.request_rate) for run in self.runs]
                sns.pointplot(
                    data=data, x="rate", y=column, order=order, estimator="median", errorbar=("pi", 80), ax=ax
                )
                ax.set(xlabel="request rate (req/s)", ylabel=label, title="median, 10th to 90th percentile")
            else:
                sns.scatterplot(data=data, x="submitted_s", y=column, ax=ax)
                ax.set(
                    xlabel="submitted (s after the start)",
                    ylabel=label,
                    title=f"{label} at {rate_label(self.runs[0].request_rate)} req/s",
                )
            ax.set_ylim(bottom=0)
        fig.suptitle("\n".join(filter(None, [self.engine, self.stop_words()])), fontsize=9)
        fig.tight_layout()
        return fig

    def as_dict(self) -> dict:
        """Settings, engine, and per rate the summary and every request's raw times, in plain JSON values."""
        return plain_json(
            {
                "workload": self.workload.as_dict(),
                "engine": self.engine,
                "stopped": self.stop_words(),
                "runs": [
                    {
                        "request_rate": rate_label(run.request_rate),
                        "stopped": run.stopped,
                        "unsent_requests": run.unsent_requests,
                        "metrics": run.metrics.as_dict(),
                        "delivery": run.delivery.as_dict() if run.delivery else None,
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
                                "error": r.error,
                                **_delivery_columns(r),
                            }
                            for r in run.records
                        ],
                    }
                    for run in self.runs
                ],
            }
        )

    def __repr__(self) -> str:
        return self.table()


def slo_words(good: int, finished: int) -> str:
    """'17% (1 of 6)': the share of the requests that ran to their end and met every objective."""
    if not finished:
        return "no request ran to its end"
    return f"{good / finished:.0%} ({good} of {finished})"


def _delivery_columns(record: RequestRecord) -> dict[str, object]:
    """A server's answer: frames received, the server's own token count, and the first frame's lead on the first
    token; nothing for an engine in the kernel."""
    d = record.delivery
    if d is None:
        return {}
    lead = d.first_frame_lead_s
    return {
        "frames": d.frames,
        "server_tokens": d.server_tokens,
        "first_frame_lead_ms": None if lead is None else 1000 * lead,
    }


def _ms_cell(ms: float) -> str:
    return "-" if math.isnan(ms) else f"{ms:.1f}"


def _ms(seconds: float | None) -> float:
    return math.nan if seconds is None else 1000 * seconds


def plain_json(value):
    """NaN and infinity as None, tuples as lists: JSON that every parser reads (`allow_nan=False`)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(v) for v in value]
    return value
