"""Field report 2: concurrent requests mixing each other's context.

The fix: one generator per model, one job per request, the generator batches them (what the session does).
The broken pattern: a generator per request, all over the one model cache. Each such generator keeps its
own page table and believes the whole cache is its own, so their jobs write keys and values into the same
cache positions and read each other's.

Both patterns run here on the loaded engine. The broken one is built from the engine's own parts: on the
ExLlamaV2 engine, extra `ExLlamaV2DynamicGenerator`s over the engine's model and cache (exactly the
reporter's code); on the CPU engine, copies of the engine that share its model and KV storage but have their
own page pool and scheduler. Each prompt's output is compared with its output when run alone (greedy).
"""

from __future__ import annotations

import copy
import difflib
import itertools

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from exlnb.analysis import mean_interval, rate_interval
from exlnb.engines.base import Engine, JobSpec, SamplerSettings, wall_clock
from exlnb.engines.cpu.pages import PagePool
from exlnb.engines.cpu.scheduler import Scheduler
from exlnb.experiments.datasets import load_prompts
from exlnb.experiments.record import Effect, ExperimentResult, environment
from exlnb.session import Session
from exlnb.templates import chatml

PATTERNS = ("one generator", "generator per request")
PATTERN_SOURCE = {
    "exllamav2": "The generator-per-request outputs come from real extra ExLlamaV2DynamicGenerators over the engine's "
    "model and cache, the reporter's own pattern.",
    "cpu": "The CPU engine has no ExLlamaV2DynamicGenerator to create twice, so it cannot express the reporter's code "
    "as such. It approximates it with copies of the engine that share the model and its KV storage but keep their own "
    "page pools and schedulers: independent page tables over one cache, the collision separate exllamav2 generators "
    "have. Run this notebook on the ExLlamaV2 engine for the reporter's exact pattern.",
}


def run(
    session: Session, *, prompts: int = 8, max_new_tokens: int = 32, concurrency: tuple[int, ...] = (2, 4, 8)
) -> ExperimentResult:
    """Solo outputs first, then each concurrency level under both patterns."""
    if max(concurrency) > prompts:
        raise ValueError(f"concurrency up to {max(concurrency)} needs at least that many prompts; got prompts={prompts}")
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
    for i, spec in enumerate(specs):
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
            produced = session.run_on_engine(lambda engine: _run_on_separate_generators(engine, batch))
        runs.append(_run_row(pattern, level, produced, wall_clock() - start))
        outputs += [_compare(pattern, level, i, ids, solo, tokenizer) for i, ids in enumerate(produced)]
    tables = {"outputs": pd.DataFrame(outputs), "runs": pd.DataFrame(runs)}
    parameters = dict(prompts=prompts, max_new_tokens=max_new_tokens, concurrency=list(concurrency))
    return _summarise(tables, parameters, environment(session))


def separate_generators(engine: Engine, count: int) -> list[Engine]:
    """`count` generators over the engine's one model and cache, each with its own page table (the bug).

    Built from the engine's own parts, which only this experiment reaches into: the point is to misuse them.
    """
    if engine.name == "exllamav2":
        return [_exllamav2_generator(engine, first_job_id=1 + 1000 * k) for k in range(count)]
    if engine.name == "cpu":
        return [_cpu_generator(engine, first_job_id=1 + 1000 * k) for k in range(count)]
    raise ValueError(f"no generator-per-request pattern for the {engine.name!r} engine")


def _exllamav2_generator(engine: Engine, first_job_id: int) -> Engine:
    """The reporter's code: another ExLlamaV2DynamicGenerator over the same model and cache. Its constructor
    builds a fresh page table over every page of the cache (exllamav2 0.3.2, `reset_page_table`), so it
    allocates the same pages the engine's generator and the other requests' generators use."""
    from exllamav2.generator import ExLlamaV2DynamicGenerator

    twin = copy.copy(engine)
    twin.generator = ExLlamaV2DynamicGenerator(
        model=engine.model,
        cache=engine.cache,
        tokenizer=engine.generator.tokenizer,
        max_batch_size=engine.generator.max_batch_size,
        paged=engine.paged,
    )
    twin._jobs, twin._next_id = {}, first_job_id
    return twin


def _cpu_generator(engine: Engine, first_job_id: int) -> Engine:
    """The CPU engine's equivalent: a copy that shares the model and its KV storage (`_runner`) but has its
    own page pool and scheduler, so it too believes every page is free."""
    from exlnb.engines.cpu.engine import MAX_STEP_TOKENS

    twin = copy.copy(engine)
    twin._pool = _fresh_page_pool(engine)
    twin._scheduler = Scheduler(twin._pool, engine._scheduler.max_batch_size, MAX_STEP_TOKENS)
    twin._ids = itertools.count(first_job_id)
    return twin


def _fresh_page_pool(engine: Engine) -> PagePool:
    return PagePool(len(engine._pool.pages), engine._pool.page_size)


def _run_on_separate_generators(engine: Engine, specs: list[JobSpec]) -> list[tuple[int, ...]]:
    """One generator per request, stepped in turn as concurrent request handlers would (on the engine thread).

    Afterwards the engine forgets what its cache pages hold: the other generators wrote over them, and a
    later job reusing a "cached" prompt page would read their keys and values.
    """
    if engine.has_work():
        raise RuntimeError("the engine has jobs running; the generator-per-request run would overwrite their cache")
    try:
        return _step_in_turn(separate_generators(engine, len(specs)), specs)
    finally:
        _forget_cache_contents(engine)


def _forget_cache_contents(engine: Engine) -> None:
    if engine.name == "exllamav2":
        engine.generator.reset_page_table()
    else:
        engine._pool = engine._scheduler.pool = _fresh_page_pool(engine)


def _step_in_turn(generators: list[Engine], specs: list[JobSpec]) -> list[tuple[int, ...]]:
    tokens: dict[int, list[int]] = {}
    running = {}
    for generator, spec in zip(generators, specs):
        job_id = generator.enqueue(spec)
        tokens[job_id], running[job_id] = [], generator
    order = list(tokens)
    while running:
        for job_id, generator in list(running.items()):
            for event in generator.step():
                tokens[event.job_id] += event.token_ids
                if event.eos:
                    running.pop(event.job_id, None)
    return [tuple(tokens[job_id]) for job_id in order]


def _run_row(pattern: str, level: int, produced: list[tuple[int, ...]], seconds: float) -> dict:
    new = sum(len(ids) for ids in produced)
    return {"pattern": pattern, "concurrency": level, "new_tokens": new, "seconds": seconds, "tokens_per_s": new / seconds}


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


def _summarise(tables: dict[str, pd.DataFrame], parameters: dict, env: dict) -> ExperimentResult:
    outputs, runs = tables["outputs"], tables["runs"]
    top = max(parameters["concurrency"])
    at_top = {p: outputs[(outputs.pattern == p) & (outputs.concurrency == top)] for p in PATTERNS}
    measures = (
        (f"outputs that differ from their solo output ({top} concurrent requests)",
         lambda g: rate_interval(int((~g.identical_to_solo).sum()), len(g))),
        (f"similarity to own solo output ({top} concurrent requests), mean",
         lambda g: mean_interval(g.similarity_to_own_solo, "fraction")),
    )
    broken, fixed = PATTERNS[1], PATTERNS[0]
    effects = [Effect(name, measure(at_top[broken]), measure(at_top[fixed]), broken, fixed) for name, measure in measures]
    solo_rate = runs[runs.pattern == "solo"].tokens_per_s
    values = {
        "concurrent_requests": top,
        "identical_to_solo": {p: int(g.identical_to_solo.sum()) for p, g in at_top.items()},
        "outputs_closer_to_another_prompt": {p: int((g.closest_solo != g.prompt).sum()) for p, g in at_top.items()},
        "solo_tokens_per_s": mean_interval(solo_rate, "tokens/s").as_dict(),
        "aggregate_tokens_per_s": {
            p: {int(r.concurrency): float(r.tokens_per_s) for r in runs[runs.pattern == p].itertuples()} for p in PATTERNS
        },
    }
    return ExperimentResult(
        name="concurrency",
        field_reports=(2,),
        tables=tables,
        effects=effects,
        parameters=parameters,
        environment=env,
        findings=[*_findings(values), PATTERN_SOURCE[env["engine"]]],
        values=values,
    )


def _findings(values: dict) -> list[str]:
    top, same, closer = values["concurrent_requests"], values["identical_to_solo"], values["outputs_closer_to_another_prompt"]
    throughput = values["aggregate_tokens_per_s"]

    def rates(pattern: str) -> str:
        return ", ".join(f"{c} jobs {v:.1f} tokens/s" for c, v in throughput[pattern].items())

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
    sns.lineplot(data=runs[runs.pattern != "solo"], x="concurrency", y="tokens_per_s", hue="pattern", marker="o", ax=axes[1])
    axes[1].axhline(solo, color="grey", linestyle=":", label="one job alone")
    axes[1].set(ylabel="aggregate new tokens/s", title="Throughput against concurrency")
    axes[1].legend()
    fig.tight_layout()
    return fig
