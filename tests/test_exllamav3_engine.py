"""ExLlamaV3 engine checks that only make sense on a GPU (`pytest -m gpu`).

The engine-level acceptance (tests/test_session.py) runs on this engine too, through `engine_session`.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from benchmarks.paged_acceptance import QUESTIONS, answers_alone, answers_together, shared_prompt_pages
from exlnb import EosReason, SamplerSettings, get_session
from exlnb.engines.base import LOOP_DETECTOR
from exlnb.engines.job_options import JobOptions
from exlnb.models import resolve_model
from exlnb.session import LoadFailed, Session
from exlnb.templates import chatml
from tests.helpers import skip_without_library
from tests.test_session import max_overlap

pytestmark = pytest.mark.gpu

LOOPING = "Write a chant for a football team."  # greedy, no penalty: "The team of the team of ..." on the CPU engine


@pytest.fixture(scope="module")
def exl3_session():
    skip_without_library("exllamav3")
    session = get_session()
    session.load("smollm2-135m-instruct", engine="exllamav3", progress=False)
    return session


def test_status_names_the_library_and_its_version(exl3_session):
    status = exl3_session.status()
    assert status.engine == "exllamav3" and status.library == "exllamav3 1.6.5"
    assert "exllamav3 engine (exllamav3 1.6.5)" in status.line()
    assert status.paged and status.device_memory_bytes > 0


def test_sixteen_prompts_together_equal_each_alone(exl3_session):
    alone = [r.text for r in answers_alone(exl3_session, QUESTIONS, 48)]
    streams = answers_together(exl3_session, QUESTIONS, 48)

    assert [s.result().text for s in streams] == alone
    assert max_overlap(streams) >= 8  # they ran batched, not one after another


def test_jobs_with_the_same_long_prompt_share_its_pages(exl3_session):
    sharing = shared_prompt_pages(exl3_session)

    assert sharing["shared_pages_while_both_run"] >= 2
    assert all(p["ref_count"] == 2 and len(p["owners"]) == 2 for p in sharing["shared_pages"])
    assert sharing["cached_tokens"][2] >= 2 * sharing["page_size"]
    view = exl3_session.cache_view()
    assert view.free_pages == view.total_pages and view.defrag_count is not None


def test_the_loop_detector_ends_a_looping_job(exl3_session):
    greedy = SamplerSettings.greedy()
    spec = exl3_session.spec_for(chatml(LOOPING), JobOptions(max_new_tokens=400, sampler=greedy))
    plain = exl3_session.submit(spec).result()
    guarded = exl3_session.submit(replace(spec, stop_on_loop=LOOP_DETECTOR)).result()

    if plain.eos_reason is not EosReason.MAX_NEW_TOKENS:
        pytest.skip(
            f"the prompt did not loop on this engine ({plain.eos_reason.value} after {plain.new_tokens} tokens)"
        )
    assert guarded.eos_reason is EosReason.LOOP_DETECTED
    assert guarded.new_tokens < plain.new_tokens
    assert plain.token_ids[: guarded.new_tokens] == guarded.token_ids


def test_loop_guard_is_exllamav3s_own_loop_detector_there(exl3_session):
    from exlnb.generation import start

    greedy = dict(
        temperature=0, rep_penalty=1.0, max_new_tokens=400
    )  # no penalty: the kit's default 1.025 breaks the loop
    plain = start(chatml(LOOPING), template="raw", **greedy).wait(120)[0]
    guarded = start(chatml(LOOPING), template="raw", loop_guard=True, **greedy).wait(120)[0]

    if plain.eos_reason is not EosReason.MAX_NEW_TOKENS:
        pytest.skip(
            f"the prompt did not loop on this engine ({plain.eos_reason.value} after {plain.new_tokens} tokens)"
        )
    assert guarded.eos_reason is EosReason.LOOP_DETECTED  # ended by the engine, not cancelled by exlnb's check
    assert plain.token_ids[: guarded.new_tokens] == guarded.token_ids


def test_a_setting_exllamav3_lacks_is_refused_at_submit(exl3_session):
    spec = exl3_session.spec_for(chatml(QUESTIONS[0]), JobOptions(max_new_tokens=4))
    with pytest.raises(ValueError, match="the exllamav3 engine has no mirostat=True"):
        exl3_session.submit(replace(spec, sampler=SamplerSettings(mirostat=True)))
    assert exl3_session.jobs() == []


def test_every_planned_step_exists_in_exllamav3(exl3_session):
    from exllamav3.generator.sampler import CustomSampler

    from exlnb.engines.exllamav3.engine import build_sampler

    tokenizer = exl3_session.tokenizer
    every_mapped = SamplerSettings(
        min_p=0.1,
        token_presence_penalty=0.5,
        token_bias={5: 1.0, 6: float("-inf")},
        dry_multiplier=0.8,
        dry_range=64,
        dry_sequence_breakers={":"},
        xtc_probability=0.5,
        temperature_last=True,
    )
    for settings in (
        SamplerSettings(),
        SamplerSettings.greedy(),
        every_mapped,
        SamplerSettings(dry_multiplier=0.8),
        SamplerSettings.greedy(dry_multiplier=0.8, token_bias={5: 1.0}),
    ):
        assert isinstance(build_sampler(settings, tokenizer, tokenizer.vocab_size), CustomSampler)


def test_the_concurrency_investigation_reports_that_exllamav3_refuses_a_generator_per_request(exl3_session):
    from exlnb.experiments import concurrency

    result = concurrency.run(exl3_session, prompts=2, max_new_tokens=8, concurrency=(2,))

    assert result.values["refused"]["generator per request"].startswith(
        "exllamav3 1.6.5 refuses a generator per request"
    )
    assert result.values["identical_to_solo"] == {"one generator": 2}
    assert exl3_session.jobs() == [] and exl3_session.cache_view().free_pages == exl3_session.cache_view().total_pages
    concurrency.plot(result)


def test_an_architecture_exllamav3_does_not_know_is_a_clear_error(tmp_path):
    skip_without_library("exllamav3")
    bundled = resolve_model("smollm2-135m-instruct")
    for item in bundled.iterdir():
        (tmp_path / item.name).symlink_to(item)
    config = json.loads((bundled / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["NotAModelForCausalLM"]}))
    with pytest.raises(LoadFailed, match="exllamav3 1.6.5 cannot load .* NotAModelForCausalLM"):
        Session().load(str(tmp_path), engine="exllamav3", progress=False)
