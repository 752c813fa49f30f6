"""The latency investigation on more than one model: the session's own on the real CPU engine, the 7B-shaped one
said not timed where there is no CUDA, and on a GPU (`pytest -m gpu`) the same requests on the 7B-shaped
model with a cache of as many pages."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from exlnb.experiments.latency import plot, run

SMALL = dict(requests=4, tokens_read=2, max_new_tokens=12, next_job_tokens=4, trials=1, sample_interval_s=0.05)


@pytest.fixture(scope="module")
def small_cache_session(cpu_session):
    """The notebook's cache: 4 pages of 256 tokens, one per request, loaded once for this file's tests; the
    bundled model's own cache is put back after them (each load packs the model's weights afresh, about a second)."""
    cpu_session.load("smollm2-135m-instruct", engine="cpu", cache_tokens=1024, progress=False)
    yield cpu_session
    cpu_session.load("smollm2-135m-instruct", engine="cpu", progress=False)


def test_the_session_model_is_timed_and_the_7b_shaped_one_said_not_timed_without_cuda(small_cache_session):
    result = run(small_cache_session, **SMALL)

    assert {name: set(table.model) for name, table in result.tables.items()} == {
        "requests": {"bundled"},
        "timeline": {"bundled"},
        "state": {"bundled"},
        "pages": {"bundled"},
    }
    assert result.values["not_timed"] == [
        "7b-shaped: the 7B-shaped model is made and run on CUDA: this machine has none; its requests were not timed."
    ]
    assert result.findings[-1] == result.values["not_timed"][0]
    # the session's model keeps the effect names earlier runs gave it, so runs can be compared across versions
    assert [e.name for e in result.effects] == [
        "next job (4 tokens, read to the end) after 4 requests, median of 1 trials",
        "request latency (time to 2 tokens), mean of 4 requests x 1 trials",
    ]
    assert result.values["total_pages"] == result.values["by_model"]["bundled"]["total_pages"] == 4
    assert result.values["jobs_left_when_consumers_gone"]["cancelled"] == 0
    plt.close(plot(result))


def test_with_no_model_it_can_time_the_result_says_why_and_draws_no_figure(small_cache_session):
    result = run(small_cache_session, **SMALL, models=("7b-shaped",))

    assert result.effects == [] and result.tables["requests"].empty
    assert result.findings == result.values["not_timed"]
    assert any("made and run on CUDA" in line for line in result.findings)
    assert plot(result) is None  # a figure with nothing to show is left out; the findings say why


def test_an_unknown_model_is_refused_before_anything_runs(small_cache_session):
    before = len(small_cache_session.jobs())
    with pytest.raises(ValueError, match="no model '70b' to time: choose from bundled, 7b-shaped"):
        run(small_cache_session, **SMALL, models=("bundled", "70b"))
    assert len(small_cache_session.jobs()) == before


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["exllamav2", "exllamav3"])
def test_on_cuda_the_7b_shaped_model_runs_the_same_requests_over_as_many_pages(engine):
    from exlnb.random_model import cannot_make_here
    from exlnb.session import get_session
    from tests.helpers import skip_without_library

    skip_without_library(engine)
    if reason := cannot_make_here():
        pytest.skip(reason)
    session = get_session()
    session.load("smollm2-135m-instruct", engine=engine, cache_tokens=1024, progress=False)

    # 120 tokens a job: with 12, an H200 decoding the 7B-shaped model from CUDA graphs at 5.7 ms a token had
    # finished every abandoned job before the look, and the un-cancelled condition found nothing left to hold
    result = run(session, **(SMALL | {"max_new_tokens": 120}))

    assert result.values["not_timed"] == []
    seven_b = result.values["by_model"]["7b-shaped"]
    assert seven_b["total_pages"] == result.values["total_pages"] == 4
    # without the cancel the 7B-shaped model's abandoned jobs hold pages when the consumers have gone; with it none
    assert seven_b["pages_held_when_consumers_gone"]["un-cancelled"] > 0
    assert seven_b["jobs_left_when_consumers_gone"]["cancelled"] == 0
    assert [e.name for e in result.effects][2:] == [
        "7b-shaped model, next job (4 tokens, read to the end) after 4 requests, median of 1 trials",
        "7b-shaped model, request latency (time to 2 tokens), mean of 4 requests x 1 trials",
    ]
    assert any(line.startswith("7b-shaped model (random weights") for line in result.findings)
