"""`SamplerSettings` as a stack of exllamav3 sampler steps, planned without importing exllamav3.

exllamav3 1.6.5 samples through a list of `SS_*` steps (`exllamav3/generator/sampler/custom.py`). Its
`ComboSampler` applies min-p before top-k and top-p; exlnb keeps exllamav2's order (penalties, temperature,
top-k, top-p, min-p), so a setting means the same on every engine. Where the two libraries differ at the edges,
the difference is exllamav3's and is named here:
- top-p keeps the token whose probability crosses p (exllamav2 stops just below p): one token more at most.
- with `token_repetition_decay`, exllamav3 blends penalised and raw logits over the fade instead of fading
  the divisor (`apply_rep_pens_kernel`): the same at both ends of the fade, a little different between.
A setting exllamav3 has no step for is refused, never dropped: see `refused_settings`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from exlnb.engines.base import SamplerSettings

WHOLE_SEQUENCE = int(10e7)  # exllamav3's own "all past tokens" (SS_RepP and ComboSampler default sustain_range)

# Every SamplerSettings field that the steps below carry into exllamav3; any other field is refused unless
# left at its default, so a field added to SamplerSettings is never silently ignored by this engine.
MAPPED_FIELDS = frozenset(
    {
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "token_repetition_penalty",
        "token_repetition_range",
        "token_repetition_decay",
        "token_frequency_penalty",
        "token_presence_penalty",
    }
)


@dataclass(frozen=True)
class Step:
    """One exllamav3 sampler step: its class name in `exllamav3.generator.sampler` and positional arguments."""

    name: str
    args: tuple[float | int, ...] = ()


def refused_settings(settings: SamplerSettings) -> list[str]:
    """Names of the settings given a non-default value that exllamav3 has no step for."""
    defaults = type(settings)()
    return [
        f.name
        for f in fields(settings)
        if f.name not in MAPPED_FIELDS and getattr(settings, f.name) != getattr(defaults, f.name)
    ]


def check_supported(settings: SamplerSettings) -> None:
    refused = refused_settings(settings)
    if refused:
        raise ValueError(
            f"the exllamav3 engine has no {', '.join(refused)}: leave {'it' if len(refused) == 1 else 'them'} at "
            f"the default, or load with engine=\"exllamav2\" or \"cpu\""
        )


def sampler_steps(settings: SamplerSettings) -> tuple[Step, ...]:
    """The exllamav3 steps that sample the way `settings` means on the exllamav2 and CPU engines."""
    check_supported(settings)
    s = settings
    sustain = WHOLE_SEQUENCE if s.token_repetition_range == -1 else s.token_repetition_range
    steps: list[Step] = []
    if s.token_repetition_penalty != 1.0:
        steps.append(Step("SS_RepP", (s.token_repetition_penalty, sustain, s.token_repetition_decay)))
    if s.token_presence_penalty or s.token_frequency_penalty:
        steps.append(
            Step("SS_PresFreqP", (s.token_presence_penalty, s.token_frequency_penalty, sustain, s.token_repetition_decay))
        )
    if s.is_greedy:  # exllamav2: temperature < 0.01 or top_k 1 is argmax after the penalties
        return (*steps, Step("SS_Argmax"))
    steps.append(Step("SS_Temperature", (s.temperature,)))
    if s.top_k > 0:
        steps.append(Step("SS_TopK", (s.top_k,)))
    if s.top_p < 1.0:
        steps.append(Step("SS_TopP", (s.top_p,)))
    if s.min_p > 0:  # after top-p, as in exllamav2; this order forgoes exllamav3's fused kernel
        steps.append(Step("SS_MinP", (s.min_p,)))
    return (*steps, Step("SS_Sample"))
