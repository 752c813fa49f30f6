"""What quantizing costs and buys: the bundled model at several bit widths in EXL2 and EXL3 against fp16.

Per condition: greedy agreement with fp16 (the share of fp16's greedy tokens reproduced before the first
difference), accuracy on the short-answer question set, perplexity on a fixed text and, on the same text, the
KL divergence from fp16's distributions per position and top-1 agreement (`exlnb.divergence`, qbench's
measures; no noise floor: the GPU engines inject no noise), decode speed and memory.
fp16 is the session the notebook loaded; each quantized model is made with `exlnb.quantize.quantize` (cached
after the first run) and loaded by `engine="auto"` into a session of its own, one at a time. Quantizing and
both quantized formats need CUDA: on a CPU machine the run says so and measures nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from exlnb.analysis import mean_interval, median_interval, rate_interval, ratio_of_medians
from exlnb.datasets import filler_ids, load_questions
from exlnb.divergence import compare
from exlnb.engines.base import SamplerSettings, one_line
from exlnb.engines.options import cuda_available
from exlnb.experiments.prompt_format import is_correct
from exlnb.experiments.record import Effect, ExperimentResult, environment
from exlnb.models import BUNDLED_MODEL, resolve_model
from exlnb.quantize import quantize
from exlnb.scoring import score
from exlnb.session import Session

CONDITION_COLUMNS = [
    "condition",
    "format",
    "bits",
    "engine",
    "perplexity",
    "kl_mean",
    "kl_median",
    "kl_p90",
    "top1_agreement",
    "weights_gib",
    "device_memory_gib",
]
FAILED_COLUMNS = ["condition", "format", "bits", "error"]
NEEDS_CUDA = "Quantizing and both quantized formats need CUDA: on this machine the notebook measured nothing."


@dataclass(frozen=True)
class Condition:
    format: str  # "fp16", "exl2" or "exl3"
    bits: float

    @property
    def label(self) -> str:
        return "fp16" if self.format == "fp16" else f"{self.format.upper()} {self.bits:g} bpw"


def run(
    session: Session,
    *,
    model: str = BUNDLED_MODEL,
    formats: tuple[str, ...] = ("exl2", "exl3"),
    bits: tuple[float, ...] = (3.0, 4.0, 6.0, 8.0),
    questions: int = 36,
    max_new_tokens: int = 40,
    perplexity_tokens: int = 512,
    decode_tokens: int = 64,
    repeats: int = 3,
) -> ExperimentResult:
    parameters = dict(
        model=str(model),
        formats=list(formats),
        bits=list(bits),
        questions=questions,
        max_new_tokens=max_new_tokens,
        perplexity_tokens=perplexity_tokens,
        decode_tokens=decode_tokens,
        repeats=repeats,
    )
    env = environment(session)
    if not cuda_available():
        empty = {"conditions": pd.DataFrame(columns=CONDITION_COLUMNS)}
        return ExperimentResult("quantization", (), empty, [], parameters, env, findings=[NEEDS_CUDA])
    table = load_questions().head(questions)
    measure = dict(
        table=table,
        max_new_tokens=max_new_tokens,
        perplexity_tokens=perplexity_tokens,
        decode_tokens=decode_tokens,
        repeats=repeats,
    )
    reference = _measure(session, Condition("fp16", 16.0), resolve_model(model), reference=None, **measure)
    measured, failed = [reference], []
    for fmt in formats:
        for width in bits:
            condition = Condition(fmt, width)
            try:  # a quantization its converter or engine cannot make or run is a finding, not the end of the run
                measured.append(_measure_quantized(session, model, condition, reference, measure))
            except Exception as error:  # noqa: BLE001 - reported in the results, with the library's words
                failed.append({"condition": condition.label, "format": fmt, "bits": width, "error": one_line(error)})
    tables = {
        name: pd.concat([m[name] for m in measured], ignore_index=True) for name in ("conditions", "answers", "decode")
    }
    tables["failed"] = pd.DataFrame(failed, columns=FAILED_COLUMNS)
    return _summarise(tables, parameters, env)


def _measure_quantized(session: Session, model: str, condition: Condition, reference: dict, measure: dict) -> dict:
    """The quantized model (made by `quantize`, cached) in a session of its own, loaded by `engine="auto"`."""
    folder = quantize(model, format=condition.format, bits=condition.bits, progress=False)
    quantized = Session()
    quantized.load(str(folder), cache_tokens=session.status().cache_tokens, progress=False)
    try:
        return _measure(quantized, condition, folder, reference=reference, **measure)
    finally:
        quantized.unload()


def _measure(
    session: Session,
    condition: Condition,
    folder: Path,
    *,
    reference: dict | None,
    table: pd.DataFrame,
    max_new_tokens: int,
    perplexity_tokens: int,
    decode_tokens: int,
    repeats: int,
) -> dict[str, pd.DataFrame]:
    tokenizer, greedy = session.tokenizer, SamplerSettings.greedy()
    streams = [
        session.generate(
            tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}])),
            max_new_tokens=max_new_tokens,
            sampler=greedy,
        )
        for q in table.question
    ]
    results = [s.result() for s in streams]
    fp16_ids = [r.token_ids for r in results] if reference is None else reference["token_ids"]
    answers = pd.DataFrame(
        {
            "condition": condition.label,
            "format": condition.format,
            "bits": condition.bits,
            "question_id": table.id.values,
            "correct": [is_correct(r.text, a) for r, a in zip(results, table.answers)],
            "agreement": [agreement(r.token_ids, ref) for r, ref in zip(results, fp16_ids)],
            "answer": [r.text for r in results],
        }
    )
    decode = pd.DataFrame(
        {
            "condition": condition.label,
            "format": condition.format,
            "bits": condition.bits,
            "repeat": range(repeats),
            "decode_tokens_per_s": [
                session.complete(
                    filler_ids(session.tokenizer, 64, label=f"decode {r}"),
                    max_new_tokens=decode_tokens,
                    sampler=greedy,
                    stop_at_eos=False,
                ).decode_tokens_per_s
                for r in range(repeats)
            ],
        }
    )
    status = session.status()
    ids = filler_ids(session.tokenizer, perplexity_tokens, label="perplexity")
    logits = score(session, ids)
    fp16_logits = logits if reference is None else reference["logits"]
    against = compare(fp16_logits, logits, ids)
    conditions = pd.DataFrame(
        [
            {
                "condition": condition.label,
                "format": condition.format,
                "bits": condition.bits,
                "engine": status.engine,
                "perplexity": against.perplexity,
                "kl_mean": against.kl_mean,
                "kl_median": against.kl_median,
                "kl_p90": against.kl_p90,
                "top1_agreement": against.top1_agreement,
                "weights_gib": sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 2**30,
                "device_memory_gib": (status.device_memory_bytes or 0) / 2**30,
            }
        ]
    )
    return {
        "conditions": conditions,
        "answers": answers,
        "decode": decode,
        "token_ids": fp16_ids,
        "logits": fp16_logits,
    }


def agreement(tokens: tuple[int, ...], reference: tuple[int, ...]) -> float:
    """The share of the reference's tokens reproduced before the first difference (1.0 for the same output)."""
    same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    return same / max(len(reference), 1)


def _summarise(tables: dict[str, pd.DataFrame], parameters: dict, env: dict) -> ExperimentResult:
    answers, decode, conditions = tables["answers"], tables["decode"], tables["conditions"]
    fp16_answers, fp16_decode = answers[answers.format == "fp16"], decode[decode.format == "fp16"].decode_tokens_per_s
    effects = []
    for label in conditions.condition[conditions.format != "fp16"]:
        ours = answers[answers.condition == label]
        speed = decode[decode.condition == label].decode_tokens_per_s
        effects += [
            Effect(
                f"accuracy, {label}",
                rate_interval(int(fp16_answers.correct.sum()), len(fp16_answers)),
                rate_interval(int(ours.correct.sum()), len(ours)),
                "fp16",
                label,
            ),
            Effect(
                f"decode tokens/s, {label}",
                median_interval(fp16_decode, "tokens/s"),
                median_interval(speed, "tokens/s"),
                "fp16",
                label,
                ratio_of_medians(fp16_decode, speed),
            ),
        ]
    summary = conditions.set_index("condition").assign(
        accuracy=answers.groupby("condition").correct.mean(),
        agreement=answers.groupby("condition").agreement.mean(),
        decode_tokens_per_s=decode.groupby("condition").decode_tokens_per_s.median(),
    )
    values = {
        "by_condition": summary.reset_index().to_dict(orient="records"),
        "agreement": {c: mean_interval(g.agreement, "fraction").as_dict() for c, g in answers.groupby("condition")},
    }
    values["failed"] = tables["failed"].to_dict(orient="records")
    return ExperimentResult(
        "quantization", (), tables, effects, parameters, env, _findings(summary, tables["failed"]), values
    )


def _findings(summary: pd.DataFrame, failed: pd.DataFrame) -> list[str]:
    fp16 = summary.loc["fp16"]
    lines = [
        f"fp16 ({fp16.engine} engine): perplexity {fp16.perplexity:.2f}, accuracy {fp16.accuracy:.0%}, "
        f"decode {fp16.decode_tokens_per_s:.0f} tokens/s, {fp16.weights_gib:.2f} GiB of weights."
    ]
    for fmt, rows in summary[summary.format != "fp16"].groupby("format"):
        points = "; ".join(
            f"{row.bits:g} bpw: agreement {row.agreement:.0%}, accuracy {row.accuracy:.0%}, perplexity "
            f"{row.perplexity:.2f}, KL from fp16 {row.kl_mean:.4g} (median {row.kl_median:.4g}), top-1 agreement "
            f"{row.top1_agreement:.0%}, {row.decode_tokens_per_s:.0f} tokens/s, {row.weights_gib:.3f} GiB"
            for row in rows.sort_values("bits").itertuples()
        )
        lines.append(f"{fmt.upper()} ({rows.engine.iloc[0]} engine): {points}.")
    lines += [f"{row.condition}: not measured, it failed: {row.error}" for row in failed.itertuples()]
    return lines


def plot(result: ExperimentResult):
    """The four measures against bits per weight; None where nothing was measured (the findings say why)."""
    if result.tables["conditions"].empty:
        return None
    summary = pd.DataFrame(result.values["by_condition"])
    quantized, fp16 = summary[summary.format != "fp16"], summary[summary.format == "fp16"].iloc[0]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for ax, column, title in zip(
        axes,
        ("agreement", "accuracy", "perplexity", "decode_tokens_per_s"),
        ("greedy agreement with fp16", "accuracy on the question set", "perplexity on a fixed text", "decode tokens/s"),
    ):
        sns.lineplot(data=quantized, x="bits", y=column, hue="format", marker="o", ax=ax)
        ax.axhline(fp16[column], color="grey", linestyle="--", label="fp16")
        ax.set(xlabel="bits per weight", ylabel=column.replace("_", " "), title=title)
    axes[0].legend()
    fig.tight_layout()
    return fig
