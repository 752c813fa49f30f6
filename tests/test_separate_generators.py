"""Field report 2's mistake on purpose: `Engine.run_with_separate_generators`, a generator per request over
one cache, on the real bundled model (CPU engine here, ExLlamaV2 and ExLlamaV3 with `pytest -m gpu`).
exllamav3 1.6.5 refuses the pattern itself: a Generator made over the cache takes it from the older ones."""

from __future__ import annotations

import pytest

from exlnb.engines.base import JobSpec, SeparateGeneratorsRefused
from exlnb.templates import chatml

# two prompts longer than a 256-token page, alike in shape, different in every token that matters
STORIES = {
    "numbers": " ".join(f"Fact {i}: the number {i} follows {i - 1}." for i in range(1, 40)),
    "colours": " ".join(
        f"Note {i}: the colour of box {i} is {c}." for i, c in enumerate(["red", "blue", "green"] * 13)
    ),
}


def prompt(story: str) -> str:
    return chatml(f"{STORIES[story]}\nWhat is this text about?")


def spec(session, story: str, greedy) -> JobSpec:
    return JobSpec(input_ids=tuple(session.tokenizer.encode(prompt(story))), max_new_tokens=8, sampler=greedy)


def run_separately(session, specs, engine_name: str):
    """The generator-per-request run; on exllamav3, the library's refusal, checked (None then)."""
    if engine_name != "exllamav3":
        return session.run_on_engine(lambda engine: engine.run_with_separate_generators(specs))
    with pytest.raises(
        SeparateGeneratorsRefused, match="^exllamav3 1.6.5 refuses a generator per request: .*no longer owns its Cache"
    ):
        session.run_on_engine(lambda engine: engine.run_with_separate_generators(specs))
    assert session.jobs() == []
    return None


@pytest.mark.slow  # every prompt alone, then through one generator and through one per request
def test_a_generator_per_request_mixes_outputs_that_one_generator_keeps_apart(engine_name, idle_session, greedy):
    solo = [idle_session.complete(prompt(story), max_new_tokens=8, sampler=greedy).token_ids for story in STORIES]
    specs = [spec(idle_session, story, greedy) for story in STORIES]

    mixed = run_separately(idle_session, specs, engine_name)

    if mixed is None:  # exllamav3: refused, and the engine's own generator gives the solo outputs again
        assert [
            idle_session.complete(prompt(story), max_new_tokens=8, sampler=greedy).token_ids for story in STORIES
        ] == solo
        return
    assert [len(ids) for ids in mixed] == [8, 8]
    assert mixed != solo


def test_the_engine_forgets_overwritten_cache_pages_and_runs_on_as_before(engine_name, idle_session, greedy):
    before = idle_session.complete(prompt("numbers"), max_new_tokens=8, sampler=greedy)
    overwriting = [spec(idle_session, "colours", greedy), spec(idle_session, "colours", greedy)]

    run_separately(idle_session, overwriting, engine_name)
    after = idle_session.complete(prompt("numbers"), max_new_tokens=8, sampler=greedy)
    again = idle_session.complete(prompt("numbers"), max_new_tokens=8, sampler=greedy)

    assert after.cached_tokens == 0  # the page it had cached holds another prompt's keys now
    assert after.token_ids == before.token_ids
    assert again.cached_tokens >= 256  # prefix caching works as before
    view = idle_session.cache_view()
    assert view.free_pages == view.total_pages


def test_separate_generators_step_their_own_jobs_while_the_engine_s_bound_step_is_set_on_it(
    engine_name, idle_session, greedy
):
    """pytest before 9.2, undoing a patched `step`, set the engine's bound `step` back on the instance (pytest
    #10644); separate generators copied it and stepped the engine instead of themselves, never ending (the GPU
    suite stalled on it)."""
    engine = idle_session.engine
    vars(engine)["step"] = engine.step
    try:
        mixed = run_separately(idle_session, [spec(idle_session, story, greedy) for story in STORIES], engine_name)
    finally:
        vars(engine).pop("step")

    assert mixed is None or [len(ids) for ids in mixed] == [8, 8]  # None: exllamav3 refused, as it does


def test_separate_generators_refuse_to_run_over_running_jobs(idle_session, greedy):
    specs = [spec(idle_session, "colours", greedy)]
    stream = idle_session.generate(prompt("numbers"), max_new_tokens=200, sampler=greedy)

    with pytest.raises(RuntimeError, match="jobs running"):
        idle_session.run_on_engine(lambda engine: engine.run_with_separate_generators(specs))
    stream.cancel()


def test_a_refused_pattern_is_reported_with_the_libraries_words_and_not_measured(cpu_session, monkeypatch):
    """The concurrency investigation on an engine whose library refuses the pattern (exllamav3's, on the GPU):
    here the CPU engine is made to refuse, so the reporting runs in CI."""
    from exlnb.experiments import concurrency

    def refuse(specs):
        raise SeparateGeneratorsRefused("the library refuses a generator per request: a newer one owns the cache")

    engine = cpu_session.run_on_engine(lambda engine: engine)
    monkeypatch.setattr(engine, "run_with_separate_generators", refuse)
    result = concurrency.run(cpu_session, prompts=2, max_new_tokens=4, concurrency=(2,))

    assert result.values["refused"] == {
        "generator per request": "the library refuses a generator per request: a newer one owns the cache"
    }
    assert result.values["identical_to_solo"] == {"one generator": 2}
    assert set(result.tables["runs"].pattern) == {"solo", "one generator"}
    assert result.effects == []
    assert any("did not run: the library refuses" in line for line in result.findings)
    concurrency.plot(result)
