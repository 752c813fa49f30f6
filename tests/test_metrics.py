"""Serving metrics against a trace whose every number is worked out by hand, and against a real CPU run."""

from __future__ import annotations

import math
from dataclasses import astuple

import pytest

from exlnb import EosReason, Stage, StreamEvent
from exlnb.metrics import request_record, serving_metrics
from exlnb.templates import chatml


def event(job_id: int, at: float, tokens: int = 0, *, enqueued: float, prompt: int, eos: EosReason | None = None):
    return StreamEvent(
        job_id=job_id,
        stage=Stage.DONE if eos else Stage.DECODE,
        time_produced=at,
        token_ids=tuple(range(tokens)),
        eos=eos is not None,
        eos_reason=eos,
        prompt_tokens=prompt,
        time_enqueued=enqueued,
    )


def trace() -> list:
    """Four requests over a run of 1 s:

    A: submitted 10.0; a prefill event with no token at 10.05, then one token each at 10.2, 10.3, 10.45, 10.5
       -> 4 tokens, TTFT 200 ms, E2EL 500 ms, TPOT (500 - 200) / 3 = 100 ms, ITLs 100, 150, 50 ms.
    B: submitted 10.1 by the caller's clock (the engine stamped 10.15); chunks of 2, 1 and 3 tokens at 10.4,
       10.6, 10.9 -> 6 tokens, TTFT 300 ms, E2EL 800 ms, TPOT 500 / 5 = 100 ms, ITLs (per chunk) 200, 300 ms.
    C: submitted 10.2; one token at 10.6 -> TTFT 400 ms, E2EL 400 ms, no TPOT, no ITL.
    D: submitted 10.3; a token at 10.7, cancelled at 10.8 -> failed, left out of every statistic.
    """
    a = [
        event(1, 10.05, enqueued=10.0, prompt=5),
        event(1, 10.2, 1, enqueued=10.0, prompt=5),
        event(1, 10.3, 1, enqueued=10.0, prompt=5),
        event(1, 10.45, 1, enqueued=10.0, prompt=5),
        event(1, 10.5, 1, enqueued=10.0, prompt=5, eos=EosReason.MAX_NEW_TOKENS),
    ]
    b = [
        event(2, 10.4, 2, enqueued=10.15, prompt=7),
        event(2, 10.6, 1, enqueued=10.15, prompt=7),
        event(2, 10.9, 3, enqueued=10.15, prompt=7, eos=EosReason.MAX_NEW_TOKENS),
    ]
    c = [event(3, 10.6, 1, enqueued=10.2, prompt=3, eos=EosReason.MAX_NEW_TOKENS)]
    d = [event(4, 10.7, 1, enqueued=10.3, prompt=4), event(4, 10.8, enqueued=10.3, prompt=4, eos=EosReason.CANCELLED)]
    return [request_record(a), request_record(b, submitted_at=10.1), request_record(c), request_record(d)]


def test_per_request_ttft_tpot_itl_and_latency_match_the_hand_computed_trace():
    a, b, c, d = trace()

    assert (a.output_tokens, a.prompt_tokens) == (4, 5)
    assert a.ttft_s == pytest.approx(0.2)
    assert a.e2e_latency_s == pytest.approx(0.5)
    assert a.tpot_s == pytest.approx(0.1)
    assert a.itl_s == pytest.approx((0.1, 0.15, 0.05))

    assert b.output_tokens == 6
    assert b.submitted_at == 10.1  # the caller's clock, not the engine's stamp
    assert (b.ttft_s, b.e2e_latency_s, b.tpot_s) == pytest.approx((0.3, 0.8, 0.1))
    assert b.itl_s == pytest.approx((0.2, 0.3))  # one gap per chunk: 2 gaps for 6 tokens

    assert (c.output_tokens, c.ttft_s, c.e2e_latency_s, c.tpot_s, c.itl_s) == (
        1,
        pytest.approx(0.4),
        pytest.approx(0.4),
        None,
        (),
    )
    assert a.succeeded and b.succeeded and c.succeeded and not d.succeeded


def test_summary_statistics_match_the_hand_computed_trace():
    m = serving_metrics(trace(), duration_s=1.0)

    assert (m.successful_requests, m.failed_requests) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (15, 11)  # 5 + 7 + 3 and 4 + 6 + 1
    assert (m.request_throughput, m.output_token_throughput, m.total_token_throughput) == pytest.approx((3, 11, 26))
    # TTFT 200, 300, 400 ms: population std sqrt((100² + 0 + 100²) / 3); p90 at rank 1.8 -> 300 + 0.8 * 100
    assert astuple(m.ttft_ms) == pytest.approx((3, 300, 300, math.sqrt(20000 / 3), 380, 398))
    # TPOT of A and B only: C has a single token
    assert astuple(m.tpot_ms) == pytest.approx((2, 100, 100, 0, 100, 100))
    # ITL pooled over requests: 100, 150, 50, 200, 300 ms; deviations from 160: -60 -10 -110 40 140
    assert astuple(m.itl_ms) == pytest.approx((5, 160, 150, math.sqrt(37000 / 5), 260, 296))
    # E2EL 500, 800, 400 ms: mean 1700/3, deviations -200/3 700/3 -500/3; p90 at rank 1.8 of 400 500 800
    assert astuple(m.e2el_ms) == pytest.approx((3, 1700 / 3, 500, math.sqrt(780000 / 9 / 3), 740, 794))
    assert m.goodput is None


def test_goodput_counts_requests_meeting_every_objective():
    # TTFT <= 350 ms and TPOT <= 120 ms: A and B (C's TTFT is 400 ms)
    m = serving_metrics(trace(), duration_s=2.0, slos={"ttft_ms": 350, "tpot_ms": 120})
    assert (m.goodput.good_requests, m.goodput.fraction, m.goodput.rate) == (2, pytest.approx(2 / 3), 1.0)

    # a one-token request's TPOT counts as 0, as in vLLM: only C meets TPOT <= 1 ms and E2EL <= 450 ms
    m = serving_metrics(trace(), duration_s=2.0, slos={"tpot_ms": 1, "e2el_ms": 450})
    assert m.goodput.good_requests == 1


def test_an_empty_statistic_is_nan_not_zero():
    _, _, c, _ = trace()
    m = serving_metrics([c], duration_s=1.0)
    assert m.tpot_ms.n == 0 and math.isnan(m.tpot_ms.mean) and math.isnan(m.itl_ms.p99)


@pytest.mark.parametrize(
    ("slos", "message"),
    [({"ttft": 500}, r"unknown SLO \['ttft'\]: use ttft_ms, tpot_ms, e2el_ms"), ({"tpot_ms": 0}, "tpot_ms=0")],
)
def test_bad_objectives_are_clear_errors(slos, message):
    with pytest.raises(ValueError, match=message):
        serving_metrics(trace(), duration_s=1.0, slos=slos)


def test_the_table_has_vllm_lines():
    table = serving_metrics(trace(), duration_s=1.0, slos={"ttft_ms": 350}).table()
    for line in (
        "Successful requests:                     3",
        "Mean TTFT (ms):                          300.00",
        "P99 ITL (ms):                            296.00",
        "Request goodput (req/s):                 2.00",
    ):
        assert line in table


def test_a_real_run_adds_up(idle_session, greedy):
    stream = idle_session.generate(chatml("Name a colour."), max_new_tokens=6, sampler=greedy, stop_at_eos=False)
    stream.result()
    record = request_record(stream.events)

    assert record.output_tokens == 6 == stream.events[-1].new_tokens
    assert len(record.itl_s) == record.output_tokens - 1  # one token per event on the CPU engine
    assert sum(record.itl_s) == pytest.approx(record.e2e_latency_s - record.ttft_s)
    assert record.tpot_s == pytest.approx(sum(record.itl_s) / 5)
    assert record.ttft_s == pytest.approx(stream.events[-1].time_to_first_token_s, abs=0.005)
    assert 0 < record.ttft_s <= record.e2e_latency_s
