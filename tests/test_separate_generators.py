"""Field report 2's mistake on purpose: `Engine.run_with_separate_generators`, a generator per request over
one cache, on the real bundled model (CPU engine here, ExLlamaV2 with `pytest -m gpu`)."""

from __future__ import annotations

import pytest

from exlnb.engines.base import JobSpec
from tests.conftest import chatml

# two prompts longer than a 256-token page, alike in shape, different in every token that matters
STORIES = {
    "numbers": " ".join(f"Fact {i}: the number {i} follows {i - 1}." for i in range(1, 40)),
    "colours": " ".join(f"Note {i}: the colour of box {i} is {c}." for i, c in enumerate(["red", "blue", "green"] * 13)),
}


def prompt(story: str) -> str:
    return chatml(f"{STORIES[story]}\nWhat is this text about?")


def spec(session, story: str, greedy) -> JobSpec:
    return JobSpec(input_ids=tuple(session.tokenizer.encode(prompt(story))), max_new_tokens=8, sampler=greedy)


def test_a_generator_per_request_mixes_outputs_that_one_generator_keeps_apart(idle_session, greedy):
    solo = [idle_session.complete(prompt(story), max_new_tokens=8, sampler=greedy).token_ids for story in STORIES]
    specs = [spec(idle_session, story, greedy) for story in STORIES]

    mixed = idle_session.run_on_engine(lambda engine: engine.run_with_separate_generators(specs))

    assert [len(ids) for ids in mixed] == [8, 8]
    assert mixed != solo


def test_the_engine_forgets_overwritten_cache_pages_and_runs_on_as_before(idle_session, greedy):
    before = idle_session.complete(prompt("numbers"), max_new_tokens=8, sampler=greedy)
    overwriting = [spec(idle_session, "colours", greedy), spec(idle_session, "colours", greedy)]

    idle_session.run_on_engine(lambda engine: engine.run_with_separate_generators(overwriting))
    after = idle_session.complete(prompt("numbers"), max_new_tokens=8, sampler=greedy)
    again = idle_session.complete(prompt("numbers"), max_new_tokens=8, sampler=greedy)

    assert after.cached_tokens == 0  # the page it had cached holds another prompt's keys now
    assert after.token_ids == before.token_ids
    assert again.cached_tokens >= 256  # prefix caching works as before
    view = idle_session.cache_view()
    assert view.free_pages == view.total_pages


def test_separate_generators_refuse_to_run_over_running_jobs(idle_session, greedy):
    specs = [spec(idle_session, "colours", greedy)]
    stream = idle_session.generate(prompt("numbers"), max_new_tokens=200, sampler=greedy)

    with pytest.raises(RuntimeError, match="jobs running"):
        idle_session.run_on_engine(lambda engine: engine.run_with_separate_generators(specs))
    stream.cancel()
