"""Field reports 1 (cause B) and 4: small models fall into repetition loops; penalties pull them out.

Prompts that invite loops run over a grid of token_repetition_penalty x token_frequency_penalty x
temperature. Each output is checked for a loop at its tail (`exlnb.analysis.find_tail_loop`), and for its
diversity (distinct-2) and length. A looping job runs to max_new_tokens: that is how cause B makes a
service slow. The same prompts, seeds and temperatures also run under named remedies (`remedies.REMEDIES`:
exllamav2's default penalty, the report's suggestion, DRY, XTC and ExLlamaV3's loop detector), each paired
with no penalty.
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
from exlnb.datasets import load_prompts
from exlnb.engines.base import EosReason, SamplerSettings
from exlnb.engines.job_options import JobOptions
from exlnb.experiments import remedies
from exlnb.experiments.record import Effect, ExperimentResult, environment
from exlnb.experiments.remedies import (
    EXLLAMAV2_DEFAULT_PENALTY,
    REMEDIES,
    REPORTED_SUGGESTION,
    Remedy,
    add_detector_columns,
)
from exlnb.session import Session
from exlnb.templates import chatml

REPETITION_PENALTIES = (1.0, 1.05, 1.11, 1.2)
FREQUENCY_PENALTIES = (0.0, 0.03)
TEMPERATURES = (0.0, 0.7)
NO_PENALTY = (1.0, 0.0)
REPORTED_DEFAULT = (1.05, 0.0)  # what field report 1 calls exllamav2's default (0.3.2's is in fact 1.025)


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
    """Every prompt under every setting of the grid and every named remedy, all submitted at once and batched.

    A remedy whose settings are a cell of the grid (no penalty, field report 1's suggestion) reuses its jobs.
    """
    for rep, freq in (NO_PENALTY, REPORTED_DEFAULT, REPORTED_SUGGESTION):
        if rep not in repetition_penalties or freq not in frequency_penalties:
            raise ValueError(
                f"the grid must hold no penalty and field report 1's two settings (penalty {rep}, frequency {freq}) "
                "to compare them: "
                f"got repetition_penalties={repetition_penalties}, frequency_penalties={frequency_penalties}"
            )
    texts = load_prompts("loop_inviting")[:prompts]
    draws = [
        (temp, p, sample)
        for temp, p, sample in itertools.product(temperatures, range(len(texts)), range(samples_per_prompt))
        if temp > 0 or sample == 0  # greedy is deterministic: one sample says it all
    ]
    remedies, refused = _runnable_remedies(session, chatml(texts[0]))
    jobs: dict[tuple, object] = {}

    def submit(settings: SamplerSettings, stop_on_loop, temp: float, p: int, sample: int) -> tuple:
        key = (settings, stop_on_loop, p, sample)
        if key not in jobs:
            jobs[key] = session.generate(
                chatml(texts[p]),
                max_new_tokens=max_new_tokens,
                sampler=settings,
                stop_on_loop=stop_on_loop,
                seed=seed + 1000 * p + sample,
                identifier=f"t {temp} p{p} s{sample} #{len(jobs)}",
            )
        return key

    grid = [
        (
            dict(token_repetition_penalty=rep, token_frequency_penalty=freq, temperature=temp, prompt=p, sample=sample),
            submit(sampler(rep, freq, temp), None, temp, p, sample),
        )
        for rep, freq, (temp, p, sample) in itertools.product(repetition_penalties, frequency_penalties, draws)
    ]
    remedy_jobs = [
        (
            dict(remedy=r.name, temperature=temp, prompt=p, sample=sample),
            submit(r.sampler(sampler(*NO_PENALTY, temp)), r.stop_on_loop, temp, p, sample),
        )
        for r, (temp, p, sample) in itertools.product(remedies, draws)
        if r.applies_at(temp)
    ]
    measured = {key: _measure(stream.result(), max_new_tokens) for key, stream in jobs.items()}
    tables = {
        "outputs": pd.DataFrame([labels | measured[key] for labels, key in grid]),
        "remedies": add_detector_columns(
            pd.DataFrame([labels | measured[key] for labels, key in remedy_jobs]), max_new_tokens
        ),
    }
    parameters = dict(
        prompts=prompts,
        max_new_tokens=max_new_tokens,
        repetition_penalties=list(repetition_penalties),
        frequency_penalties=list(frequency_penalties),
        temperatures=list(temperatures),
        samples_per_prompt=samples_per_prompt,
        seed=seed,
        remedies={
            r.name: {"sampler": dict(r.sampler_options), "stop_on_loop": r.stop_on_loop, "source": r.source}
            for r in remedies
        },
    )
    return _summarise(tables, parameters, environment(session), refused)


def _runnable_remedies(session: Session, prompt: str) -> tuple[list[Remedy], list[str]]:
    """The remedies this engine can run, and for each it refuses, why (the ExLlamaV2 engine has no loop detector)."""
    runnable, refused = [], []
    for remedy in REMEDIES:
        spec = session.spec_for(
            prompt,
            JobOptions(max_new_tokens=1, sampler=remedy.sampler(SamplerSettings()), stop_on_loop=remedy.stop_on_loop),
        )
        missing = session.run_on_engine(lambda engine: engine.unsupported(spec))
        if missing:
            refused.append(
                f"{remedy.name} not run: the {session.options.engine} engine does not implement {'; '.join(missing)}."
            )
        else:
            runnable.append(remedy)
    return runnable, refused


def _measure(result, max_new_tokens) -> dict:
    # the stop token is the engine's signal, not part of the text whose repetition we measure
    generated = result.token_ids[:-1] if result.eos_reason is EosReason.STOP_TOKEN else result.token_ids
    loop = find_tail_loop(generated)
    return {
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


def _summarise(tables: dict[str, pd.DataFrame], parameters: dict, env: dict, refused: list[str]) -> ExperimentResult:
    outputs, remedy_outputs = tables["outputs"], tables["remedies"]
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
        .agg(
            loop_rate=("loop", "mean"),
            distinct_2=("distinct_2", "mean"),
            new_tokens=("new_tokens", "mean"),
            n=("loop", "size"),
        )
        .reset_index()
    )
    tables["grid"] = grid
    compared = [r for r in REMEDIES if r is not remedies.NO_PENALTY and r.name in set(remedy_outputs.remedy)]
    comparisons = {r.name: remedies.compare(remedy_outputs, r) for r in compared}
    temperatures = {
        r.name: sorted(map(float, remedy_outputs[remedy_outputs.remedy == r.name].temperature.unique()))
        for r in compared
    }
    effects += remedies.effects(comparisons, temperatures)
    findings = (
        _findings(outputs, by_penalty, effects)
        + remedies.findings(remedy_outputs, comparisons, parameters["max_new_tokens"])
        + refused
    )
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
            "remedies": {
                name: {"temperatures": temperatures[name]} | {k: e.as_dict() for k, e in c.items()}
                for name, c in comparisons.items()
            },
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
    """Loop rate over the penalty grid, one heatmap per temperature; distinct-2; the named remedies' loop rates."""
    grid = result.tables["grid"]
    temperatures = sorted(grid.temperature.unique())
    fig, axes = plt.subplots(1, len(temperatures) + 2, figsize=(5 * (len(temperatures) + 2), 4))
    for ax, temp in zip(axes, temperatures):
        table = grid[grid.temperature == temp].pivot(
            index="token_frequency_penalty", columns="token_repetition_penalty", values="loop_rate"
        )
        sns.heatmap(table, annot=True, fmt=".0%", vmin=0, vmax=1, cmap="rocket_r", ax=ax, cbar=False)
        ax.set(
            title=f"loop rate, temperature {temp:g}",
            xlabel="token_repetition_penalty",
            ylabel="token_frequency_penalty",
        )
    outputs = result.tables["outputs"]
    sns.pointplot(data=outputs, x="token_repetition_penalty", y="distinct_2", hue="temperature", ax=axes[-2])
    axes[-2].set(title="distinct-2 of the output (mean, 95% CI)", ylim=(0, 1))
    _plot_remedies(result, axes[-1])
    fig.suptitle("Field reports 1 and 4: repetition loops against sampler penalties and other remedies")
    fig.tight_layout()
    return fig


def _plot_remedies(result: ExperimentResult, ax) -> None:
    """Each remedy's loop rate (Wilson 95% interval) beside no penalty's on the same prompts and seeds."""
    compared = result.values["remedies"]
    names = list(compared)
    for offset, (key, label) in enumerate((("loop_rate_no_penalty", "no penalty, same jobs"), ("loop_rate", "remedy"))):
        rates = [compared[name][key] for name in names]
        values = [r["value"] for r in rates]
        errors = [[v - r["ci95"][0] for v, r in zip(values, rates)], [r["ci95"][1] - v for v, r in zip(values, rates)]]
        ax.errorbar(
            values,
            [i + 0.15 * (1 - 2 * offset) for i in range(len(names))],
            xerr=errors,
            fmt="o",
            capsize=3,
            label=label,
        )
    ax.set_yticks(
        range(len(names)), [f"{n}\n(t {', '.join(f'{t:g}' for t in compared[n]['temperatures'])})" for n in names]
    )
    ax.invert_yaxis()
    ax.set(title="loop rate by remedy (95% CI)", xlim=(0, 1), xlabel="loop rate")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, fontsize="small")
