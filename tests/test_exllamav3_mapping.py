"""SamplerSettings planned as exllamav3 sampler steps: checked on the CPU, without exllamav3 installed."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from exlnb.engines.base import SamplerSettings
from exlnb.engines.exllamav3_sampler import WHOLE_SEQUENCE, Step, sampler_steps


def names(settings: SamplerSettings) -> list[str]:
    return [step.name for step in sampler_steps(settings)]


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


def test_penalties_carry_range_and_decay_to_both_penalty_steps():
    settings = SamplerSettings(
        token_repetition_penalty=1.2, token_repetition_range=64, token_repetition_decay=16,
        token_presence_penalty=0.5, token_frequency_penalty=0.25,
    )
    steps = sampler_steps(settings)
    assert steps[0] == Step("SS_RepP", (1.2, 64, 16))
    assert steps[1] == Step("SS_PresFreqP", (0.5, 0.25, 64, 16))


def test_penalties_apply_before_greedy_argmax():
    assert names(SamplerSettings.greedy(token_presence_penalty=1.0)) == ["SS_PresFreqP", "SS_Argmax"]


@dataclass(frozen=True)
class SettingsWithDry(SamplerSettings):
    dry_multiplier: float = field(default=0.0, metadata={"help": "DRY penalty strength; 0 disables"})


def test_a_setting_exllamav3_has_no_step_for_is_refused():
    with pytest.raises(ValueError, match="the exllamav3 engine has no dry_multiplier"):
        sampler_steps(SettingsWithDry(dry_multiplier=0.8))


def test_such_a_setting_left_at_its_default_is_accepted():
    assert names(SettingsWithDry.greedy()) == ["SS_Argmax"]
