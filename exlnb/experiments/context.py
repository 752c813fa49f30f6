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

from exlnb.analysis import Estimate, median_interval, ratio_of_medians
from exlnb.engines.base import Engine, SamplerSettings, wall_clock
from exlnb.experiments.datasets import load_prompts, load_questions
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
                {"repeat": repeat, "clock": "returned (unsynchronised)", "tokens": len(ids), "seconds": returned},
                {"repeat": repeat, "clock": "after torch.cuda.synchronize()", "tokens": len(ids), "seconds": synchronised},
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
    last_history = turns[(turns["mode"] == "history") & (turns.turn == last)].token_interval_s
    last_amnesia = turns[(turns["mode"] == "amnesia") & (turns.turn == last)].token_interval_s
    short = context[context.context_tokens == context.context_tokens.min()].token_interval_s
    long = context[context.context_tokens == context.context_tokens.max()].token_interval_s
    effects = [
        Effect(
            name=f"decode time per token in turn {last + 1}",
            symptom=median_interval(last_history * 1000, "ms"),
            fix=median_interval(last_amnesia * 1000, "ms"),
            symptom_label="history",
            fix_label="amnesia",
            ratio=ratio_of_medians(last_history, last_amnesia),
        ),
        Effect(
            name="decode time per token",
            symptom=median_interval(long * 1000, "ms"),
            fix=median_interval(short * 1000, "ms"),
            symptom_label=f"context {context.context_tokens.max()}",
            fix_label=f"context {context.context_tokens.min()}",
            ratio=ratio_of_medians(long, short),
        ),
    ]
    by_clock = {clock: g.tokens_per_s for clock, g in prefill.groupby("clock")}
    if "returned (unsynchronised)" in by_clock:
        effects.append(
            Effect(
                name=f"prompt speed, {parameters['prompt_tokens']} tokens",
                symptom=median_interval(by_clock["returned (unsynchronised)"], "tokens/s"),
                fix=median_interval(by_clock["after torch.cuda.synchronize()"], "tokens/s"),
                symptom_label="clock read when the call returns",
                fix_label="clock read after synchronising",
                ratio=ratio_of_medians(by_clock["returned (unsynchronised)"], by_clock["after torch.cuda.synchronize()"]),
            )
        )
    decode_rate = context.groupby("context_tokens").token_interval_s.median().rdiv(1.0)
    values = {
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


def _findings(effects: list[Effect], values: dict, env: dict) -> list[str]:
    chat, length = effects[0], effects[1]
    rates = values["decode_tokens_per_s_by_context"]
    contexts = values["context_tokens_last_turn"]
    lines = [
        f"Last chat turn: {contexts['history']} prompt tokens with history, {contexts['amnesia']} with amnesia; decode "
        f"{1000 / chat.symptom.value:.1f} against {1000 / chat.fix.value:.1f} tokens/s ({chat.ratio.value:.2f}x the time "
        f"per token, 95% CI {chat.ratio.low:.2f}-{chat.ratio.high:.2f}). The reporter saw 40 fall to about 10 tokens/s "
        "over many turns with a 7B model.",
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
