"""The step clock's accounting (exlnb/engines/step_clock.py): a graphed decode step's wall time split into the
graph's GPU time, the GPU's gap after it and the host's phases. The events come from CUDA; the arithmetic over
their readings runs everywhere."""

from __future__ import annotations

import pytest

from exlnb.engines.step_clock import PHASES, StepTimes, account


def test_each_step_splits_into_the_host_phases_that_add_up_to_its_wall_time():
    # asked, returned, tokens handed over, next step queued (seconds): 2 ms a step
    steps = [
        StepTimes(0.000, 0.0001, 0.0015, 0.0017, ahead=False),
        StepTimes(0.002, 0.00205, 0.0035, 0.0037, ahead=True),
        StepTimes(0.004, 0.00405, 0.0055, None, ahead=True),
    ]

    got = account(steps, graph_ms=[1.6, 1.7, 1.7], gap_ms=[0.3, 0.4])

    assert got["steps"] == 2 and got["wall_ms"] == pytest.approx(2.0)
    host = got["host_ms"]
    assert list(host) == list(PHASES)
    assert host["forward"] == pytest.approx((0.1 + 0.05) / 2)
    assert host["sample_and_wait"] == pytest.approx((1.4 + 1.45) / 2)
    assert host["queue"] == pytest.approx(0.2)
    assert sum(host.values()) == pytest.approx(got["wall_ms"])  # nothing of a step is left out
    assert got["graph_ms"] == pytest.approx(1.65) and got["gpu_gap_ms"] == pytest.approx(0.35)
    assert got["queued_ahead"] == 1.0


def test_a_step_nothing_was_queued_after_counts_its_bookkeeping_from_the_tokens():
    steps = [StepTimes(0.0, 0.001, 0.002), StepTimes(0.003, 0.004, 0.005)]

    host = account(steps, graph_ms=[1.0], gap_ms=[])["host_ms"]

    assert host == pytest.approx({"forward": 1.0, "sample_and_wait": 1.0, "queue": 0.0, "bookkeeping": 1.0})
    assert account(steps[:1], [], []) == {"steps": 1}


def test_a_replay_without_a_clock_records_nothing():
    from exlnb.engines.step_clock import timed_replay

    with timed_replay(None, "cpu"):
        pass  # no clock: no CUDA event, no device switch, so it runs where there is no GPU
