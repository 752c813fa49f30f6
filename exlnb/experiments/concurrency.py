"""Field report 2: concurrent requests mixing each other's context.

The fix: one generator per model, one job per request, the generator batches them (what the session does).
The broken pattern: a generator per request, all over the one model cache. Each such generator keeps its
own page table and believes the whole cache is its own, so their jobs write keys and values into the same
cache positions and read each other's.

Both patterns run here on the loaded engine. The broken one is the engine's own
`run_with_separate_generators`: on the ExLlamaV2 engine, extra `ExLlamaV2DynamicGenerator`s over the
engine's model and cache (exactly the reporter's code); on the ExLlamaV3 engine, extra exllamav3 Generators,
which the library refuses (the finding there); on the CPU engine, copies of the engine that share its model
and KV storage but have their own page pool and scheduler. Each prompt's output is compared with its output
when run alone (greedy).
"""

from __future__ import annotations

import difflib
import itertools

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from exlnb.analysis import mean_interval, rate_interval
from exlnb.datasets import load_prompts
from exlnb.engines.base import JobSpec, SamplerSettings, SeparateGeneratorsRefused, wall_clock
from exlnb.experiments.record import Effect, ExperimentResult, environment
from exlnb.session import Session
from exlnb.templates import chatml

PATTERNS = ("one generator", "generator per request")


def run(
    session: Session, *, prompts: int = 8, max_new_tokens: int = 32, concurrency: tuple[int, ...] = (2, 4, 8)
) -> ExperimentResult:
    """Solo outputs first, then each concurrency level under both patterns."""
    if max(concurrency) > prompts:
        raise ValueError(
            f"concurrency up to {max(concurrency)} needs at least that many prompts; got prompts={prompts}"
        )
    tokenizer = session.tokenizer
    specs = [
        JobSpec(
            input_ids=tuple(tokenizer.encode(chatml(p), special=True)),
            max_new_tokens=max_new_tokens,  # no stop tokens: every job does the same amount of work
            sampler=SamplerSettings.greedy(),
            identifier=f"prompt {i}",
        )
        for i, p in enumerate(load_prompts("long_answers")[:prompts])
    ]
    runs, outputs = [], []
    solo = []
    refusal = None  # the library's own refusal of the generator-per-request pattern, where it has one
    for spec in specs:
        start = wall_clock()
        solo.append(session.submit(spec).result().token_ids)
        runs.append(_run_row("solo", 1, [solo[-1]], wall_clock() - start))
    for level, pattern in itertools.product(concurrency, PATTERNS):
        batch = specs[:level]
        start = wall_clock()
        if pattern == "one generator":
            streams = [session.submit(spec) for spec in batch]
            produced = [stream.result().token_ids for stream in streams]
        else:
            try:
                produced = session.run_on_engine(lambda engine: engine.run_with_separate_generators(batch))
            except SeparateGeneratorsRefused as refused:
                refusal = str(refused)
                continue
        runs.append(_run_row(pattern, level, produced, wall_clock() - start))
        outputs += [_compare(pattern, level, i, ids, solo, tokenizer) for i, ids in enumerate(produced)]
    tables = {"outputs": pd.DataFrame(outputs), "runs": pd.DataFrame(runs)}
    parameters = dict(prompts=prompts, max_new_tokens=max_new_tokens, concurrency=list(concurrency))
    pattern_source = session.run_on_engine(lambda engine: engine.separate_generators_note)
    return _summarise(tables, parameters, environment(session), pattern_source, refusal)


def _run_row(pattern: str, level: int, produced: list[tuple[int, ...]], seconds: float) -> dict:
    new = sum(len(ids) for ids in produced)
    return {
        "pattern": pattern,
        "concurrency": level,
        "new_tokens": new,
        "seconds": seconds,
        "tokens_per_s": new / seconds,
    }


def _compare(pattern, level, index, ids, solo, tokenizer) -> dict:
    """How far one output strays from its own solo output, and whose solo output it resembles most."""
    similarity = [difflib.SequenceMatcher(None, ids, other, autojunk=False).ratio() for other in solo[:level]]
    own = solo[index]
    prefix = next((n for n, (a, b) in enumerate(zip(ids, own)) if a != b), min(len(ids), len(own)))
    return {
        "pattern": pattern,
        "concurrency": level,
        "prompt": index,
        "identical_to_solo": tuple(ids) == tuple(own),
        "tokens_before_divergence": prefix,
        "similarity_to_own_solo": similarity[index],
        "closest_solo": max(range(level), key=similarity.__getitem__),
        "text": tokenizer.decode(ids),
        "solo_text": tokenizer.decode(own),
    }


def _summarise(
    tables: dict[str, pd.DataFrame], parameters: dict, env: dict, pattern_source: str, refusal: str | None = None
) -> ExperimentResult:
    outputs, runs = tables["outputs"], tables["runs"]
    top = max(parameters["concurrency"])
    at_top = {p: outputs[(outputs.pattern == p) & (outputs.concurrency == top)] for p in PATTERNS}
    measures = (
        (
            f"outputs that differ from their solo output ({top} concurrent requests)",
            lambda g: rate_interval(int((~g.identical_to_solo).sum()), len(g)),
        ),
        (
            f"similarity to own solo output ({top} concurrent requests), mean",
            lambda g: mean_interval(g.similarity_to_own_solo, "fraction"),
        ),
    )
    broken, fixed = PATTERNS[1], PATTERNS[0]
    effects = (
        []
        if refusal
        else [
            Effect(name, measure(at_top[broken]), measure(at_top[fixed]), broken, fixed) for name, measure in measures
        ]
    )
    measured = {p: g for p, g in at_top.items() if not (refusal and p == broken)}
    solo_rate = runs[runs.pattern == "solo"].tokens_per_s
    values = {
        "concurrent_requests": top,
        "identical_to_solo": {p: int(g.identical_to_solo.sum()) for p, g in measured.items()},
        "outputs_closer_to_another_prompt": {p: int((g.closest_solo != g.prompt).sum()) for p, g in measured.items()},
        "solo_tokens_per_s": mean_interval(solo_rate, "tokens/s").as_dict(),
        "aggregate_tokens_per_s": {
            p: {int(r.concurrency): float(r.tokens_per_s) for r in runs[runs.pattern == p].itertuples()}
            for p in measured
        },
        "refused": {broken: refusal} if refusal else {},
    }
    return ExperimentResult(
        name="concurrency",
        field_reports=(2,),
        tables=tables,
        effects=effects,
        parameters=parameters,
        environment=env,
        findings=[*_findings(values), pattern_source],
        values=values,
    )


def _findings(values: dict) -> list[str]:
    top, same, closer = (
        values["concurrent_requests"],
        values["identical_to_solo"],
        values["outputs_closer_to_another_prompt"],
    )
    throughput = values["aggregate_tokens_per_s"]

    def rates(pattern: str) -> str:
        return ", ".join(f"{c} jobs {v:.1f} tokens/s" for c, v in throughput[pattern].items())

    if refusal := values["refused"].get("generator per request"):
        return [
            f"With one generator, {same['one generator']} of {top} concurrent outputs equal their solo outputs token "
            "for token.",
            f"A generator per request did not run: {refusal}. Field report 2's mixing cannot happen on this engine; "
            "the pattern fails with an error instead.",
            f"Aggregate throughput, one generator: {rates('one generator')} (one job alone: "
            f"{values['solo_tokens_per_s']['value']:.1f}).",
        ]
    return [
        f"With one generator, {same['one generator']} of {top} concurrent outputs equal their solo outputs token for "
        f"token; with a generator per request, {same['generator per request']} of {top} do.",
        f"With a generator per request, {closer['generator per request']} of {top} outputs resemble another prompt's "
        "solo output more than their own: the blending of field report 2.",
        f"Aggregate throughput, one generator: {rates('one generator')} (one job alone: "
        f"{values['solo_tokens_per_s']['value']:.1f}); a generator per request, each running its own forward passes: "
        f"{rates('generator per request')}.",
    ]


def plot(result: ExperimentResult):
    """Similarity of each output to its solo output, and aggregate throughput, by concurrency and pattern."""
    outputs, runs = result.tables["outputs"], result.tables["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    sns.stripplot(data=outputs, x="concurrency", y="similarity_to_own_solo", hue="pattern", dodge=True, ax=axes[0])
    axes[0].set(ylim=(0, 1.05), ylabel="similarity to the prompt's solo output", title="Field report 2: mixed outputs")
    solo = runs[runs.pattern == "solo"].tokens_per_s.median()
    sns.lineplot(
        data=runs[runs.pattern != "solo"], x="concurrency", y="tokens_per_s", hue="pattern", marker="o", ax=axes[1]
    )
    axes[1].axhline(solo, color="grey", linestyle=":", label="one job alone")
    axes[1].set(ylabel="aggregate new tokens/s", title="Throughput against concurrency")
    axes[1].legend()
    fig.tight_layout()
    return fig
