"""Field report 5's prompt passes: the arithmetic from two clock readings, the one-line answer off the ExLlamaV2
engine, and on a GPU (`pytest -m gpu`) the reporter's own streaming generator over the engine's model and cache."""

from __future__ import annotations

import pandas as pd
import pytest

from exlnb import SamplerSettings, get_session
from exlnb.datasets import filler_ids
from exlnb.experiments import prompt_clocks
from exlnb.experiments.prompt_clocks import (
    RATE_COLUMNS,
    READING_COLUMNS,
    check_prompt_models,
    clock_medians,
    clock_rates,
    findings,
    time_prompt_passes,
)
from exlnb.experiments.timed_models import TIMED_MODELS
from tests.helpers import skip_without_library


def readings(*rows: tuple) -> pd.DataFrame:
    return pd.DataFrame([dict(zip(READING_COLUMNS, row)) for row in rows])


def test_two_clock_readings_give_the_reporters_speed_and_the_true_one():
    # the reporter's 1441 tokens read early at 0.10 s, really done at 0.50 s; a pass the early clock caught done
    table = clock_rates(
        readings(("bundled", "streaming", 1441, 0, 0.10, 0.50), ("bundled", "dynamic", 256, 0, 0.02, 0.02))
    )

    assert table.early_tokens_per_s.tolist() == pytest.approx([14410.0, 12800.0])
    assert table.late_tokens_per_s.tolist() == pytest.approx([2882.0, 12800.0])
    assert table.early_over_late.tolist() == pytest.approx([5.0, 1.0])


def test_medians_put_the_early_reading_beside_the_late_one_per_model_pass_and_length():
    table = clock_rates(
        readings(
            ("7b-shaped", "streaming", 1000, 0, 0.1, 0.4),
            ("7b-shaped", "streaming", 1000, 1, 0.3, 0.6),
            ("7b-shaped", "streaming", 1000, 2, 0.2, 0.5),
            ("7b-shaped", "dynamic", 1000, 0, 0.5, 0.5),
        )
    )

    medians = clock_medians(table)

    assert medians.columns.tolist() == [
        "model",
        "prompt_pass",
        "prompt_tokens",
        "repeats",
        "early_s",
        "late_s",
        *RATE_COLUMNS,
    ]
    streaming, dynamic = medians.to_dict("records")
    assert (streaming["prompt_pass"], streaming["repeats"]) == ("streaming", 3)
    assert (streaming["early_s"], streaming["late_s"]) == pytest.approx((0.2, 0.5))
    assert streaming["early_tokens_per_s"] == pytest.approx(5000.0)  # 1000 / 0.2
    assert streaming["late_tokens_per_s"] == pytest.approx(2000.0)  # 1000 / 0.5
    assert streaming["early_over_late"] == pytest.approx(2.5)  # median of 4, 2, 2.5
    assert (dynamic["repeats"], dynamic["early_over_late"]) == (1, pytest.approx(1.0))


def test_a_finding_gives_the_passes_own_ratios_not_a_ratio_of_the_medians():
    table = clock_rates(
        readings(
            ("7b-shaped", "streaming", 4000, 0, 0.265, 0.301),  # the night H100 run's three passes
            ("7b-shaped", "streaming", 4000, 1, 0.254, 0.257),
            ("7b-shaped", "streaming", 4000, 2, 0.217, 0.253),
        )
    )

    (line,) = findings(table, [], "14,982 tokens/s")

    assert "look 1.14x as fast as it ran (median of 3 passes, 1.01x to 1.17x)" in line, line


def test_findings_call_only_a_clearly_early_clock_the_reports_mistake():
    table = clock_rates(
        readings(("bundled", "streaming", 4000, 0, 0.01, 0.05), ("bundled", "dynamic", 4000, 0, 0.05, 0.051))
    )

    early, late = findings(table, [], "14,982 tokens/s")

    assert "5.00x as fast" in early and "reproduced" in early
    assert "1.02x as fast" in late and "reproduced" not in late and "waits for the GPU" in late


def test_off_the_exllamav2_engine_report_5_says_in_one_line_that_it_needs_it_on_cuda(cpu_session):
    table, not_timed = time_prompt_passes(cpu_session, models=TIMED_MODELS, lengths=(256,), repeats=1)

    assert table.empty and table.columns.tolist() == READING_COLUMNS + RATE_COLUMNS
    [line] = not_timed
    assert "ExLlamaV2 engine on CUDA" in line and "cpu engine" in line and "\n" not in line
    with pytest.raises(NotImplementedError, match="ExLlamaV2 engine on CUDA"):
        cpu_session.run_on_engine(lambda engine: engine.lend_prompt_pass("streaming"))


@pytest.mark.parametrize(
    "models, lengths, message",
    [
        (("bundled", "llama-70b"), (256,), "no model 'llama-70b' to time: choose from bundled, 7b-shaped"),
        (("7b-shaped",), (256, 4096), "exceed the 7b-shaped model's 4096 positions"),
        (("bundled",), (), "give one or more lengths of at least 2 tokens"),
    ],
)
def test_an_unknown_model_or_a_prompt_beyond_its_positions_is_refused_before_anything_runs(models, lengths, message):
    with pytest.raises(ValueError, match=message):
        check_prompt_models(models, lengths)


@pytest.mark.gpu
def test_the_reporters_streaming_pass_reads_early_then_late_and_samples_the_engines_first_token():
    skip_without_library("exllamav2")
    session = get_session()
    session.load("smollm2-135m-instruct", engine="exllamav2", progress=False)
    lengths = (256, 1441, 4000)

    table, not_timed = time_prompt_passes(session, models=("bundled",), lengths=lengths, repeats=2)

    assert not_timed == []
    assert table.groupby(["prompt_pass", "prompt_tokens"]).size().to_dict() == {
        (name, length): 2 for name in ("dynamic", "streaming") for length in lengths
    }
    assert (table.late_s >= table.early_s).all(), table

    greedy = SamplerSettings.greedy()
    ids = filler_ids(session.tokenizer, 1024, label="first token")
    before = session.complete(ids, max_new_tokens=8, sampler=greedy)

    def first_token(name: str, prompt: list[int]):
        def run(engine) -> int:
            with engine.lend_prompt_pass(name) as prompt_pass:
                prompt_pass.begin(prompt)
                return prompt_pass.first_token()

        return session.run_on_engine(run)

    assert first_token("streaming", ids) == before.token_ids[0]
    assert first_token("dynamic", ids) == before.token_ids[0]
    first_token("streaming", filler_ids(session.tokenizer, 1024, label="another prompt"))  # over the cache's pages
    assert session.complete(ids, max_new_tokens=8, sampler=greedy).token_ids == before.token_ids
    assert session.jobs() == []
    assert prompt_clocks.effects(table)  # the summary has an early-against-late effect per pass
