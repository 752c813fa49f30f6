"""The repetition investigation's named remedies: each runs on no penalty's prompts, seeds and temperatures,
with its own settings reaching the jobs, and each is compared with no penalty in pairs."""

from __future__ import annotations

import pandas as pd
import pytest

from exlnb.datasets import load_prompts
from exlnb.engines.job_options import JobOptions
from exlnb.experiments import repetition
from exlnb.experiments.remedies import LOOP_DETECTOR, NO_PENALTY, REMEDIES, add_detector_columns
from exlnb.templates import chatml

TEMPERATURES = (0.0, 0.7)


@pytest.fixture(scope="module")
def tiny(cpu_session):
    """One prompt, 8 tokens, the smallest grid the run accepts; every spec the run submits is kept."""
    specs = []
    spec_for = cpu_session.spec_for

    def keep(*args, **kwargs):
        specs.append(spec_for(*args, **kwargs))
        return specs[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_session, "spec_for", keep)
        result = repetition.run(
            cpu_session,
            prompts=1,
            max_new_tokens=8,
            repetition_penalties=(1.0, 1.05, 1.11),
            frequency_penalties=(0.0, 0.03),
            temperatures=TEMPERATURES,
        )
    return result, specs


def test_every_remedy_runs_at_no_penaltys_temperatures_and_xtc_only_when_sampling(tiny):
    result, _ = tiny
    remedies = result.tables["remedies"]
    ran = remedies.groupby("remedy").temperature.apply(sorted).to_dict()
    assert set(ran) == {r.name for r in REMEDIES}
    assert ran["XTC"] == [0.7]
    assert all(ran[r.name] == list(TEMPERATURES) for r in REMEDIES if r.name != "XTC")
    assert (remedies.new_tokens <= 8).all()


def test_each_remedys_settings_reach_its_jobs(tiny):
    _, specs = tiny
    submitted = [s for s in specs if s.max_new_tokens == 8]  # the rest only ask the engine what it implements
    sent = {(s.sampler, s.stop_on_loop) for s in submitted}
    for remedy in REMEDIES:
        for temperature in (t for t in TEMPERATURES if remedy.applies_at(t)):
            expected = remedy.sampler(repetition.sampler(1.0, 0.0, temperature))
            assert (expected, remedy.stop_on_loop) in sent, (remedy.name, temperature)
            assert dict(remedy.sampler_options).items() <= vars(expected).items()
    assert all(
        s.sampler.dry_multiplier == 0 and s.stop_on_loop is None for s in submitted if s.sampler.xtc_probability > 0
    )


def test_a_remedy_that_is_a_grid_cell_reuses_its_jobs(tiny):
    result, specs = tiny
    submitted = [s for s in specs if s.max_new_tokens == 8]  # the rest only ask the engine what it implements
    in_grid = result.tables["remedies"].remedy.isin([NO_PENALTY.name, "field report 1's suggestion"])
    assert len(submitted) == len(result.tables["outputs"]) + (~in_grid).sum()


def test_every_remedy_is_compared_with_no_penalty_in_pairs_and_has_an_effect(tiny):
    result, _ = tiny
    compared = result.values["remedies"]
    assert set(compared) == {r.name for r in REMEDIES} - {NO_PENALTY.name}
    assert compared["XTC"]["loop_rate"]["n"] == 1 and compared["DRY"]["loop_rate"]["n"] == 2
    for name, c in compared.items():
        low, high = c["loop_rate_minus_no_penalty"]["ci95"]
        assert low <= c["loop_rate_minus_no_penalty"]["value"] <= high, name
    fixes = {e.fix_label for e in result.effects if e.symptom_label == NO_PENALTY.name}
    assert fixes >= set(compared)
    assert any(line.startswith("The loop detector ended") for line in result.findings)


def test_the_loop_detector_ends_a_looping_job_and_counts_the_tokens_it_saved(cpu_session):
    # greedy with no penalty, the ocean poem settles into two alternating lines (period 14)
    prompt = chatml(load_prompts("loop_inviting")[0])
    result = cpu_session.complete(
        prompt, max_new_tokens=160, sampler=repetition.sampler(1.0, 0.0, 0.0), stop_on_loop=LOOP_DETECTOR.stop_on_loop
    )
    row = add_detector_columns(
        pd.DataFrame([{"new_tokens": result.new_tokens, "eos_reason": result.eos_reason.value}]), 160
    )
    assert row.ended_by_detector[0], result.text
    assert row.tokens_saved[0] == 160 - result.new_tokens > 0


def test_every_engine_runs_dry_and_xtc_and_runs_the_loop_detector_or_says_why_not(engine_session):
    result = repetition.run(
        engine_session,
        prompts=1,
        max_new_tokens=4,
        repetition_penalties=(1.0, 1.05, 1.11),
        frequency_penalties=(0.0, 0.03),
        temperatures=(0.7,),
    )
    ran = set(result.tables["remedies"].remedy)
    assert {"DRY", "XTC"} <= ran
    spec = engine_session.spec_for("x", JobOptions(max_new_tokens=1, stop_on_loop=LOOP_DETECTOR.stop_on_loop))
    if engine_session.run_on_engine(lambda engine: engine.unsupported(spec)):
        assert LOOP_DETECTOR.name not in ran
        assert any(
            line.startswith(f"loop detector not run: the {engine_session.options.engine} engine")
            for line in result.findings
        )
    else:
        assert LOOP_DETECTOR.name in ran
