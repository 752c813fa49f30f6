"""`SamplerSettings` as a stack of exllamav3 sampler steps, planned without importing exllamav3.

exllamav3 1.6.5 samples through a list of `SS_*` steps (`exllamav3/generator/sampler/custom.py`), applied in
the order given. Its `ComboSampler` puts token bias first and min-p before top-k and top-p; exlnb keeps
exllamav2's order (penalties, token bias, DRY; temperature, top-k, top-p, min-p; the temperature here instead
when `temperature_last`; XTC; the draw), so a setting means the same on every engine. Where the two libraries
differ at the edges, the difference is exllamav3's and is named here:
- top-p keeps the token whose probability crosses p (exllamav2 stops just below p): one token more at most.
- with `token_repetition_decay`, exllamav3 blends penalised and raw logits over the fade instead of fading
  the divisor (`apply_rep_pens_kernel`): the same at both ends of the fade, a little different between.
- DRY, over the same parameters, is llama.cpp's algorithm in exllamav3 and a trie of n-grams in exllamav2.
  exllamav3 charges each token by the longest repeat it would continue; exllamav2 charges the tokens that
  followed the tail's single longest earlier occurrence (not one ending just before the last token), times how
  often each followed it. exllamav3 has no `dry_max_ngram` (refused unless left at its default) and keeps
  penalising longer repeats, where exllamav2 stops once a repeat is `dry_max_ngram` tokens long. Breakers go
  in as the token ids exlnb's other engines use (vocab.py), and `dry_range` plus one: exllamav2 looks at
  repeats that start within the last `dry_range` + 1 tokens, exllamav3 within the last `dry_range`.
- XTC protects the tokens exllamav2 protects (newlines and special tokens, vocab.py); exllamav3 leaves them
  open unless told. It sees the tokens the filters removed as candidates of probability 0, so
  `xtc_threshold=0` is refused there.
A setting exllamav3 has no step for is refused, never dropped, and so is a value it would read otherwise:
see `refused_settings`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from exlnb.engines import vocab
from exlnb.engines.base import SamplerSettings
from exlnb.engines.tokenizer import HfTokenizer

WHOLE_SEQUENCE = int(10e7)  # exllamav3's own "all past tokens" (SS_RepP and ComboSampler default sustain_range)

# Every SamplerSettings field that the steps below carry into exllamav3; any other field is refused unless
# left at its default, so a field added to SamplerSettings is never silently ignored by this engine.
MAPPED_FIELDS = frozenset(
    {
        "temperature",
        "temperature_last",
        "top_k",
        "top_p",
        "min_p",
        "token_repetition_penalty",
        "token_repetition_range",
        "token_repetition_decay",
        "token_frequency_penalty",
        "token_presence_penalty",
        "token_bias",
        "dry_multiplier",
        "dry_base",
        "dry_allowed_length",
        "dry_sequence_breakers",
        "dry_range",
        "xtc_probability",
        "xtc_threshold",
    }
)


@dataclass(frozen=True)
class Step:
    """One exllamav3 sampler step: its class name in `exllamav3.generator.sampler` and positional arguments."""

    name: str
    args: tuple[object, ...] = ()


def _refused_values(s: SamplerSettings) -> list[str]:
    """Values of mapped settings that exllamav3 would read otherwise than exllamav2, as "name=value (why)"."""
    refused = []
    if s.dry_multiplier > 0 and s.dry_base < 1:
        refused.append(f"dry_base={s.dry_base!r} (exllamav3 turns DRY off below 1)")
    if s.xtc_probability > 0 and s.xtc_threshold == 0:
        refused.append("xtc_threshold=0.0 (exllamav3 would count the tokens the filters removed as top choices)")
    return refused


def refused_settings(settings: SamplerSettings) -> list[str]:
    """What exllamav3 cannot sample as `settings` means it, as "name=value": each setting given a non-default
    value that no step carries, then each value a step would read otherwise, with why."""
    defaults = type(settings)()
    unmapped = [
        f"{f.name}={getattr(settings, f.name)!r}"
        for f in fields(settings)
        if f.name not in MAPPED_FIELDS and getattr(settings, f.name) != getattr(defaults, f.name)
    ]
    return unmapped + _refused_values(settings)


def check_supported(settings: SamplerSettings) -> None:
    refused = refused_settings(settings)
    if refused:
        raise ValueError(
            f"the exllamav3 engine has no {', '.join(refused)}: leave {'it' if len(refused) == 1 else 'them'} at "
            f'the default, or load with engine="exllamav2" or "cpu"'
        )


def sampler_steps(
    settings: SamplerSettings, tokenizer: HfTokenizer | None = None, vocab_size: int = 0
) -> tuple[Step, ...]:
    """The exllamav3 steps that sample the way `settings` means on the exllamav2 and CPU engines.

    DRY and XTC read token classes of the vocabulary (breakers, protected tokens): give the tokenizer and the
    model's vocabulary size when they are on.
    """
    check_supported(settings)
    s = settings
    sustain = WHOLE_SEQUENCE if s.token_repetition_range == -1 else s.token_repetition_range
    steps: list[Step] = []
    if s.token_repetition_penalty != 1.0:
        steps.append(Step("SS_RepP", (s.token_repetition_penalty, sustain, s.token_repetition_decay)))
    if s.token_presence_penalty or s.token_frequency_penalty:
        steps.append(
            Step(
                "SS_PresFreqP", (s.token_presence_penalty, s.token_frequency_penalty, sustain, s.token_repetition_decay)
            )
        )
    if s.token_bias:
        steps.append(Step("SS_LogitBias", (dict(s.token_bias),)))
    if s.dry_multiplier > 0:
        breakers = vocab.dry_breaker_ids(_needed(tokenizer, "DRY"), s.dry_sequence_breakers, vocab_size)
        dry_range = s.dry_range + 1 if s.dry_range else 0
        steps.append(Step("SS_DRY", (s.dry_multiplier, s.dry_base, s.dry_allowed_length, dry_range, breakers)))
    if s.is_greedy:  # exllamav2: temperature < 0.01 or top_k 1 is argmax after the penalties, bias and DRY
        return (*steps, Step("SS_Argmax"))
    temperature = Step("SS_Temperature", (s.temperature,))
    if not s.temperature_last:
        steps.append(temperature)
    if s.top_k > 0:
        steps.append(Step("SS_TopK", (s.top_k,)))
    if s.top_p < 1.0:
        steps.append(Step("SS_TopP", (s.top_p,)))
    if s.min_p > 0:  # after top-p, as in exllamav2; this order forgoes exllamav3's fused kernel
        steps.append(Step("SS_MinP", (s.min_p,)))
    if s.temperature_last:  # exllamav2's post-softmax temperature: p^(1/T) over what the filters kept
        steps.append(temperature)
    if s.xtc_probability > 0:
        protected = vocab.xtc_protected_ids(_needed(tokenizer, "XTC"), vocab_size)
        steps.append(Step("SS_XTC", (s.xtc_probability, s.xtc_threshold, protected)))
    return (*steps, Step("SS_Sample"))


def _needed(tokenizer: HfTokenizer | None, sampler: str) -> HfTokenizer:
    if tokenizer is None:
        raise TypeError(f"{sampler} reads the vocabulary: pass the tokenizer and the vocabulary size")
    return tokenizer
