"""SamplerSettings planned as exllamav3 sampler steps: checked on the CPU, without exllamav3 installed."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields, replace

import pytest

from exlnb.engines import vocab
from exlnb.engines.base import JobSpec, SamplerSettings
from exlnb.engines.exllamav3.engine import ExLlamaV3Engine
from exlnb.engines.exllamav3.sampler import MAPPED_FIELDS, WHOLE_SEQUENCE, Step, refused_settings, sampler_steps
from exlnb.engines.tokenizer import HfTokenizer
from exlnb.models import resolve_model

PLAIN = SamplerSettings(temperature=1.0, top_k=0, top_p=1.0, token_repetition_penalty=1.0)

# a non-default value for every setting exllamav3 has no step for
UNMAPPED = dict(
    top_a=0.5,
    tfs=0.5,
    typical=0.3,
    smoothing_factor=3.0,
    min_temp=0.2,
    max_temp=0.5,
    temp_exponent=2.0,
    skew=3.0,
    mirostat=True,
    mirostat_tau=1.0,
    mirostat_eta=0.2,
    dry_max_ngram=30,
)


@pytest.fixture(scope="module")
def tokenizer() -> HfTokenizer:
    return HfTokenizer(resolve_model("smollm2-135m-instruct", progress=False))


def names(settings: SamplerSettings, tokenizer: HfTokenizer | None = None) -> list[str]:
    return [step.name for step in sampler_steps(settings, tokenizer, tokenizer.vocab_size if tokenizer else 0)]


def step(settings: SamplerSettings, name: str, tokenizer: HfTokenizer) -> Step:
    return next(s for s in sampler_steps(settings, tokenizer, tokenizer.vocab_size) if s.name == name)


def test_greedy_is_argmax_after_no_penalties():
    assert sampler_steps(SamplerSettings.greedy()) == (Step("SS_Argmax"),)


def test_a_temperature_below_one_hundredth_is_greedy_as_in_exllamav2():
    assert names(SamplerSettings(temperature=0.005, token_repetition_penalty=1.0)) == ["SS_Argmax"]


def test_default_settings_keep_exllamav2_order():
    steps = sampler_steps(SamplerSettings())
    assert steps == (
        Step("SS_RepP", (1.025, WHOLE_SEQUENCE, 0)),
        Step("SS_Temperature", (0.8,)),
        Step("SS_TopK", (50,)),
        Step("SS_TopP", (0.8,)),
        Step("SS_Sample"),
    )


def test_min_p_comes_after_top_k_and_top_p():
    assert names(SamplerSettings(min_p=0.1))[-2:] == ["SS_MinP", "SS_Sample"]


def test_disabled_filters_add_no_steps():
    settings = SamplerSettings(top_k=0, top_p=1.0, min_p=0.0, token_repetition_penalty=1.0)
    assert names(settings) == ["SS_Temperature", "SS_Sample"]


def test_dry_and_xtc_settings_add_no_steps_while_they_are_off(tokenizer):
    off = replace(
        PLAIN, dry_base=2.0, dry_allowed_length=3, dry_range=64, dry_sequence_breakers={":"}, xtc_threshold=0.2
    )
    assert sampler_steps(off, tokenizer, tokenizer.vocab_size) == sampler_steps(PLAIN)


def test_penalties_carry_range_and_decay_to_both_penalty_steps():
    settings = SamplerSettings(
        token_repetition_penalty=1.2,
        token_repetition_range=64,
        token_repetition_decay=16,
        token_presence_penalty=0.5,
        token_frequency_penalty=0.25,
    )
    steps = sampler_steps(settings)
    assert steps[0] == Step("SS_RepP", (1.2, 64, 16))
    assert steps[1] == Step("SS_PresFreqP", (0.5, 0.25, 64, 16))


def test_penalties_apply_before_greedy_argmax():
    assert names(SamplerSettings.greedy(token_presence_penalty=1.0)) == ["SS_PresFreqP", "SS_Argmax"]


def test_token_bias_is_a_logit_bias_after_the_penalties_and_before_the_temperature():
    settings = SamplerSettings(token_bias={7: 2.5, 3: -math.inf})
    steps = sampler_steps(settings)
    assert [s.name for s in steps[:3]] == ["SS_RepP", "SS_LogitBias", "SS_Temperature"]
    assert steps[1] == Step("SS_LogitBias", ({3: -math.inf, 7: 2.5},))
    assert names(SamplerSettings.greedy(token_bias={3: -1.0})) == ["SS_LogitBias", "SS_Argmax"]


def test_dry_follows_the_token_bias_and_carries_its_parameters(tokenizer):
    settings = SamplerSettings(token_bias={3: 1.0}, dry_multiplier=0.8, dry_base=1.5, dry_allowed_length=3)
    assert names(settings, tokenizer)[:4] == ["SS_RepP", "SS_LogitBias", "SS_DRY", "SS_Temperature"]
    multiplier, base, allowed, dry_range, breakers = step(settings, "SS_DRY", tokenizer).args
    assert (multiplier, base, allowed, dry_range) == (0.8, 1.5, 3, 0)  # 0: the whole sequence in both libraries
    assert names(SamplerSettings.greedy(dry_multiplier=2.0), tokenizer) == ["SS_DRY", "SS_Argmax"]


def test_dry_range_counts_the_window_as_exllamav2_does(tokenizer):
    # exllamav2 looks at repeats starting within the last dry_range + 1 tokens, exllamav3 within the last dry_range
    assert step(SamplerSettings(dry_multiplier=0.8, dry_range=64), "SS_DRY", tokenizer).args[3] == 65


def test_dry_default_breakers_are_the_cpu_engines_as_token_ids(tokenizer):
    breakers = step(SamplerSettings(dry_multiplier=0.8), "SS_DRY", tokenizer).args[4]
    pieces = tokenizer.pieces()
    assert breakers == {i for i, piece in enumerate(pieces) if any(c in piece for c in '.,!?<>[](){}\n\t"')} | set(
        tokenizer.special_tokens().values()
    )
    assert breakers == set(vocab.dry_breakers(tokenizer, None, tokenizer.vocab_size).nonzero().flatten().tolist())


def test_dry_breaker_strings_become_the_ids_of_every_token_holding_one(tokenizer):
    settings = SamplerSettings(dry_multiplier=0.8, dry_sequence_breakers={":", "\n"})
    breakers = step(settings, "SS_DRY", tokenizer).args[4]
    pieces = tokenizer.pieces()
    assert breakers == {i for i, piece in enumerate(pieces) if ":" in piece or "\n" in piece}
    assert tokenizer.token_to_id("<|im_end|>") not in breakers  # special tokens only in the default set


def test_xtc_comes_last_before_the_draw_with_exllamav2s_protected_tokens(tokenizer):
    settings = SamplerSettings(min_p=0.05, xtc_probability=0.5, xtc_threshold=0.2)
    assert names(settings, tokenizer)[-3:] == ["SS_MinP", "SS_XTC", "SS_Sample"]
    probability, threshold, protected = step(settings, "SS_XTC", tokenizer).args
    assert (probability, threshold) == (0.5, 0.2)
    pieces = tokenizer.pieces()
    assert protected == {i for i, piece in enumerate(pieces) if "\n" in piece} | set(
        tokenizer.special_tokens().values()
    )
    assert tokenizer.encode(" Paris", special=False)[0] not in protected


def test_xtc_only_acts_on_a_draw():
    assert names(SamplerSettings.greedy(xtc_probability=0.5)) == ["SS_Argmax"]


def test_temperature_last_moves_the_temperature_after_the_filters():
    first = names(SamplerSettings(min_p=0.1))
    last = names(SamplerSettings(min_p=0.1, temperature_last=True))
    assert first == ["SS_RepP", "SS_Temperature", "SS_TopK", "SS_TopP", "SS_MinP", "SS_Sample"]
    assert last == ["SS_RepP", "SS_TopK", "SS_TopP", "SS_MinP", "SS_Temperature", "SS_Sample"]
    assert Step("SS_Temperature", (0.8,)) in sampler_steps(SamplerSettings(temperature_last=True))


def test_every_mapped_setting_at_once_keeps_exllamav2s_order(tokenizer):
    settings = SamplerSettings(
        temperature=1.3,
        temperature_last=True,
        min_p=0.02,
        token_presence_penalty=0.2,
        token_bias={5: 1.0},
        dry_multiplier=0.8,
        xtc_probability=0.5,
    )
    assert names(settings, tokenizer) == [
        "SS_RepP",
        "SS_PresFreqP",
        "SS_LogitBias",
        "SS_DRY",
        "SS_TopK",
        "SS_TopP",
        "SS_MinP",
        "SS_Temperature",
        "SS_XTC",
        "SS_Sample",
    ]


def test_the_unmapped_list_covers_every_field_the_steps_leave_out():
    assert set(UNMAPPED) == {f.name for f in fields(SamplerSettings)} - MAPPED_FIELDS


@pytest.mark.parametrize("name", sorted(UNMAPPED))
def test_a_setting_exllamav3_has_no_step_for_is_refused_by_name(name):
    with pytest.raises(ValueError, match=rf"^the exllamav3 engine has no {name}=.*: leave it at the default"):
        sampler_steps(replace(PLAIN, **{name: UNMAPPED[name]}))


def test_several_refused_settings_are_named_in_one_message():
    with pytest.raises(ValueError) as refused:
        sampler_steps(SamplerSettings(**UNMAPPED))
    message = str(refused.value)
    assert all(f"{name}=" in message for name in UNMAPPED)
    assert message.count("\n") == 0 and "leave them at the default" in message


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (dict(dry_multiplier=0.8, dry_base=0.5), "dry_base=0.5"),
        (dict(xtc_probability=0.5, xtc_threshold=0.0), "xtc_threshold=0.0"),
    ],
)
def test_a_value_exllamav3_reads_otherwise_is_refused_with_why(change, named):
    settings = replace(PLAIN, **change)
    assert [r.split(" ")[0] for r in refused_settings(settings)] == [named]
    with pytest.raises(ValueError, match=rf"the exllamav3 engine has no {re.escape(named)} \(exllamav3 "):
        sampler_steps(settings)


def test_the_engine_names_what_it_refuses_so_experiments_can_say_why_a_run_was_left_out():
    engine = object.__new__(ExLlamaV3Engine)  # no GPU or exllamav3 needed to ask what it supports
    refused = engine.unsupported(JobSpec(input_ids=(1,), sampler=SamplerSettings(**UNMAPPED)))
    assert sorted(refused) == sorted(f"{name}={value!r}" for name, value in UNMAPPED.items())
    assert (
        engine.unsupported(JobSpec(input_ids=(1,), sampler=SamplerSettings(dry_multiplier=0.8, xtc_probability=0.5)))
        == []
    )


@dataclass(frozen=True)
class SettingsWithNewKnob(SamplerSettings):
    new_knob: float = field(default=0.0, metadata={"help": "a setting added after this mapping was written"})


def test_a_setting_added_later_is_refused_until_it_is_mapped():
    with pytest.raises(ValueError, match="the exllamav3 engine has no new_knob=0.5"):
        sampler_steps(SettingsWithNewKnob(new_knob=0.5))


def test_such_a_setting_left_at_its_default_is_accepted():
    assert names(SettingsWithNewKnob.greedy()) == ["SS_Argmax"]
