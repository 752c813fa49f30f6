"""Field reports 1 (cause B) and 4: small models fall into repetition loops; penalties pull them out.

Prompts that invite loops run over a grid of token_repetition_penalty x token_frequency_penalty x
temperature. Each output is checked for a loop at its tail (`exlnb.analysis.find_tail_loop`), and for its
diversity (distinct-2) and length. A looping job runs to max_new_tokens: that is how cause B makes a
service slow.
"""

from __future__ import annotations

import itertools

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from exlnb.analysis import (
    distinct_n,
    find_tail_loop,
    mean_interval,
    rate_interval,
    repeated_ngram_fraction,
    tail_repeated_fraction,
)
from exlnb.engines.base import EosReason, SamplerSettings
from exlnb.datasets import load_prompts
from exlnb.experiments.record import Effect, ExperimentResult, environment
from exlnb.session import Session
from exlnb.templates import chatml

REPETITION_PENALTIES = (1.0, 1.05, 1.11, 1.2)
FREQUENCY_PENALTIES = (0.0, 0.03)
TEMPERATURES = (0.0, 0.7)
NO_PENALTY = (1.0, 0.0)
REPORTED_DEFAULT = (1.05, 0.0)  # what field report 1 calls exllamav2's default (0.3.2's is in fact 1.025)
REPORTED_SUGGESTION = (1.11, 0.03)  # field report 1's suggested settings
EXLLAMAV2_DEFAULT_PENALTY = SamplerSettings().token_repetition_penalty


def sampler(repetition: float, frequency: float, temperature: float) -> SamplerSettings:
    """Greedy at temperature 0; otherwise field report 4's example settings (top_k 50, top_p 0.8)."""
    if temperature == 0:
        return SamplerSettings.greedy(token_repetition_penalty=repetition, token_frequency_penalty=frequency)
    return SamplerSettings(
        temperature=temperature,
        top_k=50,
        top_p=0.8,
        token_repetition_penalty=repetition,
        token_frequency_penalty=frequency,
    )


def run(
    session: Session,
    *,
    prompts: int = 4,
    max_new_tokens: int = 80,
    repetition_penalties: tuple[float, ...] = REPETITION_PENALTIES,
    frequency_penalties: tuple[float, ...] = FREQUENCY_PENALTIES,
    temperatures: tuple[float, ...] = TEMPERATURES,
    samples_per_prompt: int = 1,
    seed: int = 0,
) -> ExperimentResult:
    """Every prompt under every sampler setting in the grid, all submitted at once and batched."""
    for rep, freq in (NO_PENALTY, REPORTED_DEFAULT, REPORTED_SUGGESTION):
        if rep not in repetition_penalties or freq not in frequency_penalties:
            raise ValueError(
                f"the grid must hold no penalty and field report 1's two settings (penalty {rep}, frequency {freq}) to compare them: "
                f"got repetition_penalties={repetition_penalties}, frequency_penalties={frequency_penalties}"
            )
    texts = load_prompts("loop_inviting")[:prompts]
    grid = list(itertools.product(repetition_penalties, frequency_penalties, temperatures))
    jobs = []
    for (rep, freq, temp), (p, prompt), sample in itertools.product(grid, enumerate(texts), range(samples_per_prompt)):
        if temp == 0 and sample > 0:
            continue  # greedy is deterministic: one sample says it all
        stream = session.generate(
            chatml(prompt),
            max_new_tokens=max_new_tokens,
            sampler=sampler(rep, freq, temp),
            seed=seed + 1000 * p + sample,
            identifier=f"rp {rep} fp {freq} t {temp} p{p}",
        )
        jobs.append((rep, freq, temp, p, sample, stream))
    rows = [_measure(rep, freq, temp, p, sample, stream.result(), max_new_tokens) for rep, freq, temp, p, sample, stream in jobs]
    parameters = dict(
        prompts=prompts,
        max_new_tokens=max_new_tokens,
        repetition_penalties=list(repetition_penalties),
        frequency_penalties=list(frequency_penalties),
        temperatures=list(temperatures),
        samples_per_prompt=samples_per_prompt,
        seed=seed,
    )
    return _summarise({"outputs": pd.DataFrame(rows)}, parameters, environment(session))


def _measure(rep, freq, temp, prompt, sample, result, max_new_tokens) -> dict:
    # the stop token is the engine's signal, not part of the text whose repetition we measure
    generated = result.token_ids[:-1] if result.eos_reason is EosReason.STOP_TOKEN else result.token_ids
    loop = find_tail_loop(generated)
    return {
        "token_repetition_penalty": rep,
        "token_frequency_penalty": freq,
        "temperature": temp,
        "prompt": prompt,
        "sample": sample,
        "new_tokens": result.new_tokens,
        "eos_reason": result.eos_reason.value,
        "ran_to_max": result.new_tokens >= max_new_tokens,
        "loop": loop is not None,
        "loop_period": loop.period if loop else None,
        "tail_repeated_4grams": tail_repeated_fraction(generated),
        "distinct_2": distinct_n(generated, 2),
        "repeated_4gram_fraction": repeated_ngram_fraction(generated, 4),
        "text": result.text,
    }


def _cell(outputs: pd.DataFrame, rep: float, freq: float) -> pd.DataFrame:
    return outputs[(outputs.token_repetition_penalty == rep) & (outputs.token_frequency_penalty == freq)]


def _rate(outputs: pd.DataFrame, column: str):
    return rate_interval(int(outputs[column].sum()), len(outputs))


def _label(repetition: float, frequency: float) -> str:
    if (repetition, frequency) == NO_PENALTY:
        return "no penalty"
    return f"penalty {repetition:g}, frequency {frequency:g}"


def _summarise(tables: dict[str, pd.DataFrame], parameters: dict, env: dict) -> ExperimentResult:
    outputs = tables["outputs"]
    fix = _cell(outputs, *REPORTED_SUGGESTION)
    contrasts = (
        ("loop rate (all temperatures and prompts)", lambda cell: _rate(cell, "loop"), REPORTED_DEFAULT),
        ("loop rate (all temperatures and prompts)", lambda cell: _rate(cell, "loop"), NO_PENALTY),
        ("distinct-2 of the output, mean", lambda cell: mean_interval(cell.distinct_2, "fraction"), REPORTED_DEFAULT),
        ("jobs running to max_new_tokens", lambda cell: _rate(cell, "ran_to_max"), REPORTED_DEFAULT),
    )
    effects = [
        Effect(name, measure(_cell(outputs, *setting)), measure(fix), _label(*setting), _label(*REPORTED_SUGGESTION))
        for name, measure, setting in contrasts
    ]
    by_penalty = {str(rep): _rate(g, "loop").as_dict() for rep, g in outputs.groupby("token_repetition_penalty")}
    by_temperature = {str(t): _rate(g, "loop").as_dict() for t, g in outputs.groupby("temperature")}
    grid = (
        outputs.groupby(["temperature", "token_repetition_penalty", "token_frequency_penalty"])
        .agg(loop_rate=("loop", "mean"), distinct_2=("distinct_2", "mean"), new_tokens=("new_tokens", "mean"), n=("loop", "size"))
        .reset_index()
    )
    tables["grid"] = grid
    findings = _findings(outputs, by_penalty, effects)
    return ExperimentResult(
        name="repetition",
        field_reports=(1, 4),
        tables=tables,
        effects=effects,
        parameters=parameters,
        environment=env,
        findings=findings,
        values={
            "loop_rate_by_repetition_penalty": by_penalty,
            "loop_rate_by_temperature": by_temperature,
            "exllamav2_default_token_repetition_penalty": EXLLAMAV2_DEFAULT_PENALTY,
        },
    )


def _findings(outputs: pd.DataFrame, by_penalty: dict, effects: list[Effect]) -> list[str]:
    default, suggestion = effects[0].symptom, effects[0].fix
    rates = ", ".join(f"{rep}: {r['value']:.0%}" for rep, r in by_penalty.items())
    overlap = default.low <= suggestion.high and suggestion.low <= default.high
    findings = [
        f"Loop rate by token_repetition_penalty (all other settings pooled): {rates}.",
        f"Field report 1's suggestion (1.11, frequency 0.03) against the report's default (1.05): loop rate "
        f"{suggestion.value:.0%} against {default.value:.0%}"
        + (" - the 95% intervals overlap, so this run cannot tell them apart." if overlap else "."),
        f"exllamav2 0.3.2's own default token_repetition_penalty is {EXLLAMAV2_DEFAULT_PENALTY}, not the 1.05 the "
        "report gives.",
    ]
    looping = outputs[outputs.loop]
    if len(looping):
        findings.append(
            f"{len(looping)} of {len(outputs)} outputs ended in a loop; {looping.ran_to_max.mean():.0%} of those ran "
            "to max_new_tokens, the way a looping job holds a batch slot in field report 1."
        )
    return findings


def plot(result: ExperimentResult):
    """Loop rate over the penalty grid, one heatmap per temperature."""
    grid = result.tables["grid"]
    temperatures = sorted(grid.temperature.unique())
    fig, axes = plt.subplots(1, len(temperatures) + 1, figsize=(5 * (len(temperatures) + 1), 4))
    for ax, temp in zip(axes, temperatures):
        table = grid[grid.temperature == temp].pivot(
            index="token_frequency_penalty", columns="token_repetition_penalty", values="loop_rate"
        )
        sns.heatmap(table, annot=True, fmt=".0%", vmin=0, vmax=1, cmap="rocket_r", ax=ax, cbar=False)
        ax.set(title=f"loop rate, temperature {temp:g}", xlabel="token_repetition_penalty",
               ylabel="token_frequency_penalty")
    outputs = result.tables["outputs"]
    sns.pointplot(data=outputs, x="token_repetition_penalty", y="distinct_2", hue="temperature", ax=axes[-1])
    axes[-1].set(title="distinct-2 of the output (mean, 95% CI)", ylim=(0, 1))
    fig.suptitle("Field reports 1 and 4: repetition loops against sampler penalties")
    fig.tight_layout()
    return fig
