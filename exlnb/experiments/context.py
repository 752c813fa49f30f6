"""Field reports 4 and 5: speed falling as the context grows, and a prompt speed that cannot be true.

Three measurements:
- multi-turn chat with the whole history in every prompt (the chat example) against amnesia (only the new
  question): decode speed per turn;
- decode speed against context length, from the time between consecutive tokens;
- prompt (prefill) speed read from a clock that stops when the work is queued, against one read after
  synchronising the device. On the CPU there is no asynchronous queue: both clocks read after the work
  is done, so the impossible number of field report 5 needs a GPU to appear.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from exlnb.analysis import median_interval, ratio_of_medians
from exlnb.engines.base import Engine, SamplerSettings, wall_clock
from exlnb.datasets import load_prompts, load_questions
from exlnb.experiments.record import Effect, ExperimentResult, environment
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
UNSYNCHRONISED = "returned (unsynchronised)"  # the prefill clocks, as the prefill table names them
SYNCHRONISED = "after torch.cuda.synchronize()"


def run(
    session: Session,
    *,
    turns: int = 6,
    answer_tokens: int = 32,
    context_lengths: tuple[int, ...] = (128, 1024, 2048, 4096),
    decode_tokens: int = 16,
    prompt_tokens: int = 1441,
    timing_repeats: int = 3,
) -> ExperimentResult:
    tables = {
        "turns": _chat(session, turns, answer_tokens),
        "context": _decode_against_context(session, context_lengths, decode_tokens),
        "prefill": _prefill_timing(session, prompt_tokens, timing_repeats),
    }
    parameters = dict(
        turns=turns,
        answer_tokens=answer_tokens,
        context_lengths=list(context_lengths),
        decode_tokens=decode_tokens,
        prompt_tokens=prompt_tokens,
        timing_repeats=timing_repeats,
    )
    return _summarise(tables, parameters, environment(session))


# -- multi-turn chat --------------------------------------------------------------------------------------------


def _chat(session: Session, turns: int, answer_tokens: int) -> pd.DataFrame:
    """The same questions as one growing conversation and as independent prompts (--amnesia)."""
    questions = load_prompts("long_answers")[:turns]
    tokenizer = session.tokenizer
    rows = []
    for mode in ("history", "amnesia"):
        history: list[dict[str, str]] = []
        for turn, question in enumerate(questions):
            messages = [*history, {"role": "user", "content": question}] if mode == "history" else [
                {"role": "user", "content": question}
            ]
            ids = tokenizer.encode(tokenizer.apply_chat_template(messages), special=True)
            stream = session.generate(ids, max_new_tokens=answer_tokens, sampler=SamplerSettings.greedy(), identifier=f"{mode} turn {turn}")
            intervals = _token_intervals(stream)
            result = stream.result()
            history += [{"role": "user", "content": question}, {"role": "assistant", "content": result.text}]
            rows += [
                {"mode": mode, "turn": turn, "context_tokens": len(ids) + i + 1, "prompt_tokens": len(ids),
                 "cached_tokens": result.cached_tokens, "token_interval_s": dt}
                for i, dt in enumerate(intervals)
            ]
    return pd.DataFrame(rows)


def _token_intervals(stream) -> list[float]:
    """Seconds between consecutive new tokens, from the engine's synchronised production times."""
    times = [event.time_produced for event in stream if event.token_ids]
    return list(np.diff(times))


# -- decode speed against context length ------------------------------------------------------------------------


def _decode_against_context(session: Session, lengths: tuple[int, ...], decode_tokens: int) -> pd.DataFrame:
    limit = session.status().cache_tokens - decode_tokens
    if max(lengths) > limit:
        raise ValueError(f"context length {max(lengths)} does not fit the cache with {decode_tokens} new tokens: "
                         f"load with cache_tokens >= {max(lengths) + decode_tokens}, or shorten context_lengths")
    rows = []
    for length in lengths:
        ids = filler_ids(session, length, label=f"context {length}")
        stream = session.generate(ids, max_new_tokens=decode_tokens, sampler=SamplerSettings.greedy(), stop_at_eos=False)
        rows += [
            {"context_tokens": length, "position": length + i + 1, "token_interval_s": dt}
            for i, dt in enumerate(_token_intervals(stream))
        ]
    return pd.DataFrame(rows)


def filler_ids(session: Session, length: int, *, label: str) -> list[int]:
    """A prompt of exactly `length` tokens of ordinary text, starting with `label` so that no two prompts
    share a cached prefix (a shared prefix would skip the prefill being measured)."""
    sentences = [*load_questions().question, *load_prompts("long_answers")]
    text, n, chars = label + ".", 0, 5 * length  # about 4 characters per token: usually one encode is enough
    while True:
        while len(text) < chars:
            text += f" Note {n}: {sentences[n % len(sentences)]}"
            n += 1
        ids = session.tokenizer.encode(text, special=False)
        if len(ids) >= length:
            return ids[:length]
        chars *= 2


# -- prompt speed with and without synchronisation ---------------------------------------------------------------


def _prefill_timing(session: Session, prompt_tokens: int, repeats: int) -> pd.DataFrame:
    """Prefill of the same number of tokens, timed by the clock a user would read and by a synchronised one."""
    rows = []
    for repeat in range(repeats):
        ids = filler_ids(session, prompt_tokens, label=f"prefill timing {repeat}")
        if session.status().engine == "exllamav2":
            returned, synchronised = session.run_on_engine(lambda engine: _exllamav2_prefill(engine, ids))
            rows += [
                {"repeat": repeat, "clock": UNSYNCHRONISED, "tokens": len(ids), "seconds": returned},
                {"repeat": repeat, "clock": SYNCHRONISED, "tokens": len(ids), "seconds": synchronised},
            ]
        result = session.complete(ids, max_new_tokens=1, sampler=SamplerSettings.greedy())
        rows.append({"repeat": repeat, "clock": "exlnb session (synchronised)", "tokens": len(ids) - result.cached_tokens,
                     "seconds": result.time_to_first_token_s})
    table = pd.DataFrame(rows)
    table["tokens_per_s"] = table.tokens / table.seconds
    return table


def _exllamav2_prefill(engine: Engine, ids: list[int]) -> tuple[float, float]:
    """Ingest a prompt the way a streaming generator's begin_stream does (forward with preprocess_only), into
    a cache of its own; read the clock when the call returns and again after synchronising."""
    import torch
    from exllamav2 import ExLlamaV2Cache

    cache = ExLlamaV2Cache(engine.model, max_seq_len=-(-(len(ids) + 1) // 256) * 256)
    input_ids = torch.tensor([ids], dtype=torch.long)
    engine.model.forward(input_ids[:, :32], cache, preprocess_only=True)  # warm-up
    torch.cuda.synchronize()
    cache.current_seq_len = 0
    start = wall_clock()
    engine.model.forward(input_ids, cache, preprocess_only=True)
    returned = wall_clock()
    torch.cuda.synchronize()
    done = wall_clock()
    del cache
    return returned - start, done - start


# -- summary and figure -----------------------------------------------------------------------------------------


def _summarise(tables: dict[str, pd.DataFrame], parameters: dict, env: dict) -> ExperimentResult:
    turns, context, prefill = tables["turns"], tables["context"], tables["prefill"]
    last = turns.turn.max()
    in_last_turn = {mode: g[g.turn == last].token_interval_s for mode, g in turns.groupby("mode")}
    shortest, longest = context.context_tokens.min(), context.context_tokens.max()
    effects = [
        _time_per_token(f"decode time per token in turn {last + 1}", in_last_turn["history"], in_last_turn["amnesia"],
                        "history", "amnesia"),
        _time_per_token(
            "decode time per token",
            context[context.context_tokens == longest].token_interval_s,
            context[context.context_tokens == shortest].token_interval_s,
            f"context {longest}",
            f"context {shortest}",
        ),
    ]
    by_clock = {clock: g.tokens_per_s for clock, g in prefill.groupby("clock")}
    if UNSYNCHRONISED in by_clock:
        early, synchronised = by_clock[UNSYNCHRONISED], by_clock[SYNCHRONISED]
        effects.append(
            Effect(
                name=f"prompt speed, {parameters['prompt_tokens']} tokens",
                symptom=median_interval(early, "tokens/s"),
                fix=median_interval(synchronised, "tokens/s"),
                symptom_label="clock read when the call returns",
                fix_label="clock read after synchronising",
                ratio=ratio_of_medians(early, synchronised),
            )
        )
    values = _values(turns, context, by_clock)
    return ExperimentResult(
        name="context",
        field_reports=(4, 5),
        tables=tables,
        effects=effects,
        parameters=parameters,
        environment=env,
        findings=_findings(effects, values, env),
        values=values,
    )


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


def _values(turns: pd.DataFrame, context: pd.DataFrame, by_clock: dict[str, pd.Series]) -> dict:
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
        "prompt_tokens_per_s": {clock: median_interval(v, "tokens/s").as_dict() for clock, v in by_clock.items()},
        "reported": REPORTED,
    }


def _findings(effects: list[Effect], values: dict, env: dict) -> list[str]:
    chat, length = effects[0], effects[1]
    rates = values["decode_tokens_per_s_by_context"]
    contexts = values["context_tokens_last_turn"]
    lines = [
        f"Last chat turn: {contexts['history']} prompt tokens with history, {contexts['amnesia']} with amnesia; decode "
        f"{1000 / chat.symptom.value:.1f} against {1000 / chat.fix.value:.1f} tokens/s ({chat.ratio.value:.2f}x the time "
        f"per token, 95% CI {chat.ratio.low:.2f}-{chat.ratio.high:.2f}"
        + (": no slowdown this run can tell from noise at this length" if chat.ratio.low <= 1 else "")
        + "). The reporter saw 40 fall to about 10 tokens/s over many turns with a 7B model; the context-length "
        "measurement below shows where a longer history leads.",
        "Decode speed by context length: " + ", ".join(f"{k} tokens {v:.1f} tokens/s" for k, v in rates.items())
        + f" ({length.ratio.value:.2f}x the time per token at the longest). The reporter saw 31 -> 20 tokens/s "
        "from a short prompt to ~1000 tokens.",
    ]
    prompt = values["prompt_tokens_per_s"]
    if len(effects) > 2:
        sync = effects[2]
        lines.append(
            f"Prompt speed read when the call returns: {sync.symptom.value:,.0f} tokens/s; after synchronising: "
            f"{sync.fix.value:,.0f} tokens/s ({sync.ratio.value:.1f}x). The reporter's unsynchronised reading was "
            "14,982 tokens/s (1441 tokens in 0.10 s)."
        )
        if sync.ratio.low <= 1.5:
            lines.append(
                "Here the call returned only after the GPU had done most of the work (something inside it "
                "synchronised), so the early clock read is barely early: the report's impossible number does not "
                "appear with this call on this machine."
            )
    else:
        session_rate = prompt["exlnb session (synchronised)"]["value"]
        lines.append(
            f"On the {env['engine']} engine ({env['device']}) there is no asynchronous device queue: a clock read "
            f"without synchronising already reads after the work is done, so the impossible number of field report 5 "
            f"cannot appear here. The measured prompt speed is {session_rate:,.0f} tokens/s. Run this notebook on a "
            "GPU (ExLlamaV2 engine) to see the unsynchronised reading."
        )
    return lines


def plot(result: ExperimentResult):
    turns, context, prefill = result.tables["turns"], result.tables["context"], result.tables["prefill"]
    turns = turns.assign(tokens_per_s=1 / turns.token_interval_s)
    context = context.assign(tokens_per_s=1 / context.token_interval_s)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.3))
    sns.pointplot(data=turns, x="turn", y="tokens_per_s", hue="mode", estimator=np.median, errorbar=("pi", 50), ax=axes[0])
    axes[0].set(ylabel="decode tokens/s (median, IQR)", title="Field report 4: chat history against amnesia")
    sns.pointplot(data=context, x="context_tokens", y="tokens_per_s", estimator=np.median, errorbar=("pi", 50), ax=axes[1])
    axes[1].set(xlabel="context length (tokens)", ylabel="decode tokens/s (median, IQR)",
                title="Decode speed against context length")
    sns.barplot(data=prefill, x="clock", y="tokens_per_s", estimator=np.median, errorbar=("pi", 100), ax=axes[2])
    axes[2].set(xlabel="", ylabel="prompt tokens/s", yscale="log", title="Field report 5: prompt speed by clock")
    axes[2].tick_params(axis="x", rotation=15)
    fig.tight_layout()
    return fig
