"""Where a setup saturates, read from an `exlnb.bench` rate sweep, and the figure of several setups' sweeps.

A rate is kept up with when requests end about as fast as they arrive: the completion rate (requests per
second from the first to end to the last) is at least KEPT_UP of the arrival rate (from the first to arrive
to the last). Past saturation requests queue and end at the engine's own pace, and TTFT grows with the queue.
Both rates are taken over the same requests, so the drain of the last request does not count against a rate,
as it does in vLLM's request throughput (requests over the whole run). An infinite rate sends everything at
once: it measures capacity and is never kept up with.
"""

from __future__ import annotations

import math

from exlnb.bench_result import BenchResult, RateRun
from exlnb.workload import rate_label

KEPT_UP = 0.9  # completion rate / arrival rate at or above which a rate counts as kept up with


def rate_summary(run: RateRun) -> dict:
    """One rate: offered, arrived and completed requests per second, throughputs, and the latencies."""
    ok = [r for r in run.records if r.succeeded] if math.isfinite(run.request_rate) else []
    arrival = _span_rate([run.planned[r.identifier[1]].arrival_s for r in ok])
    completion = _span_rate([r.submitted_at - run.started_at + r.e2e_latency_s for r in ok])
    m = run.metrics
    return {
        "request_rate": rate_label(run.request_rate),
        "arrival_req_s": arrival,
        "completion_req_s": completion,
        "kept_up": completion >= KEPT_UP * arrival if arrival and completion else None,
        "request_throughput": m.request_throughput,
        "output_token_throughput": m.output_token_throughput,
        "successful_requests": m.successful_requests,
        "ttft_median_ms": m.ttft_ms.median,
        "ttft_p99_ms": m.ttft_ms.p99,
        "tpot_median_ms": m.tpot_ms.median,
        "tpot_p99_ms": m.tpot_ms.p99,
        "e2el_p99_ms": m.e2el_ms.p99,
    }


def saturation(result: BenchResult) -> dict:
    """The sweep per rate (rising, as swept), the highest rate kept up with, the first rate above it that was
    not (where it saturates: a lower rate missed by noise does not count), and the most requests per second
    the engine completed at any rate (its capacity, usually at inf)."""
    rates = [rate_summary(run) for run in result.runs]
    kept = [i for i, r in enumerate(rates) if r["kept_up"]]
    above = rates[kept[-1] + 1 :] if kept else rates
    missed = [r["request_rate"] for r in above if r["kept_up"] is False]
    return {
        "kept_up_fraction": KEPT_UP,
        "saturates_at_req_s": missed[0] if missed else None,
        "highest_kept_up_req_s": rates[kept[-1]]["request_rate"] if kept else None,
        "capacity_req_s": max((r["request_throughput"] for r in rates), default=None),
        "rates": rates,
    }


def figure(setups: list[dict], title: str = ""):
    """Completed requests per second, p99 TTFT and median TPOT against the offered rate, a line per setup
    (`setups`: the records `benchmarks.serving` writes, each with its `setup` name and `saturation`)."""
    import matplotlib.pyplot as plt

    order = list(dict.fromkeys(r["request_rate"] for s in setups for r in s["saturation"]["rates"]))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    panels = (
        ("request_throughput", "completed requests per second"),
        ("ttft_p99_ms", "p99 TTFT (ms)"),
        ("tpot_median_ms", "median TPOT (ms)"),
    )
    offered = [(i, float(r)) for i, r in enumerate(order) if r != "inf"]
    if offered:
        axes[0].plot(*zip(*offered), linestyle="--", color="grey", label="offered")
    for ax, (key, label) in zip(axes, panels):
        for setup in setups:
            rates = setup["saturation"]["rates"]
            where = setup["saturation"]["saturates_at_req_s"]
            name = f"{setup['setup']} (saturates at {where} req/s)" if where else setup["setup"]
            ax.plot(
                [order.index(r["request_rate"]) for r in rates],
                [_number(r[key]) for r in rates],
                marker="o",
                label=name,
            )
        ax.set(xticks=range(len(order)), xticklabels=order, xlabel="offered request rate (req/s)", ylabel=label)
        if key == "ttft_p99_ms":
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def _span_rate(times: list[float]) -> float | None:
    """Events per second between the first and the last of `times`; None for fewer than two or no span."""
    if len(times) < 2 or max(times) == min(times):
        return None
    return (len(times) - 1) / (max(times) - min(times))


def _number(value: float | None) -> float:
    return math.nan if value is None else value
