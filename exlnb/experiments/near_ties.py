"""Why greedy runs part: the near-tie map's prediction of where a greedy answer flips, tested.

Users keep asking why greedy output changes between runs or batch sizes (exllamav3 issue 353, vLLM's
batch-invariance threads), and exlnb's own tensor-parallel run parted from one card's at the first token. The
near-tie map (`exlnb.near_ties`) predicts where: at a position whose margin (the top logit over the runner-up's)
is at or under the engine's noise floor (`exlnb.noise_floor`, measured on a few calibration questions).

Here questions are answered greedily in batches of 16 (the baseline), their margins mapped, and the positions
at or under the floor predicted to flip. Then the same questions run again: alone, in batches of 2 and 8, and in
every other layout the engine and the machine can load (a q8 cache, eager decode, a layer split, tensor
parallelism), each in a session of its own. At each position up to an answer's first parting (after it the two
follow different text) the prediction meets the outcome: how many predicted positions flipped, how many flips
were not predicted, and the flip rate against the margin. Where the engine injects noise (the CPU engine), each
step is also replayed with noise of one bf16 rounding after every layer (qbench's floor, a stand-in for another
kernel's rounding; simulated, and said so), calibrated the same way, so that the prediction is tested where the
engine's own reruns may not flip at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from exlnb.analysis import rate_interval
from exlnb.datasets import load_questions
from exlnb.divergence import BF16_ROUNDING_EPS
from exlnb.experiments.record import Effect, ExperimentResult, environment
from exlnb.near_ties import NoiseFloor, margin
from exlnb.noise_floor import (
    BATCH_SIZES,
    LAYOUT_NAMES,
    LAYOUTS,
    gpu_count,
    inside_batches,
    noise_floor,
    one_by_one,
    probe_options,
    probe_prompts,
    run_in_layout,
    why_not,
)
from exlnb.scoring import score
from exlnb.session import Session
from exlnb.streaming import GenerationResult

REPLAY = "each step replayed with bf16-rounding noise (simulated)"
# margin bins of the figure, nats: half a decade wide from 1e-5 to 10 (the bundled model's margins on CPU ran from
# about 0.01 to 20), everything under and over in a bin each
EDGES = (0.0, *(10 ** (k / 2) for k in range(-10, 3)), math.inf)
PREDICTED, OVER = "margin at or under the floor", "margin over the floor"


def run(
    session: Session,
    *,
    answers: int = 24,
    max_new_tokens: int = 24,
    calibration: int = 4,
    questions_from: int = 4,
    baseline_batch: int = 16,
    rerun_batches: tuple[int, ...] = (1, 2, 8),
    layouts: bool = True,
    noise_replay: bool = True,
) -> ExperimentResult:
    """Calibrate the floor on the first `calibration` questions, answer `answers` others (from `questions_from`)
    in batches of `baseline_batch`, then again in each of `rerun_batches` (1: alone) and, with `layouts`, in each
    layout the engine and machine can load; with `noise_replay`, replay every step with noise where the engine
    injects it."""
    if questions_from < calibration or questions_from + answers > len(load_questions()):
        raise ValueError(
            f"questions_from={questions_from}, answers={answers}: answer questions after the {calibration} "
            f"calibration ones, within the {len(load_questions())} of data/questions"
        )
    options = session.options
    floor = noise_floor(
        session,
        probes=calibration,
        max_new_tokens=max_new_tokens,
        batch_sizes=[b for b in BATCH_SIZES if b <= options.max_batch_size],
        layouts=LAYOUT_NAMES if layouts else (),
    )
    prompts = probe_prompts(session, questions_from + answers)[questions_from:]
    job = probe_options(session, prompts[0], max_new_tokens)

    def batched(target: Session, size: int) -> list[GenerationResult]:
        if size == 1:
            return one_by_one(target, prompts, job)
        return inside_batches(target, [*prompts, *prompts[:size]], len(prompts), size, job)

    baseline = batched(session, baseline_batch)
    reruns = {("alone" if b == 1 else f"in batches of {b}"): batched(session, b) for b in rerun_batches}
    if layouts:
        engine, gpus = options.engine, gpu_count()
        for layout in (layout for layout in LAYOUTS if why_not(layout, engine, gpus) is None):
            again = run_in_layout(options, layout, lambda other: batched(other, baseline_batch))
            reruns[layout.name.replace("against", "->")] = again
    rows = [outcome_rows(name, baseline, again, floor.value) for name, again in reruns.items()]
    replay_floor = None
    if noise_replay and session.run_on_engine(lambda e: e.scores_with_noise):
        replay_floor, replayed = replay_with_noise(session, prompts, baseline, calibration, job)
        rows.append(replayed)
    margins = margin_table(baseline, questions_from)
    parameters = dict(
        answers=answers,
        max_new_tokens=max_new_tokens,
        calibration=calibration,
        questions_from=questions_from,
        baseline_batch=baseline_batch,
        rerun_batches=list(rerun_batches),
        layouts=layouts,
        noise_replay=noise_replay,
    )
    positions = pd.concat(rows, ignore_index=True)
    return summarise(positions, margins, floor, replay_floor, parameters, environment(session))


def outcome_rows(
    condition: str, baseline: Sequence[GenerationResult], again: Sequence[GenerationResult], floor: float
) -> pd.DataFrame:
    """Each baseline position a rerun shared (up to and including its first parting): its margin, whether it was
    predicted to flip (at or under `floor`), whether it did."""
    rows = []
    for answer, (base, other) in enumerate(zip(baseline, again)):
        parted = next((i for i, (a, b) in enumerate(zip(base.token_ids, other.token_ids)) if a != b), None)
        for record in base.token_records[: None if parted is None else parted + 1]:
            m = margin(record.info)
            rows.append((condition, answer, record.position, m, m <= floor, record.position == parted))
    return pd.DataFrame(rows, columns=["condition", "answer", "position", "margin", "predicted", "flipped"])


def replay_with_noise(
    session: Session, prompts: list, baseline: Sequence[GenerationResult], calibration: int, job
) -> tuple[float, pd.DataFrame]:
    """Every step of each answer scored in one pass with and without noise (teacher-forced, so every position is
    shared): the noise's own floor from the calibration questions, then each answer's flips against its map."""
    probes = probe_prompts(session, calibration)
    calibrating = zip(probes, one_by_one(session, probes, job))
    floor = max((abs(a - b) for p, run in calibrating for a, b, _ in noisy_steps(session, p, run)), default=0.0)
    rows = []
    for answer, (prompt, base) in enumerate(zip(prompts, baseline)):
        for position, (clean, _, flipped) in enumerate(noisy_steps(session, prompt, base)):
            rows.append((REPLAY, answer, position, clean, clean <= floor, flipped))
    return floor, pd.DataFrame(rows, columns=["condition", "answer", "position", "margin", "predicted", "flipped"])


def noisy_steps(session: Session, prompt: Sequence[int], result: GenerationResult) -> list[tuple[float, float, bool]]:
    """Per position of `result`'s answer to `prompt`: the clean pass's margin, the same pair's in the noisy pass, and
    whether the noisy pass's argmax differs from the clean one's."""
    ids = [*prompt, *result.token_ids]
    clean = score(session, ids)[len(prompt) - 1 : -1]
    noisy = score(session, ids, noise_eps=BF16_ROUNDING_EPS)[len(prompt) - 1 : -1]
    steps = []
    for row, other in zip(clean, noisy):
        top = row.topk(2)
        (first, second), (best, runner_up) = top.values.tolist(), top.indices.tolist()
        steps.append((first - second, float(other[best] - other[runner_up]), int(other.argmax()) != best))
    return steps


def margin_table(baseline: Sequence[GenerationResult], questions_from: int) -> pd.DataFrame:
    rows = [
        (answer, questions_from + answer, r.position, r.info.token_id, r.info.alternatives[1][0], margin(r.info))
        for answer, result in enumerate(baseline)
        for r in result.token_records
    ]
    return pd.DataFrame(rows, columns=["answer", "question", "position", "token_id", "runner_up_id", "margin"])


def counts(positions: pd.DataFrame) -> dict:
    """What one condition's positions say: how many, predicted, flipped, both."""
    predicted, flipped = positions.predicted, positions.flipped
    return dict(
        positions=len(positions),
        answers=int(positions.answer.nunique()),
        parted=int(flipped.sum())
        if positions.condition.iloc[0] != REPLAY
        else int(positions[flipped].answer.nunique()),
        predicted=int(predicted.sum()),
        flips=int(flipped.sum()),
        predicted_and_flipped=int((predicted & flipped).sum()),
    )


def summarise(
    positions: pd.DataFrame,
    margins: pd.DataFrame,
    floor: NoiseFloor,
    replay_floor: float | None,
    parameters: dict,
    env: dict,
) -> ExperimentResult:
    effects, findings, per_condition = [], [floor_words(floor, replay_floor)], {}
    for condition, group in positions.groupby("condition", sort=False):
        c = counts(group)
        per_condition[condition] = c
        findings.append(condition_words(condition, c, replay_floor if condition == REPLAY else floor.value))
        over = c["positions"] - c["predicted"]
        if c["predicted"] and over:
            effects.append(
                Effect(
                    name=f"greedy tokens that flipped, {condition}",
                    symptom=rate_interval(c["predicted_and_flipped"], c["predicted"]),
                    fix=rate_interval(c["flips"] - c["predicted_and_flipped"], over),
                    symptom_label=PREDICTED,
                    fix_label=OVER,
                )
            )
    bins = bin_table(positions)
    floor_rows = pd.DataFrame(
        [(c.name, c.probes, c.positions, c.max_shift, c.parted) for c in floor.comparisons],
        columns=["comparison", "probes", "positions", "max_shift", "parted"],
    )
    return ExperimentResult(
        name="near_ties",
        field_reports=(),
        tables={"margins": margins, "bins": bins, "floor": floor_rows, "outcomes": outcomes_table(positions)},
        effects=effects,
        parameters=parameters,
        environment=env,
        findings=findings,
        values={
            "floor_nats": floor.value,
            "replay_floor_nats": replay_floor,
            "not_compared": floor.not_compared,
            "per_condition": per_condition,
        },
    )


def outcomes_table(positions: pd.DataFrame) -> pd.DataFrame:
    """The positions that were predicted to flip or flipped (the rest are in `bins`' counts)."""
    return positions[positions.predicted | positions.flipped].reset_index(drop=True)


def bin_table(positions: pd.DataFrame) -> pd.DataFrame:
    """Per condition and margin bin (EDGES): positions, flips, and the flip rate with its 95% interval."""
    rows = []
    for condition, group in positions.groupby("condition", sort=False):
        for low, high in zip(EDGES, EDGES[1:]):
            inside = group[(group.margin >= low) & (group.margin < high)]
            if len(inside):
                rate = rate_interval(int(inside.flipped.sum()), len(inside))
                rows.append(
                    (condition, low, high, len(inside), int(inside.flipped.sum()), rate.value, rate.low, rate.high)
                )
    return pd.DataFrame(
        rows, columns=["condition", "low", "high", "positions", "flips", "flip_rate", "ci95_low", "ci95_high"]
    )


def floor_words(floor: NoiseFloor, replay_floor: float | None) -> str:
    parts = "; ".join(c.line() for c in floor.comparisons)
    replay = "" if replay_floor is None else f" The noise replay's own floor: {replay_floor:.3g} nats."
    missing = f" {floor.not_compared[0].upper()}{floor.not_compared[1:]}." if floor.not_compared else ""
    return f"Noise floor on the {floor.engine} engine: {floor.value:.3g} nats ({parts}).{missing}{replay}"


def condition_words(condition: str, c: dict, floor: float) -> str:
    """One condition's counts, its prediction's precision and recall with their intervals, and a verdict."""
    head = f"{condition}: "
    if condition != REPLAY:
        head += f"{c['parted']} of {c['answers']} answers parted from the baseline; "
    said = (
        f"{head}of {c['positions']} positions compared, {c['predicted']} had a margin at or under the floor "
        f"({floor:.3g} nats) and {c['flips']} flipped; {c['predicted_and_flipped']} predicted flips came true, "
        f"{c['flips'] - c['predicted_and_flipped']} flips were not predicted."
    )
    return f"{said} {verdict(c)}"


def verdict(c: dict) -> str:
    """What the counts allow one to say about the prediction, with the intervals."""
    if not c["flips"]:
        rate = rate_interval(0, c["positions"])
        if not c["predicted"]:
            return (
                f"Nothing flipped and nothing was predicted to: this condition does not test the prediction (flip "
                f"rate 0, 95% CI 0-{rate.high:.2%} of positions)."
            )
        return f"None of the {c['predicted']} predicted positions flipped: the floor over-predicts here."
    recall = rate_interval(c["predicted_and_flipped"], c["flips"])
    words = f"The map predicted {recall.value:.0%} of the flips (95% CI {recall.low:.0%}-{recall.high:.0%})"
    if c["predicted"]:
        precision = rate_interval(c["predicted_and_flipped"], c["predicted"])
        words += (
            f"; {precision.value:.0%} of predicted positions flipped (95% CI {precision.low:.0%}-{precision.high:.0%})"
        )
    if recall.high < 0.5:
        return f"{words}. The prediction does not work here: most flips came where the margin was over the floor."
    return f"{words}."


def plot(result: ExperimentResult):
    """Flip rate against the margin per condition, with the floor; and the baseline's margins."""
    bins, margins = result.tables["bins"], result.tables["margins"]
    fig, (rates, spread) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [1.4, 1]})
    for condition, group in bins.groupby("condition", sort=False):
        x = np.sqrt(np.maximum(group.low, 1e-7) * np.minimum(group.high, 10.0))  # a bin's geometric middle
        rates.errorbar(
            x,
            group.flip_rate,
            yerr=[group.flip_rate - group.ci95_low, group.ci95_high - group.flip_rate],
            marker="o",
            capsize=3,
            label=condition,
        )
    floors = [("noise floor", result.values["floor_nats"], "black")]
    if result.values["replay_floor_nats"] is not None:
        floors.append(("noise replay's floor", result.values["replay_floor_nats"], "grey"))
    for axis in (rates, spread):
        for label, value, colour in floors:
            axis.axvline(max(value, 1e-7), linestyle="--", color=colour, label=label)
    rates.set(xscale="log", xlabel="margin at the position (nats, top logit minus the runner-up's)", ylim=(-0.03, 1.03))
    rates.set(ylabel="share of positions that flipped", title="Where greedy runs part: flip rate against the margin")
    rates.legend(fontsize=8)
    finite = margins.margin[np.isfinite(margins.margin)]
    spread.hist(np.maximum(finite, 1e-7), bins=np.logspace(-7, 1.5, 40), color="tab:blue")
    spread.set(xscale="log", xlabel="margin (nats)", ylabel="positions", title="the baseline's margins")
    fig.tight_layout()
    return fig
