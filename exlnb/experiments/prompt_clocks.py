"""Field report 5 through the reporter's own path: a prompt pass timed by a clock read when the call returns
(early) and by one read after synchronising the device (late).

The reporter timed exllamav2's streaming generator (`ExLlamaV2StreamingGenerator.begin_stream_ex`, as in
exllamav2's examples/streaming.py). Its prompt pass is `model.forward(..., preprocess_only=True)`, which
returns no logits and so need not wait for the GPU: a clock read when it returns may stop while the work is
still queued. Beside it, the dynamic generator as exlnb's engine steps it. Both run on the notebook's model
(the bundled one) and on a 7B-shaped model with random weights (`exlnb.random_model`: meaningless text, real
timings), whose heavier GPU work per token gives the early clock the most to miss. The engine
lends both passes (`Engine.lend_prompt_pass`); only the ExLlamaV2 engine on CUDA has them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import seaborn as sns

from exlnb.analysis import median_interval, ratio_of_medians
from exlnb.datasets import filler_ids
from exlnb.engines.base import Engine, wall_clock
from exlnb.experiments.record import Effect
from exlnb.experiments.timed_models import cannot_time, check_model_names, session_for
from exlnb.random_model import LLAMA_7B, SEVEN_B_SHAPED
from exlnb.session import Session

READING_COLUMNS = ["model", "prompt_pass", "prompt_tokens", "repeat", "early_s", "late_s"]
RATE_COLUMNS = ["early_tokens_per_s", "late_tokens_per_s", "early_over_late"]
EARLY = "clock read when the call returns"
LATE = "clock read after torch.cuda.synchronize()"
CLEARLY_EARLY = 1.5  # an early clock that makes the pass look this many times faster shows the report's mistake


def check_prompt_models(models: Sequence[str], lengths: Sequence[int]) -> None:
    """Refuse an unknown model, or a prompt the 7B-shaped model has no positions for, before anything runs."""
    if not lengths or min(lengths) < 2:
        raise ValueError(
            f"prompt_lengths={tuple(lengths)!r}: give one or more lengths of at least 2 tokens "
            "(the streaming generator passes all but the last prompt token)"
        )
    check_model_names(models)
    positions = LLAMA_7B["max_position_embeddings"]
    if SEVEN_B_SHAPED in models and max(lengths) + 1 > positions:
        raise ValueError(
            f"prompt length {max(lengths)} and its first token exceed the {SEVEN_B_SHAPED} model's "
            f"{positions} positions: keep prompt_lengths below {positions}"
        )


def time_prompt_passes(
    session: Session, *, models: Sequence[str], lengths: Sequence[int], repeats: int
) -> tuple[pd.DataFrame, list[str]]:
    """Every prompt pass the engine lends, on each model, at each length, `repeats` times: one row per pass
    with both clock readings and the rates from them; and, one line each, what was not timed and why."""
    check_prompt_models(models, lengths)
    passes = list(session.run_on_engine(lambda engine: engine.prompt_passes))
    if not passes:
        engine = session.status().engine
        return clock_rates(pd.DataFrame(columns=READING_COLUMNS)), [
            f"Field report 5's prompt passes (exllamav2's streaming generator and its dynamic generator) need the "
            f"ExLlamaV2 engine on CUDA; this session runs the {engine} engine, so they were not timed."
        ]
    rows, not_timed = [], []
    for model in models:
        if reason := cannot_time(model):
            not_timed.append(f"{model}: {reason}; not timed.")
            continue
        # the 7B-shaped model gets a cache just large enough for the longest prompt and its first token
        with session_for(model, session, max(lengths) + 1) as timed:
            rows += _time_on(timed, model, passes, lengths, repeats)
    return clock_rates(pd.DataFrame(rows, columns=READING_COLUMNS)), not_timed


def _time_on(session: Session, model: str, passes: list[str], lengths: Sequence[int], repeats: int) -> list[dict]:
    cache_tokens = session.status().cache_tokens
    if max(lengths) + 1 > cache_tokens:
        raise ValueError(
            f"prompt length {max(lengths)} and its first token do not fit the {model} model's cache of "
            f"{cache_tokens} tokens: load with cache_tokens > {max(lengths)}, or shorten prompt_lengths"
        )
    # repeat -1: one untimed pass that warms each pass up; each prompt starts with its own number, so that no
    # pass finds another's tokens already in the cache
    plan = [
        (name, length, repeat)
        for name in passes
        for length, repeat in [(min(lengths), -1), *((n, r) for n in lengths for r in range(repeats))]
    ]
    prompts = [
        filler_ids(session.tokenizer, length, label=f"{n + 1}. {name}") for n, (name, length, _) in enumerate(plan)
    ]

    def measure(engine: Engine) -> list[dict]:
        rows = []
        for (name, length, repeat), ids in zip(plan, prompts):
            early_s, late_s = clock_prompt_pass(engine, name, ids)
            if repeat >= 0:
                rows.append(
                    dict(
                        model=model,
                        prompt_pass=name,
                        prompt_tokens=length,
                        repeat=repeat,
                        early_s=early_s,
                        late_s=late_s,
                    )
                )
        return rows

    return session.run_on_engine(measure)


def clock_prompt_pass(engine: Engine, name: str, ids: Sequence[int]) -> tuple[float, float]:
    """Seconds from the call to its return (the reporter's reading), and to the device being done with it."""
    with engine.lend_prompt_pass(name) as prompt_pass:
        engine.synchronize()  # nothing earlier is still queued when the clock starts
        start = wall_clock()
        prompt_pass.begin(ids)
        returned = wall_clock()
        engine.synchronize()
        done = wall_clock()
    return returned - start, done - start


def clock_rates(readings: pd.DataFrame) -> pd.DataFrame:
    """Prompt speed from each pair of readings: tokens / early seconds (the reporter's figure), tokens / late
    seconds, and how many times faster the early clock makes the pass look."""
    return readings.assign(
        early_tokens_per_s=readings.prompt_tokens / readings.early_s,
        late_tokens_per_s=readings.prompt_tokens / readings.late_s,
        early_over_late=readings.late_s / readings.early_s,
    )


def clock_medians(table: pd.DataFrame) -> pd.DataFrame:
    """The early reading beside the late one for each model, pass and prompt length: medians of the repeats."""
    columns = ["early_s", "late_s", *RATE_COLUMNS]
    keys = ["model", "prompt_pass", "prompt_tokens"]
    medians = table.groupby(keys, sort=False).agg(repeats=("repeat", "size"), **{c: (c, "median") for c in columns})
    return medians.reset_index()


def effects(table: pd.DataFrame) -> list[Effect]:
    """Early against late prompt speed for each model and pass, at the longest prompt."""
    longest = table[table.prompt_tokens == table.prompt_tokens.max()]
    return [
        Effect(
            name=f"prompt speed, {model}, {name} pass, {tokens} tokens",
            symptom=median_interval(group.early_tokens_per_s, "tokens/s"),
            fix=median_interval(group.late_tokens_per_s, "tokens/s"),
            symptom_label=EARLY,
            fix_label=LATE,
            ratio=ratio_of_medians(group.early_tokens_per_s, group.late_tokens_per_s),
        )
        for (model, name, tokens), group in longest.groupby(["model", "prompt_pass", "prompt_tokens"], sort=False)
    ]


def findings(table: pd.DataFrame, not_timed: list[str], reported: str) -> list[str]:
    """Per model and pass, the early and late readings at the longest prompt, and whether the early one is
    early enough to be the report's impossible number; then what was not timed."""
    medians = clock_medians(table)
    ratios = table.groupby(["model", "prompt_pass", "prompt_tokens"], sort=False).early_over_late
    lines = []
    for row in medians[medians.prompt_tokens == medians.prompt_tokens.max()].itertuples():
        each = ratios.get_group((row.model, row.prompt_pass, row.prompt_tokens))
        spread = f" (median of {len(each)} passes, {each.min():.2f}x to {each.max():.2f}x)" if len(each) > 1 else ""
        line = (
            f"{row.model} model, {row.prompt_pass} pass, {row.prompt_tokens} prompt tokens: {EARLY} "
            f"{row.early_s:.3g} s ({row.early_tokens_per_s:,.0f} tokens/s), {LATE} {row.late_s:.3g} s "
            f"({row.late_tokens_per_s:,.0f} tokens/s), medians: the early clock makes each pass look "
            f"{row.early_over_late:.2f}x as fast as it ran{spread}. "
        )
        lines.append(
            line + (_early_enough(reported) if row.early_over_late >= CLEARLY_EARLY else _not_early(row.prompt_pass))
        )
    return lines + not_timed


def _early_enough(reported: str) -> str:
    return (
        f"The call returned with the work still queued on the GPU: field report 5's mistake ({reported}), reproduced."
    )


def _not_early(name: str) -> str:
    if name == "dynamic":
        return (
            "exllamav2's dynamic generator waits for the GPU before it hands out a first token (it synchronises "
            "in iterate_gen and copies the logits back), so a clock read after that token is late already."
        )
    return (
        "The call returned only after the GPU had done nearly all of the work (the host queued the kernels no "
        "faster than the GPU ran them, or the call waited for it), so the early clock had nothing left to miss."
    )


def draw_clocks(ax, table: pd.DataFrame) -> None:
    """Prompt speed against prompt length, early and late clock, one line per model and pass."""
    ax.set(title="Field report 5: prompt speed by clock", xlabel="prompt tokens", ylabel="prompt tokens/s (median)")
    long = table.melt(
        id_vars=["model", "prompt_pass", "prompt_tokens"],
        value_vars=RATE_COLUMNS[:2],
        var_name="clock",
        value_name="tokens_per_s",
    )
    long["clock"] = long.clock.map(
        {"early_tokens_per_s": "early (when the call returns)", "late_tokens_per_s": "late (after synchronising)"}
    )
    long["pass"] = long.model + ", " + long.prompt_pass
    sns.lineplot(
        data=long,
        x="prompt_tokens",
        y="tokens_per_s",
        hue="pass",
        style="clock",
        estimator=np.median,
        errorbar=None,
        markers=True,
        ax=ax,
    )
    ax.set(yscale="log")
