"""Field reports 4 and 5: speed falling as the context grows, and a prompt speed that cannot be true.

Three measurements:
- multi-turn chat with the whole history in every prompt (the chat example) against amnesia (only the new
  question): decode speed per turn;
- decode speed against context length, from the time between consecutive tokens;
- prompt (prefill) speed read from a clock that stops when the call returns, against one read after
  synchronising the device, through the reporter's own call (`prompt_clocks.py`). Only the ExLlamaV2
  engine on CUDA has an asynchronous queue to show it; elsewhere the run says so in a line.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from exlnb.analysis import median_interval, ratio_of_medians
from exlnb.datasets import filler_ids, load_prompts
from exlnb.engines.base import SamplerSettings
from exlnb.experiments import prompt_clocks
from exlnb.experiments.record import Effect, ExperimentResult, environment
from exlnb.experiments.timed_models import (
    BUNDLED,
    TIMED_MODELS,
    cannot_time,
    check_model_names,
    effect_prefix,
    finding_subject,
    session_for,
)
from exlnb.random_model import LLAMA_7B
from exlnb.session import Session

# the reporters' numbers (Mistral 7B): 40 -> ~10 tokens/s over many chat turns (report 4); 31 tokens/s with a
# short prompt, 20 with ~1000 tokens, and 1441 prompt tokens "in 0.10 s" = 14,982 tokens/s (report 5)
REPORTED = {
    "chat_decode_tokens_per_s": [40, 10],
    "decode_tokens_per_s_short_vs_1000_prompt": [31, 20],
    "prompt_tokens": 1441,
    "prompt_seconds_unsynchronised": 0.10,
    "prompt_tokens_per_s_unsynchronised": 14982,
}
REPORTED_PROMPT_SPEED = "14,982 tokens/s, 1441 tokens in 0.10 s"


def run(
    session: Session,
    *,
    turns: int = 6,
    answer_tokens: int = 32,
    context_lengths: tuple[int, ...] = (128, 1024, 2048, 4096),
    decode_tokens: int = 16,
    prompt_lengths: tuple[int, ...] = (256, 1441, 4000),
    timing_repeats: int = 3,
    prompt_models: tuple[str, ...] = TIMED_MODELS,
    speed_models: tuple[str, ...] = TIMED_MODELS,
) -> ExperimentResult:
    prompt_clocks.check_prompt_models(prompt_models, prompt_lengths)
    check_model_names(speed_models)
    chats, contexts, speed_not_timed = [], [], []
    for model in speed_models:
        if reason := cannot_time(model):
            speed_not_timed.append(f"{model}: {reason}; its chat and context-length timings were not taken.")
            continue
        lengths = context_lengths
        if model != BUNDLED:  # the 7B-shaped model times the lengths its positions hold
            lengths = tuple(n for n in context_lengths if n + decode_tokens <= LLAMA_7B["max_position_embeddings"])
            if left := sorted(set(context_lengths) - set(lengths)):
                speed_not_timed.append(
                    f"{model}: context {', '.join(map(str, left))} and {decode_tokens} new tokens exceed "
                    f"its {LLAMA_7B['max_position_embeddings']} positions; not timed."
                )
        # the 7B-shaped model's cache holds the longest context; its random weights answer nonsense and may draw
        # the end token at any point, so its answers run to their length
        with session_for(model, session, max(lengths) + decode_tokens) as timed:
            speed = _speed(
                timed, turns, answer_tokens, lengths, decode_tokens, timing_repeats, stop_at_eos=model == BUNDLED
            )
        chats.append(speed["turns"].assign(model=model))
        contexts.append(speed["context"].assign(model=model))
    tables = {"turns": _frame(chats, TURN_COLUMNS), "context": _frame(contexts, CONTEXT_COLUMNS)}
    tables["prefill"], not_timed = prompt_clocks.time_prompt_passes(
        session, models=prompt_models, lengths=prompt_lengths, repeats=timing_repeats
    )
    parameters = dict(
        turns=turns,
        answer_tokens=answer_tokens,
        context_lengths=list(context_lengths),
        decode_tokens=decode_tokens,
        prompt_lengths=list(prompt_lengths),
        timing_repeats=timing_repeats,
        prompt_models=list(prompt_models),
        speed_models=list(speed_models),
    )
    return _summarise(tables, not_timed, speed_not_timed, parameters, environment(session))


TURN_COLUMNS = ["model", "mode", "turn", "context_tokens", "prompt_tokens", "cached_tokens", "token_interval_s"]
CONTEXT_COLUMNS = ["model", "context_tokens", "repeat", "position", "token_interval_s"]


def _frame(parts: list[pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    return pd.concat(parts, ignore_index=True)[columns] if parts else pd.DataFrame(columns=columns)


def _speed(
    session: Session,
    turns: int,
    answer_tokens: int,
    lengths: tuple[int, ...],
    decode_tokens: int,
    repeats: int,
    *,
    stop_at_eos: bool = True,
) -> dict[str, pd.DataFrame]:
    """Reports 4 and 5's decode timings on one session's model: the chat both ways, then the context lengths."""
    _warm_up(session, decode_tokens)
    return {
        "turns": _chat(session, turns, answer_tokens, stop_at_eos=stop_at_eos),
        "context": _decode_against_context(session, lengths, decode_tokens, repeats),
    }


# -- multi-turn chat --------------------------------------------------------------------------------------------


def _warm_up(session: Session, decode_tokens: int) -> None:
    """One untimed generation first: the first steps after a load pay one-off costs (kernel choice, allocator
    growth, caches) that would otherwise land on whichever condition is timed first."""
    ids = filler_ids(session.tokenizer, 64, label="warm-up")
    session.complete(ids, max_new_tokens=decode_tokens, sampler=SamplerSettings.greedy(), stop_at_eos=False)


def _chat(session: Session, turns: int, answer_tokens: int, *, stop_at_eos: bool = True) -> pd.DataFrame:
    """The same questions as one growing conversation and as independent prompts (--amnesia), turn by turn
    in alternating order, so that drift in the machine's speed falls on both modes alike."""
    questions = load_prompts("long_answers")[:turns]
    tokenizer = session.tokenizer
    rows, history = [], []
    for turn, question in enumerate(questions):
        asked = {"role": "user", "content": question}
        answers = {}
        for mode in ("history", "amnesia") if turn % 2 == 0 else ("amnesia", "history"):
            messages = [*history, asked] if mode == "history" else [asked]
            ids = tokenizer.encode(tokenizer.apply_chat_template(messages), special=True)
            stream = session.generate(
                ids,
                max_new_tokens=answer_tokens,
                sampler=SamplerSettings.greedy(),
                stop_at_eos=stop_at_eos,
                identifier=f"{mode} turn {turn}",
            )
            intervals = _token_intervals(stream)
            result = stream.result()
            answers[mode] = result.text
            rows += [
                {
                    "mode": mode,
                    "turn": turn,
                    "context_tokens": len(ids) + i + 1,
                    "prompt_tokens": len(ids),
                    "cached_tokens": result.cached_tokens,
                    "token_interval_s": dt,
                }
                for i, dt in enumerate(intervals)
            ]
        history += [asked, {"role": "assistant", "content": answers["history"]}]
    return pd.DataFrame(rows).sort_values(["mode", "turn"], kind="stable", ignore_index=True)


def _token_intervals(stream) -> list[float]:
    """Seconds per new token after the first event's, from the engine's synchronised production times.

    An event can carry several tokens: the library holds back text that ends in part of a UTF-8 character
    until the character is whole. The 7B-shaped model's random tokens did so often enough on the H100 that
    one 16-token decode came as 3 events, whose two gaps read as 87 and 198 ms "per token". So an event's gap
    is shared out over its tokens, one interval each, and every token counts once.
    """
    intervals, previous = [], None
    for event in stream:
        if not event.token_ids:
            continue
        if previous is not None:
            count = len(event.token_ids)
            intervals += [(event.time_produced - previous) / count] * count
        previous = event.time_produced
    return intervals


# -- decode speed against context length ------------------------------------------------------------------------


def _decode_against_context(
    session: Session, lengths: tuple[int, ...], decode_tokens: int, repeats: int
) -> pd.DataFrame:
    """Each context length `repeats` times, the order rotated from one round to the next, so that every length
    is timed early and late in the run: measured once each in a fixed order, the first length took the run's
    warm-up and its drift (on the H100, 17-20 ms tokens at the start of a run whose later ones took 11-14 ms)."""
    limit = session.status().cache_tokens - decode_tokens
    if max(lengths) > limit:
        raise ValueError(
            f"context length {max(lengths)} does not fit the cache with {decode_tokens} new tokens: "
            f"load with cache_tokens >= {max(lengths) + decode_tokens}, or shorten context_lengths"
        )
    contexts = {length: filler_ids(session.tokenizer, length, label=f"context {length}") for length in lengths}
    rows = []
    for repeat in range(repeats):
        shift = repeat % len(lengths)
        for length in (*lengths[shift:], *lengths[:shift]):
            stream = session.generate(
                contexts[length], max_new_tokens=decode_tokens, sampler=SamplerSettings.greedy(), stop_at_eos=False
            )
            rows += [
                {"context_tokens": length, "repeat": repeat, "position": length + i + 1, "token_interval_s": dt}
                for i, dt in enumerate(_token_intervals(stream))
            ]
    return pd.DataFrame(rows)


# -- summary and figure -----------------------------------------------------------------------------------------


def _summarise(
    tables: dict[str, pd.DataFrame], not_timed: list[str], speed_not_timed: list[str], parameters: dict, env: dict
) -> ExperimentResult:
    turns, context, prefill = tables["turns"], tables["context"], tables["prefill"]
    effects, findings, by_model = [], [], {}
    for model in dict.fromkeys(turns.model):  # in the order timed
        model_turns, model_context = turns[turns.model == model], context[context.model == model]
        model_effects = _speed_effects(model_turns, model_context, effect_prefix(model))
        by_model[model] = _speed_values(model_turns, model_context)
        effects += model_effects
        findings += _findings(model_effects, by_model[model], finding_subject(model))
    values = {
        **by_model.get(BUNDLED, {}),
        "speed_by_model": by_model,
        "speed_not_timed": speed_not_timed,
        "prompt_clocks": {"medians": prompt_clocks.clock_medians(prefill).to_dict("records"), "not_timed": not_timed},
        "reported": REPORTED,
    }
    findings += speed_not_timed + prompt_clocks.findings(prefill, not_timed, REPORTED_PROMPT_SPEED)
    return ExperimentResult(
        name="context",
        field_reports=(4, 5),
        tables=tables,
        effects=effects + prompt_clocks.effects(prefill),
        parameters=parameters,
        environment=env,
        findings=findings,
        values=values,
    )


def _speed_effects(turns: pd.DataFrame, context: pd.DataFrame, who: str) -> list[Effect]:
    """One model's two decode effects: the last chat turn with history over amnesia, and the longest context
    over the shortest. `who` names a model other than the session's in front of each effect's name."""
    last = turns.turn.max()
    in_last_turn = {mode: g[g.turn == last].token_interval_s for mode, g in turns.groupby("mode")}
    shortest, longest = context.context_tokens.min(), context.context_tokens.max()
    return [
        _time_per_token(
            f"{who}decode time per token in turn {last + 1}",
            in_last_turn["history"],
            in_last_turn["amnesia"],
            "history",
            "amnesia",
        ),
        _time_per_token(
            f"{who}decode time per token",
            context[context.context_tokens == longest].token_interval_s,
            context[context.context_tokens == shortest].token_interval_s,
            f"context {longest}",
            f"context {shortest}",
        ),
    ]


def _time_per_token(name: str, slow: pd.Series, fast: pd.Series, slow_label: str, fast_label: str) -> Effect:
    """Median time between tokens in ms for two conditions, and their ratio."""
    return Effect(
        name=name,
        symptom=median_interval(slow * 1000, "ms"),
        fix=median_interval(fast * 1000, "ms"),
        symptom_label=slow_label,
        fix_label=fast_label,
        ratio=ratio_of_medians(slow, fast),
    )


def _speed_values(turns: pd.DataFrame, context: pd.DataFrame) -> dict:
    last = turns.turn.max()
    decode_rate = context.groupby("context_tokens").token_interval_s.median().rdiv(1.0)
    return {
        "decode_tokens_per_s_by_context": {int(k): float(v) for k, v in decode_rate.items()},
        "decode_tokens_per_s_by_turn": {
            mode: {int(t): float(1 / g.median()) for t, g in group.groupby("turn").token_interval_s}
            for mode, group in turns.groupby("mode")
        },
        "context_tokens_last_turn": {
            mode: int(g[g.turn == last].prompt_tokens.iloc[0]) for mode, g in turns.groupby("mode")
        },
    }


def _findings(effects: list[Effect], values: dict, subject: str) -> list[str]:
    chat, length = effects
    rates = values["decode_tokens_per_s_by_context"]
    contexts = values["context_tokens_last_turn"]
    return [
        f"{subject}Last chat turn: {contexts['history']} prompt tokens with history, {contexts['amnesia']} with "
        f"amnesia; decode {1000 / chat.symptom.value:.1f} against {1000 / chat.fix.value:.1f} tokens/s "
        f"({chat.ratio.value:.2f}x the time per token, 95% CI {chat.ratio.low:.2f}-{chat.ratio.high:.2f}"
        + (": no slowdown this run can tell from noise at this length" if chat.ratio.low <= 1 else "")
        + "). The reporter saw 40 fall to about 10 tokens/s over many turns with a 7B model; the context-length "
        "measurement below shows where a longer history leads.",
        f"{subject}Decode speed by context length: "
        + ", ".join(f"{k} tokens {v:.1f} tokens/s" for k, v in rates.items())
        + f" ({length.ratio.value:.2f}x the time per token at the longest). The reporter saw 31 -> 20 tokens/s "
        "from a short prompt to ~1000 tokens.",
    ]


def prompt_clock_medians(result: ExperimentResult) -> tuple[pd.DataFrame, list[str]]:
    """Field report 5's early clock reading beside the synchronised one, medians per model, pass and prompt
    length; and, one line each, what was not timed and why (all of it, off the ExLlamaV2 engine on CUDA)."""
    return prompt_clocks.clock_medians(result.tables["prefill"]), result.values["prompt_clocks"]["not_timed"]


def plot(result: ExperimentResult):
    """Chat history against amnesia and speed against context length where speed was timed, and the prompt
    clocks where they were (the ExLlamaV2 engine on CUDA). A panel with nothing to show is left out, and the
    findings say why; None where no panel is left."""
    turns, context, prefill = result.tables["turns"], result.tables["context"], result.tables["prefill"]
    panels = (2 if not turns.empty else 0) + (1 if not prefill.empty else 0)
    if panels == 0:
        return None
    fig, axes = plt.subplots(1, panels, figsize=(5.4 * panels, 4.3), squeeze=False)
    axes = list(axes[0])
    if not prefill.empty:
        prompt_clocks.draw_clocks(axes.pop(), prefill)
    if not turns.empty:
        _draw_speed(turns, context, axes)
    fig.tight_layout()
    return fig


def _draw_speed(turns: pd.DataFrame, context: pd.DataFrame, axes) -> None:
    several = turns.model.nunique() > 1
    turns = turns.assign(
        tokens_per_s=1 / turns.token_interval_s, condition=turns["mode"] + (" (" + turns.model + ")" if several else "")
    )
    context = context.assign(tokens_per_s=1 / context.token_interval_s)
    sns.pointplot(
        data=turns, x="turn", y="tokens_per_s", hue="condition", estimator=np.median, errorbar=("pi", 50), ax=axes[0]
    )
    axes[0].set(ylabel="decode tokens/s (median, IQR)", title="Field report 4: chat history against amnesia")
    axes[0].get_legend().set_title("mode (model)" if several else "mode")
    sns.pointplot(
        data=context,
        x="context_tokens",
        y="tokens_per_s",
        hue="model" if several else None,
        estimator=np.median,
        errorbar=("pi", 50),
        ax=axes[1],
    )
    axes[1].set(
        xlabel="context length (tokens)",
        ylabel="decode tokens/s (median, IQR)",
        title="Decode speed against context length",
    )
