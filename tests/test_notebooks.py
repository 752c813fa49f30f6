"""The main command runs the investigation notebooks on the CPU engine; their summaries hold up.

The notebooks run once for the whole module (under five minutes on two cores), through the same command a
user runs (`python -m exlnb.report`), with parameters smaller than the notebooks' defaults (`SMALLER`, each
chosen so that its test still shows what it shows with the defaults). The assertions check what
follows from mechanism, not what a field report hopes for: an abandoned job that nobody cancels holds its
pages until it finishes, so the next request must wait for it; a repetition penalty lowers the logits of
tokens already seen; separate page tables over one cache overwrite each other's keys and values.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from exlnb.report import NOTEBOOKS, main

pytestmark = pytest.mark.slow  # notebooks under papermill: not in `make test-fast`


@dataclass(frozen=True)
class Report:
    out: Path
    exit_code: int
    seconds: float

    def summary(self, name: str) -> dict:
        return json.loads((self.out / name / f"{name}.json").read_text())

    def table(self, name: str, table: str) -> pd.DataFrame:
        return pd.read_csv(self.out / name / f"{name}-{table}.csv")

    def effect(self, name: str, symptom_label: str, fix_label: str) -> dict:
        return next(
            e
            for e in self.summary(name)["effects"]
            if e["symptom_label"] == symptom_label and e["fix_label"] == fix_label
        )


# Smaller than the notebooks' defaults where each test's point survives it, as the CPU results in
# data/results/cpu show: decoding after 2048 tokens of context takes twice as long as after 128 (149 against
# 75 ms a token; the prefills of 4096 tokens were most of the run), separate generators mix outputs at a
# concurrency of 4 already, greedy outputs loop and a penalty diversifies them without the sampled half of the
# grid, and the prompt-format verdicts follow their intervals for any number of questions. Two latency trials
# instead of three: the next job's ratio has about the fastest un-cancelled run over the slowest cancelled one
# as its lower bound, which fewer trials cannot lower.
SMALLER = [
    "latency.trials=2",
    "context.context_lengths=[128, 2048]",
    "context.prompt_lengths=[256, 1441]",
    "concurrency.prompts=4",
    "concurrency.concurrency=[2, 4]",
    "repetition.temperatures=[0.0]",
    "prompt_format.questions=12",
]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Report:
    out = tmp_path_factory.mktemp("reports")
    start = time.perf_counter()
    exit_code = main(["--engine", "cpu", "--out", str(out), *(arg for s in SMALLER for arg in ("--set", s))])
    seconds = time.perf_counter() - start
    print(f"\n{len(NOTEBOOKS)} notebooks on the CPU engine: {seconds:.0f} s")
    return Report(out, exit_code, seconds)


def test_main_command_runs_every_notebook_and_writes_the_report(report):
    assert report.exit_code == 0, (report.out / "summary.md").read_text()
    summary_md = (report.out / "summary.md").read_text()
    for name in NOTEBOOKS:
        folder = report.out / name
        for suffix in (".ipynb", ".html", ".json"):
            assert (folder / f"{name}{suffix}").stat().st_size > 0, f"{name}{suffix} missing or empty"
        figure = report.summary(name)["figure"]
        assert (folder / f"{name}.png").exists() == (figure is not None), f"{name}: figure {figure!r}"
        assert list(folder.glob(f"{name}-*.csv")), f"{name} wrote no CSV"
        for effect in report.summary(name)["effects"]:
            assert effect["line"] in summary_md


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_summary_says_where_its_numbers_came_from(report, name):
    summary = report.summary(name)
    env = summary["environment"]
    assert (env["engine"], env["model"]) == ("cpu", "smollm2-135m-instruct")
    assert env["device"].startswith("cpu") and env["paged"]
    assert env["versions"]["torch"] and env["versions"]["exlnb"]
    assert summary["findings"], "a summary must say what the data show"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_effect_has_an_interval_around_its_value(report, name):
    for effect in report.summary(name)["effects"]:
        for side in ("symptom", "fix", "ratio"):
            estimate = effect[side]
            if estimate is None:
                continue
            low, high = estimate["ci95"]
            assert low <= estimate["value"] <= high, (effect["name"], side, estimate)
            assert estimate["n"] >= 1 and estimate["unit"], (effect["name"], side, estimate)


def test_uncancelled_jobs_hold_every_page_and_make_the_next_request_wait(report):
    state = report.table("latency", "state")
    uncancelled, cancelled = state[state.condition == "un-cancelled"], state[state.condition == "cancelled"]
    assert (uncancelled.pages_held_when_consumers_gone == uncancelled.total_pages).all()
    assert (cancelled.jobs_left_when_consumers_gone == 0).all()
    assert (cancelled.pages_held_when_consumers_gone == 0).all()
    next_job = report.effect("latency", "un-cancelled", "cancelled")
    assert next_job["ratio"]["ci95"][0] > 3, next_job["line"]


def test_a_stronger_repetition_penalty_makes_greedy_output_more_diverse(report):
    outputs = report.table("repetition", "outputs")
    greedy = outputs[outputs.temperature == 0]
    by_penalty = greedy.groupby("token_repetition_penalty").distinct_2.mean()
    assert by_penalty[1.2] > by_penalty[1.0], by_penalty.to_dict()


def test_a_loop_runs_its_job_to_max_new_tokens(report):
    outputs = report.table("repetition", "outputs")
    looping = outputs[outputs.loop]
    assert len(looping) > 0, "no output looped: the prompts no longer invite loops"
    assert looping.ran_to_max.mean() > 0.5, looping[["eos_reason", "new_tokens"]].to_dict("records")


def test_special_tokens_encoded_as_text_make_longer_prompts_and_each_variant_gets_a_verdict_and_a_ranking(report):
    answers = report.table("prompt_format", "answers").set_index(["format", "question_id"]).prompt_tokens
    assert (answers["special_as_text"] > answers["chatml"]).all()
    summary = report.summary("prompt_format")
    for name, stats in summary["values"]["per_format"].items():
        if name == "chatml":
            continue
        low, high = stats["accuracy_minus_chatml"]["ci95"]
        verdict = "worse than ChatML" if high < 0 else "better than ChatML" if low > 0 else "not distinguishable"
        assert any(line.startswith(f"{name}:") and verdict in line for line in summary["findings"]), name
    ranking = summary["values"]["ranking"]
    assert ranking["statement"] in summary["findings"]
    assert ("can be ranked" if ranking["rankable"] else "cannot be ranked") in ranking["statement"]


def test_one_generator_keeps_outputs_apart_and_generators_per_request_mix_them(report):
    outputs = report.table("concurrency", "outputs")
    one = outputs[outputs.pattern == "one generator"]
    separate = outputs[outputs.pattern == "generator per request"]
    assert one.identical_to_solo.all(), one[~one.identical_to_solo][["concurrency", "prompt"]].to_dict("records")
    assert not separate.identical_to_solo.all()


def test_a_generator_on_the_event_loop_delays_chunks_that_the_session_delivers_at_once(report):
    delay = report.effect("streaming", "nested", "exlnb session")
    assert delay["symptom"]["ci95"][0] > 3 * delay["fix"]["ci95"][1], delay["line"]


def test_history_lengthens_every_prompt_and_a_longer_context_slows_decoding(report):
    summary = report.summary("context")
    contexts = summary["values"]["context_tokens_last_turn"]
    assert contexts["history"] > contexts["amnesia"]
    by_length = next(e for e in summary["effects"] if e["name"] == "decode time per token")
    assert by_length["ratio"]["ci95"][0] > 1, by_length["line"]


def test_a_panel_with_nothing_to_show_is_left_out_not_drawn_as_text():
    """On the CPU the prompt clocks are not timed (no asynchronous queue): the context figure keeps its two
    speed panels and leaves the clocks out; with nothing timed at all there is no figure."""
    from exlnb.experiments import context
    from exlnb.experiments.record import ExperimentResult

    turns = pd.DataFrame(
        {
            "model": "bundled",
            "mode": ["history", "amnesia"] * 2,
            "turn": [1, 1, 2, 2],
            "token_interval_s": [0.05, 0.04, 0.06, 0.04],
        }
    )
    lengths = pd.DataFrame({"model": "bundled", "context_tokens": [128, 512], "token_interval_s": [0.04, 0.05]})
    empty = pd.DataFrame()

    def result(turns, lengths):
        return ExperimentResult("context", (4, 5), {"turns": turns, "context": lengths, "prefill": empty}, [], {}, {})

    figure = context.plot(result(turns, lengths))
    assert len(figure.axes) == 2 and all(ax.axison and not ax.texts for ax in figure.axes)
    assert context.plot(result(empty, empty)) is None
