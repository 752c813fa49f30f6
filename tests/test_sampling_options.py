"""The whole exllamav2 sampler and the job options, end to end with the bundled model: on the CPU engine, and
on the ExLlamaV2 and ExLlamaV3 engines with `pytest -m gpu` (ExLlamaV3 refuses, by name, what exllamav3 lacks)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from exlnb import EosReason, SamplerSettings
from exlnb.engines.base import JobSpec
from exlnb.engines.exllamav2.engine import ExLlamaV2Engine
from exlnb.engines.exllamav3 import sampler as exllamav3_sampler
from exlnb.engines.job_options import JobOptions
from exlnb.templates import chatml

QUESTION = chatml("What is the capital of France?")
PLAIN = SamplerSettings(temperature=1.0, top_k=0, top_p=1.0, token_repetition_penalty=1.0)  # the bare softmax
HOT = replace(PLAIN, temperature=2.0, min_p=0.1)


def sample(session, settings: SamplerSettings, prompt=QUESTION, **spec_options):
    spec = replace(session.spec_for(prompt, JobOptions(max_new_tokens=10, sampler=settings, seed=3)), **spec_options)
    return session.submit(spec).result()


def refused_on(engine_name: str, settings: SamplerSettings) -> list[str]:
    """What `engine_name` refuses of `settings`, from the engine module's own list: the CPU and ExLlamaV2 engines
    implement every setting, the ExLlamaV3 engine those exllamav3 has a step for."""
    return exllamav3_sampler.refused_settings(settings) if engine_name == "exllamav3" else []


@pytest.mark.parametrize(
    ("base", "change"),
    [
        (PLAIN, dict(top_a=0.5)),
        (PLAIN, dict(tfs=0.5)),
        (PLAIN, dict(typical=0.3)),
        (PLAIN, dict(smoothing_factor=3.0)),
        (PLAIN, dict(min_temp=0.2, max_temp=0.5)),
        (PLAIN, dict(skew=3.0)),
        (PLAIN, dict(mirostat=True, mirostat_tau=1.0)),
        (PLAIN, dict(xtc_probability=1.0, xtc_threshold=0.05)),
        (PLAIN, dict(token_bias="ban the first token")),  # whichever token the plain run starts with
        (HOT, dict(temperature_last=True)),
    ],
    ids=lambda v: "" if isinstance(v, SamplerSettings) else ",".join(v),
)
def test_each_setting_changes_seeded_sampling(engine_name, idle_session, base, change):
    before = sample(idle_session, base)
    if change.get("token_bias") == "ban the first token":  # each engine's RNG draws its own first token
        change = dict(token_bias={before.token_ids[0]: float("-inf")})
    changed = replace(base, **change)
    refused = refused_on(engine_name, changed)
    if refused:  # refused with the one message that names each, never ignored
        assert all(item.startswith(tuple(change)) for item in refused)
        with pytest.raises(ValueError, match=f"^the {engine_name} engine has no ") as error:
            sample(idle_session, changed)
        assert all(item in str(error.value) for item in refused)
        assert idle_session.jobs() == []
        return
    after = sample(idle_session, changed)
    assert after.token_ids != before.token_ids


def test_dry_breaks_a_greedy_repeat(engine_name, idle_session, greedy):
    assert refused_on(engine_name, replace(greedy, dry_multiplier=2.0)) == []
    ids = idle_session.tokenizer.encode("one two three four five one two three four five one two three")
    plain = idle_session.complete(ids, max_new_tokens=6, sampler=greedy, stop_at_eos=False)
    dry = idle_session.complete(ids, max_new_tokens=6, sampler=replace(greedy, dry_multiplier=2.0), stop_at_eos=False)
    assert "five one two" in plain.text
    assert "five one two" not in dry.text


def test_a_token_bias_outside_the_vocabulary_is_refused_in_one_line(idle_session):
    vocab_size = idle_session.tokenizer.vocab_size
    with pytest.raises(ValueError, match=rf"^token ids \[{vocab_size + 7}\] are outside the vocabulary"):
        sample(idle_session, replace(PLAIN, token_bias={3: 1.0, vocab_size + 7: 1.0}))
    assert idle_session.jobs() == []


def test_banned_strings_never_appear_in_the_output(idle_session, greedy):
    assert "Paris" in idle_session.complete(QUESTION, max_new_tokens=12, sampler=greedy).text
    result = sample(idle_session, greedy, banned_strings=("paris",), max_new_tokens=30)

    assert "paris" not in result.text.lower()
    assert result.eos_reason is EosReason.STOP_TOKEN
    assert idle_session.tokenizer.decode(result.token_ids[:-1]) == result.text  # the taken-back tokens are gone


def test_min_new_tokens_holds_back_the_stop_token(idle_session, greedy):
    short = sample(idle_session, greedy, max_new_tokens=20)
    assert short.eos_reason is EosReason.STOP_TOKEN and short.new_tokens < 12

    longer = sample(idle_session, greedy, max_new_tokens=20, min_new_tokens=12)
    assert longer.new_tokens >= 12
    assert longer.text.startswith(short.text)


def test_stop_on_loop_ends_a_job_that_only_repeats(cpu_session, greedy):
    ids = cpu_session.tokenizer.encode("a b c a b c a b c a b c")
    result = sample(
        cpu_session, greedy, prompt=ids, max_new_tokens=60, stop_on_loop=(12, 3), stop_token_ids=frozenset()
    )
    assert result.eos_reason is EosReason.LOOP_DETECTED
    assert result.new_tokens < 60


def test_an_engine_refuses_what_it_does_not_implement():
    engine = object.__new__(ExLlamaV2Engine)  # no GPU needed to ask what it supports
    with pytest.raises(ValueError, match=r"the exllamav2 engine does not implement stop_on_loop=\(300, 3\)"):
        engine.refuse_unsupported(JobSpec(input_ids=(1,), stop_on_loop=(300, 3)))
    engine.refuse_unsupported(JobSpec(input_ids=(1,), sampler=SamplerSettings(dry_multiplier=0.8, xtc_probability=0.5)))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(top_k=2.5), "top_k=2.5 has the wrong type: it must be an integer"),
        (dict(mirostat=1), "mirostat=1 has the wrong type: it must be True or False"),
        (dict(typical=1.5), r"typical=1.5 is out of range"),
        (dict(dry_range=10), r"dry_range=10 is out of range: it must be 0 \(everything\) or more than dry_max_ngram"),
        (dict(token_bias={3: "a lot"}), "token_bias=.* must map token ids to numbers"),
    ],
)
def test_settings_refuse_wrong_values_in_one_line(settings, message):
    with pytest.raises((TypeError, ValueError), match=message):
        SamplerSettings(**settings)


def test_settings_with_collections_stay_hashable():
    a = SamplerSettings(token_bias={7: -1, 3: 2.0}, dry_sequence_breakers=["\n", ":"])
    b = SamplerSettings(token_bias=((3, 2.0), (7, -1.0)), dry_sequence_breakers=frozenset({":", "\n"}))
    assert a == b and hash(a) == hash(b)


def test_job_options_are_checked_where_they_enter():
    with pytest.raises(ValueError, match="min_new_tokens=5 must be between 0 and max_new_tokens"):
        JobSpec(input_ids=(1,), max_new_tokens=4, min_new_tokens=5)
    with pytest.raises((TypeError, ValueError), match="banned_strings"):
        JobSpec(input_ids=(1,), banned_strings="Paris")
