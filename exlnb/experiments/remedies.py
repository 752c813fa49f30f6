"""Named remedies for repetition loops, compared on the same prompts, seeds and temperatures as no penalty.

The penalties of field report 1, DRY, XTC and ExLlamaV3's loop detector work differently: the penalties
and DRY lower the logits of what would repeat, XTC removes the likeliest choices when sampling, and the
detector pulls nothing out at all: it ends a job whose tail only repeats, so what it buys is the tokens a
looping job would have spent running to max_new_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from exlnb.analysis import Estimate, mean_interval, paired_difference, rate_interval
from exlnb.engines.base import LOOP_DETECTOR as DETECTOR_SETTINGS
from exlnb.engines.base import EosReason
from exlnb.engines.sampling import SamplerSettings
from exlnb.experiments.record import Effect

PAIRED_BY = ["temperature", "prompt", "sample"]
REPORTED_SUGGESTION = (1.11, 0.03)  # field report 1's token_repetition_penalty and token_frequency_penalty
EXLLAMAV2_DEFAULT_PENALTY = SamplerSettings().token_repetition_penalty


@dataclass(frozen=True)
class Remedy:
    """Sampler settings laid over each temperature's base sampler, and the job's loop detector."""

    name: str
    sampler_options: tuple[tuple[str, float], ...] = ()
    stop_on_loop: tuple[int, int] | None = None
    sampling_only: bool = False  # acts only when a token is drawn, so it is measured at temperatures above 0
    source: str = ""

    def applies_at(self, temperature: float) -> bool:
        return temperature > 0 or not self.sampling_only

    def sampler(self, base: SamplerSettings) -> SamplerSettings:
        return base.with_options(**dict(self.sampler_options))


NO_PENALTY = Remedy("no penalty", source="the baseline every remedy is paired with")
LOOP_DETECTOR = Remedy(
    "loop detector",
    stop_on_loop=DETECTOR_SETTINGS,
    source=f"ExLlamaV3's stop_on_loop: ends a job once its last {DETECTOR_SETTINGS[0]} tokens repeat with a "
    f"period of at most {DETECTOR_SETTINGS[0]} // {DETECTOR_SETTINGS[1]}",
)
REMEDIES = (
    NO_PENALTY,
    Remedy(
        "exllamav2 default",
        (("token_repetition_penalty", EXLLAMAV2_DEFAULT_PENALTY),),
        source="exllamav2 0.3.2's ExLlamaV2Sampler.Settings",
    ),
    Remedy(
        "field report 1's suggestion",
        tuple(zip(("token_repetition_penalty", "token_frequency_penalty"), REPORTED_SUGGESTION)),
        source="field report 1",
    ),
    Remedy(
        "DRY",
        (("dry_multiplier", 0.8), ("dry_base", 1.75), ("dry_allowed_length", 2)),
        source="the values DRY's author recommends in text-generation-webui's pull request 5677",
    ),
    Remedy(
        "XTC",
        (("xtc_probability", 0.5), ("xtc_threshold", 0.1)),
        sampling_only=True,
        source="the values XTC's author suggests in text-generation-webui's pull request 6335; XTC acts only when "
        "a token is drawn, so it runs at temperatures above 0 alone",
    ),
    LOOP_DETECTOR,
)


def add_detector_columns(outputs: pd.DataFrame, max_new_tokens: int) -> pd.DataFrame:
    """Which jobs the loop detector ended, and the tokens each saved against running to max_new_tokens."""
    ended = outputs.eos_reason == EosReason.LOOP_DETECTED.value
    return outputs.assign(ended_by_detector=ended, tokens_saved=np.where(ended, max_new_tokens - outputs.new_tokens, 0))


def compare(outputs: pd.DataFrame, remedy: Remedy) -> dict[str, Estimate]:
    """The remedy's outputs against no penalty's with the same temperature, prompt and sample (seed)."""
    p = _pairs(outputs, remedy)
    finite = np.isfinite(p.distinct_2_remedy) & np.isfinite(p.distinct_2_none)
    return {
        "loop_rate": rate_interval(int(p.loop_remedy.sum()), len(p)),
        "loop_rate_no_penalty": rate_interval(int(p.loop_none.sum()), len(p)),
        "loop_rate_minus_no_penalty": paired_difference(p.loop_remedy, p.loop_none, "fraction"),
        "distinct_2": mean_interval(p.distinct_2_remedy, "fraction"),
        "distinct_2_minus_no_penalty": paired_difference(
            p.distinct_2_remedy[finite], p.distinct_2_none[finite], "fraction"
        ),
        "new_tokens": mean_interval(p.new_tokens_remedy, "tokens"),
        "new_tokens_no_penalty": mean_interval(p.new_tokens_none, "tokens"),
        "new_tokens_minus_no_penalty": paired_difference(p.new_tokens_remedy, p.new_tokens_none, "tokens"),
        "ended_by_detector": rate_interval(int(p.ended_by_detector_remedy.sum()), len(p)),
    }


def _pairs(outputs: pd.DataFrame, remedy: Remedy) -> pd.DataFrame:
    columns = [*PAIRED_BY, "loop", "distinct_2", "new_tokens", "ended_by_detector"]
    mine = outputs[outputs.remedy == remedy.name][columns]
    none = outputs[outputs.remedy == NO_PENALTY.name][columns]
    return mine.merge(none, on=PAIRED_BY, suffixes=("_remedy", "_none"), validate="one_to_one")


def effects(comparisons: dict[str, dict[str, Estimate]], temperatures: dict[str, list[float]]) -> list[Effect]:
    """Loop rate against no penalty for every remedy; for the detector also the tokens each job ran."""
    found = []
    for name, c in comparisons.items():
        scope = ", ".join(f"{t:g}" for t in temperatures[name])
        found.append(
            Effect(
                f"loop rate at temperature {scope}, same prompts and seeds",
                c["loop_rate_no_penalty"],
                c["loop_rate"],
                NO_PENALTY.name,
                name,
            )
        )
        if name == LOOP_DETECTOR.name:
            found.append(
                Effect(
                    f"new tokens per job at temperature {scope}, mean",
                    c["new_tokens_no_penalty"],
                    c["new_tokens"],
                    NO_PENALTY.name,
                    name,
                )
            )
    return found


def findings(outputs: pd.DataFrame, comparisons: dict[str, dict[str, Estimate]], max_new_tokens: int) -> list[str]:
    lines = []
    for remedy in REMEDIES:
        c = comparisons.get(remedy.name)
        if c is None:
            continue
        settings = ", ".join(f"{k} {v:g}" for k, v in remedy.sampler_options) or f"stop_on_loop={remedy.stop_on_loop}"
        lines.append(
            f"{remedy.name} ({settings}; {remedy.source}): loop rate {_pct(c['loop_rate'])} against "
            f"{_pct(c['loop_rate_no_penalty'])} with no penalty, paired difference "
            f"{_points(c['loop_rate_minus_no_penalty'])}; "
            f"distinct-2 {_points(c['distinct_2_minus_no_penalty'])}; length "
            f"{c['new_tokens_minus_no_penalty'].value:+.1f} tokens [{c['new_tokens_minus_no_penalty'].low:+.1f} to "
            f"{c['new_tokens_minus_no_penalty'].high:+.1f}] (n = {c['loop_rate'].n} pairs)."
        )
    detector = outputs[outputs.remedy == LOOP_DETECTOR.name]
    if LOOP_DETECTOR.name in comparisons:
        ended, window = detector[detector.ended_by_detector], LOOP_DETECTOR.stop_on_loop[0]
        lines.append(
            f"The loop detector ended {len(ended)} of {len(detector)} jobs "
            f"({_pct(comparisons[LOOP_DETECTOR.name]['ended_by_detector'])}); "
            f"it does not pull a job out of its loop, it stops it, saving {int(ended.tokens_saved.sum())} of the "
            f"{len(ended) * max_new_tokens} tokens those jobs would have run to max_new_tokens. It fires once its "
            f"{window}-token window holds nothing but the loop: at max_new_tokens={max_new_tokens}, only a loop that "
            f"starts within the first {max(max_new_tokens - window, 0)} tokens can be ended."
        )
    return lines


def _pct(e: Estimate) -> str:
    return f"{e.value:.0%} [{e.low:.0%}-{e.high:.0%}]"


def _points(e: Estimate) -> str:
    return f"{100 * e.value:+.0f} points [{100 * e.low:+.0f} to {100 * e.high:+.0f}]"
