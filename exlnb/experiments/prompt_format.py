"""Field report 4, output quality: the ChatML template applied correctly against the usual mistakes.

A question set with known short answers (`data/questions/short_answers.csv`) is asked greedily through
the correct template and through variants with one mistake each. Per variant: accuracy (an accepted answer
appears in the output), early end-of-sequence (a stop token before any answer text), loop rate and length.
Each variant's accuracy is compared with ChatML's question by question (a paired difference with a bootstrap
interval); the summary says which differences exclude zero and whether the intervals allow the formats to be
ranked at all: with 36 questions the order of the broken variants changed from one question set to another.
"""

from __future__ import annotations

import re

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from exlnb.analysis import find_tail_loop, mean_interval, paired_difference, rate_interval
from exlnb.datasets import load_questions
from exlnb.engines.base import EosReason, SamplerSettings
from exlnb.experiments.record import Effect, ExperimentResult, environment
from exlnb.session import Session
from exlnb.templates import CHATML_VARIANTS, SMOLLM2_SYSTEM, ChatmlVariant, conversation

REFERENCE = "chatml"


def run(
    session: Session, *, questions: int | None = 36, max_new_tokens: int = 40, formats: tuple[str, ...] | None = None
) -> ExperimentResult:
    """Every question (the first `questions`; None: all 405) through every prompt format, greedy, all submitted at
    once. The default keeps CI's run short; `--preset full` asks them all."""
    table = load_questions()
    table = table if questions is None else table.head(questions)
    unknown = set(formats or ()) - set(CHATML_VARIANTS)
    if unknown:
        raise ValueError(f"unknown prompt formats {sorted(unknown)}: choose from {', '.join(CHATML_VARIANTS)}")
    chosen = [v for v in CHATML_VARIANTS.values() if formats is None or v.name in formats or v.name == REFERENCE]
    tokenizer = session.tokenizer
    # a new turn starting, or the end-of-text token, ends an answer in any format
    stop = [tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|endoftext|>")]
    jobs = []
    for fmt in chosen:
        for item in table.itertuples():
            ids = fmt.encode(conversation(item.question, SMOLLM2_SYSTEM), tokenizer)
            stream = session.generate(
                ids,
                max_new_tokens=max_new_tokens,
                sampler=SamplerSettings.greedy(),
                stop=[t for t in stop if t is not None],
                identifier=f"{fmt.name} q{item.id}",
            )
            jobs.append((fmt, item, len(ids), stream))
    rows = [
        _score(fmt, item, prompt_tokens, stream.result(), max_new_tokens) for fmt, item, prompt_tokens, stream in jobs
    ]
    parameters = dict(questions=len(table), max_new_tokens=max_new_tokens, formats=[f.name for f in chosen])
    return _summarise({"answers": pd.DataFrame(rows)}, parameters, environment(session))


def is_correct(text: str, answers: list[str]) -> bool:
    """An accepted answer appears as a whole word (case-insensitive): "4" matches "is 4." but not "14"."""
    return any(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", text, re.IGNORECASE) for a in answers)


def _score(fmt: ChatmlVariant, item, prompt_tokens: int, result, max_new_tokens: int) -> dict:
    answer_ids = result.token_ids[:-1] if result.eos_reason is EosReason.STOP_TOKEN else result.token_ids
    return {
        "format": fmt.name,
        "question_id": item.id,
        "topic": item.topic,
        "prompt_tokens": prompt_tokens,
        "correct": is_correct(result.text, item.answers),
        "early_eos": result.eos_reason is EosReason.STOP_TOKEN and not result.text.strip(),
        "loop": find_tail_loop(answer_ids) is not None,
        "new_tokens": result.new_tokens,
        "ran_to_max": result.new_tokens >= max_new_tokens,
        "eos_reason": result.eos_reason.value,
        "answer": result.text,
    }


def _summarise(tables: dict[str, pd.DataFrame], parameters: dict, env: dict) -> ExperimentResult:
    answers = tables["answers"]
    by_format = {name: group.sort_values("question_id") for name, group in answers.groupby("format", sort=False)}
    reference = by_format[REFERENCE]
    effects, per_format = [], {}
    for name, group in by_format.items():
        per_format[name] = {
            "accuracy": rate_interval(int(group.correct.sum()), len(group)).as_dict(),
            "early_eos_rate": rate_interval(int(group.early_eos.sum()), len(group)).as_dict(),
            "loop_rate": rate_interval(int(group.loop.sum()), len(group)).as_dict(),
            "ran_to_max_rate": rate_interval(int(group.ran_to_max.sum()), len(group)).as_dict(),
            "new_tokens": mean_interval(group.new_tokens, "tokens").as_dict(),
            "accuracy_minus_chatml": paired_difference(
                group.correct.to_numpy(float), reference.correct.to_numpy(float), "fraction"
            ).as_dict(),
        }
        per_format[name]["difference_excludes_zero"] = _excludes_zero(per_format[name]["accuracy_minus_chatml"])
        if name == REFERENCE:
            continue
        effects.append(
            Effect(
                name="accuracy",
                symptom=rate_interval(int(group.correct.sum()), len(group)),
                fix=rate_interval(int(reference.correct.sum()), len(reference)),
                symptom_label=name,
                fix_label=REFERENCE,
            )
        )
    ranking = rank_formats({name: stats["accuracy_minus_chatml"] for name, stats in per_format.items()})
    return ExperimentResult(
        name="prompt_format",
        field_reports=(4,),
        tables=tables,
        effects=effects,
        parameters=parameters,
        environment=env,
        findings=_findings(per_format, ranking),
        values={
            "per_format": per_format,
            "ranking": ranking,
            "mistakes": {name: CHATML_VARIANTS[name].mistake for name in by_format},
        },
    )


def rank_formats(differences: dict[str, dict]) -> dict:
    """Which formats the accuracy differences from ChatML put in order, best first.

    Formats whose 95% intervals overlap, directly or through a chain of overlapping intervals, share a tier:
    the data do not order them. ChatML's difference from itself is exactly zero, so a variant shares ChatML's
    tier when its interval includes zero. The formats can be ranked when every tier holds one format.
    """

    def overlap(a: str, b: str) -> bool:
        (a_low, a_high), (b_low, b_high) = differences[a]["ci95"], differences[b]["ci95"]
        return a_low <= b_high and b_low <= a_high

    tiers: list[list[str]] = []
    for name in sorted(differences, key=lambda name: -differences[name]["value"]):
        joined = [tier for tier in tiers if any(overlap(name, other) for other in tier)]
        merged = [other for tier in joined for other in tier] + [name]
        tiers = [tier for tier in tiers if tier not in joined] + [merged]
    for tier in tiers:
        tier.sort(key=lambda name: -differences[name]["value"])
    tiers.sort(key=lambda tier: -differences[tier[0]]["value"])
    rankable = all(len(tier) == 1 for tier in tiers)
    shown = " > ".join(" ~ ".join(tier) for tier in tiers)
    if rankable:
        statement = (
            "The formats can be ranked on accuracy: no two 95% intervals of their differences from ChatML overlap "
            f"(best first: {shown})."
        )
    else:
        statement = (
            "The formats cannot be ranked on accuracy: the 95% intervals of their differences from ChatML overlap, "
            f"directly or through a chain of overlaps, within the groups joined by ~ (best first: {shown}); only "
            "groups separated by > are in order."
        )
    return {"rankable": rankable, "tiers": tiers, "statement": statement}


def _findings(per_format: dict, ranking: dict) -> list[str]:
    ref = per_format[REFERENCE]
    lines, verdicts = [], {}
    for name, stats in per_format.items():
        if name == REFERENCE:
            continue
        diff = stats["accuracy_minus_chatml"]
        low, high = diff["ci95"]
        verdict = _verdict(diff)
        verdicts.setdefault(verdict, []).append(name)
        lines.append(
            f"{name}: accuracy {stats['accuracy']['value']:.0%} against ChatML's {ref['accuracy']['value']:.0%} "
            f"(paired difference {diff['value']:+.1%}, 95% CI {low:+.1%} to {high:+.1%}, "
            f"{'excludes' if stats['difference_excludes_zero'] else 'includes'} zero: {verdict}); early end "
            f"{stats['early_eos_rate']['value']:.0%}, loops {stats['loop_rate']['value']:.0%} (ChatML "
            f"{ref['loop_rate']['value']:.0%}), {stats['new_tokens']['value']:.0f} tokens on average (ChatML "
            f"{ref['new_tokens']['value']:.0f})."
        )
    lines.append(
        "Field report 4 expects the correct template to answer best. On accuracy, the data say: "
        + "; ".join(f"{verdict}: {', '.join(names)}" for verdict, names in verdicts.items())
        + f" ({ref['accuracy']['n']} questions)."
    )
    lines.append(ranking["statement"])
    return lines


def _verdict(difference: dict) -> str:
    """What a paired accuracy difference's 95% interval allows one to say."""
    if not _excludes_zero(difference):
        return "not distinguishable from ChatML"
    return "worse than ChatML" if difference["value"] < 0 else "better than ChatML"


def _excludes_zero(difference: dict) -> bool:
    low, high = difference["ci95"]
    return high < 0 or low > 0


def plot(result: ExperimentResult):
    """Accuracy, early end, loops and length for each prompt format."""
    answers = result.tables["answers"]
    order = list(dict.fromkeys(answers.format))
    long = answers.melt(
        id_vars=["format"], value_vars=["correct", "early_eos", "loop", "ran_to_max"], var_name="measure"
    )
    long["value"] = long["value"].astype(float)
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5), gridspec_kw={"width_ratios": [3, 1.3]})
    sns.barplot(data=long, x="format", y="value", hue="measure", order=order, errorbar=("ci", 95), ax=axes[0])
    axes[0].set(
        ylabel="fraction of questions", xlabel="", ylim=(0, 1), title="Field report 4: prompt format and output"
    )
    axes[0].tick_params(axis="x", rotation=20)
    sns.boxplot(data=answers, x="new_tokens", y="format", order=order, ax=axes[1])
    axes[1].set(xlabel="new tokens", ylabel="", title="answer length")
    fig.tight_layout()
    return fig
