"""Sampler settings with exllamav2's names, defaults and order: the one definition every engine maps from.

Each field is declared with `option()`: its one-line help, its group and, where exllamav2's name is long, the
short keyword users write, so `%%exl_generate`'s options, the Python keywords and docs/options.md come from here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace

from exlnb.engines.checks import check_field_types, check_finite, check_option_names, is_number, one_or_many
from exlnb.engines.declaration import declared, option


@dataclass(frozen=True)
class SamplerSettings:
    """Sampling knobs with exllamav2's names, semantics and defaults (ExLlamaV2Sampler.Settings, 0.3.2).

    Order of application, as in exllamav2's `sample` and `sample_basic`: on the raw logits, repetition,
    frequency and presence penalties over the whole sequence (prompt included), token bias, DRY; then a
    softmax at the temperature (quadratic with a smoothing factor), top-k, top-p, top-a, min-p, tail-free,
    typical, mirostat, the temperature applied last or dynamically, XTC, and a draw that skew shifts.
    A temperature below 0.01 means greedy, as in exllamav2's `sample_basic`.
    """

    temperature: float = option(0.8, group="sampling", help="0 is greedy")
    top_k: int = option(50, group="sampling", help="keep the k most likely tokens; 0 disables")
    top_p: float = option(0.8, group="sampling", help="nucleus: smallest set with this probability; 1 disables")
    min_p: float = option(0.0, group="sampling", help="drop tokens below min_p x the top probability; 0 disables")
    top_a: float = option(
        0.0, group="sampling", help="drop tokens below top_a x the top probability squared; 0 disables"
    )
    tfs: float = option(0.0, group="sampling", help="tail-free sampling: keep this share of the curvature; 0 disables")
    typical: float = option(
        0.0, group="sampling", help="locally typical sampling: keep this mass nearest the entropy; 0 disables"
    )
    smoothing_factor: float = option(
        0.0, group="sampling", help="quadratic sampling: squash logits around the top one; 0 disables"
    )
    min_temp: float = option(0.0, group="sampling", help="dynamic temperature: the temperature at zero entropy")
    max_temp: float = option(0.0, group="sampling", help="dynamic temperature at full entropy; on when above min_temp")
    temp_exponent: float = option(1.0, group="sampling", help="dynamic temperature: exponent of the entropy curve")
    temperature_last: bool = option(
        False, group="sampling", help="apply the temperature after the truncating samplers, not before"
    )
    skew: float = option(0.0, group="sampling", help="shift the draw towards less (>0) or more (<0) likely tokens")
    mirostat: bool = option(False, group="sampling", help="mirostat: truncate to hold surprise near mirostat_tau")
    mirostat_tau: float = option(1.5, group="sampling", help="mirostat's target surprise, in bits")
    mirostat_eta: float = option(0.1, group="sampling", help="mirostat's learning rate")
    token_bias: tuple[tuple[int, float], ...] = option(
        (), group="sampling", metavar="DICT", help="token id -> value added to its logit (-inf bans it), e.g. {198: -5}"
    )
    token_repetition_penalty: float = option(
        1.025,
        group="penalties",
        short="rep_penalty",
        help="divide logits of tokens already in the sequence; 1 disables",
    )
    token_repetition_range: int = option(
        -1, group="penalties", short="rep_range", help="how many recent tokens the penalties look at; -1 is all"
    )
    token_repetition_decay: int = option(
        0, group="penalties", short="rep_decay", help="tokens over which the repetition penalty fades in; 0 is none"
    )
    token_frequency_penalty: float = option(
        0.0, group="penalties", short="freq_penalty", help="subtract this x the count of each earlier token"
    )
    token_presence_penalty: float = option(
        0.0, group="penalties", short="presence_penalty", help="subtract this once from every earlier token"
    )
    dry_multiplier: float = option(
        0.0, group="DRY and XTC", help="DRY: penalise tokens that extend a repeat; 0 disables"
    )
    dry_base: float = option(1.75, group="DRY and XTC", help="DRY: penalty grows by this factor per repeated token")
    dry_allowed_length: int = option(2, group="DRY and XTC", help="DRY: repeats up to this long go unpenalised")
    dry_sequence_breakers: frozenset[str] | None = option(
        None,
        group="DRY and XTC",
        metavar="SET",
        help="DRY: strings no repeat may span, e.g. {'.', '\\n'}; default .,!?<>[](){} quote, newline, tab",
    )
    dry_range: int = option(0, group="DRY and XTC", help="DRY: how many recent tokens it looks at; 0 is all")
    dry_max_ngram: int = option(20, group="DRY and XTC", help="DRY: longest repeat it looks for")
    xtc_probability: float = option(
        0.0, group="DRY and XTC", help="XTC: how strongly to exclude the top choices; 0 disables"
    )
    xtc_threshold: float = option(
        0.1, group="DRY and XTC", help="XTC: tokens at least this likely count as top choices"
    )

    def __post_init__(self) -> None:
        self._normalise_collections()
        check_field_types(self)
        checks = [
            (self.temperature >= 0 and math.isfinite(self.temperature), "temperature", "a number >= 0 (0 is greedy)"),
            (self.top_k >= 0, "top_k", "an integer >= 0 (0 disables it)"),
            (0 < self.top_p <= 1, "top_p", "in (0, 1] (1 disables it)"),
            (0 <= self.min_p < 1, "min_p", "in [0, 1) (0 disables it)"),
            (self.top_a >= 0, "top_a", ">= 0 (0 disables it)"),
            (0 <= self.tfs <= 1, "tfs", "in [0, 1] (0 disables it)"),
            (0 <= self.typical <= 1, "typical", "in [0, 1] (0 disables it)"),
            (self.smoothing_factor >= 0, "smoothing_factor", ">= 0 (0 disables it)"),
            (self.min_temp >= 0, "min_temp", ">= 0"),
            (self.max_temp >= 0, "max_temp", ">= 0 (dynamic temperature is on when above min_temp)"),
            (self.temp_exponent > 0, "temp_exponent", "> 0"),
            (math.isfinite(self.skew), "skew", "a finite number (0 disables it)"),
            (self.mirostat_tau > 0, "mirostat_tau", "> 0 bits"),
            (self.mirostat_eta >= 0, "mirostat_eta", ">= 0"),
            (self.token_repetition_penalty > 0, "token_repetition_penalty", "> 0 (1.0 disables it)"),
            (self.token_repetition_range >= -1, "token_repetition_range", ">= -1 (-1 is the whole sequence)"),
            (self.token_repetition_decay >= 0, "token_repetition_decay", ">= 0"),
            (
                all(t >= 0 and not math.isnan(b) and b != math.inf for t, b in self.token_bias),
                "token_bias",
                "token ids >= 0 mapped to finite biases or -inf",
            ),
            (self.dry_multiplier >= 0, "dry_multiplier", ">= 0 (0 disables DRY)"),
            (self.dry_base > 0, "dry_base", "> 0"),
            (self.dry_allowed_length >= 1, "dry_allowed_length", ">= 1"),
            (self.dry_max_ngram >= 1, "dry_max_ngram", ">= 1"),
            # exllamav2 0.3.2 asserts this in apply_dry: its window must hold the longest n-gram
            (
                self.dry_range == 0 or self.dry_range > self.dry_max_ngram,
                "dry_range",
                f"0 (everything) or more than dry_max_ngram ({self.dry_max_ngram})",
            ),
            (
                self.dry_sequence_breakers is None or all(self.dry_sequence_breakers),
                "dry_sequence_breakers",
                "non-empty strings",
            ),
            (0 <= self.xtc_probability <= 1, "xtc_probability", "in [0, 1] (0 disables XTC)"),
            (0 <= self.xtc_threshold <= 1, "xtc_threshold", "in [0, 1]"),
        ]
        for ok, name, expected in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is out of range: it must be {expected}")
        check_finite(self)

    def _normalise_collections(self) -> None:
        """Accept a dict for `token_bias` and any iterable of strings for the breakers (one string is one
        breaker); store them frozen."""
        bias = self.token_bias
        pairs = bias.items() if isinstance(bias, Mapping) else one_or_many(bias)
        if not isinstance(pairs, Iterable) or not all(_is_bias(pair) for pair in pairs):
            raise TypeError(f"token_bias={bias!r} must map token ids to numbers, e.g. {{198: -2.5}}")
        object.__setattr__(self, "token_bias", tuple(sorted((t, float(b)) for t, b in pairs)))
        breakers = one_or_many(self.dry_sequence_breakers)
        if isinstance(breakers, tuple):  # anything else is refused by its type
            object.__setattr__(self, "dry_sequence_breakers", frozenset(breakers))

    @classmethod
    def greedy(cls, **overrides: float) -> SamplerSettings:
        """Deterministic argmax decoding with no penalties, like `ExLlamaV2Sampler.Settings.greedy()`."""
        values = dict(temperature=0.0, top_k=1, top_p=1.0, token_repetition_penalty=1.0)
        values.update(overrides)
        return cls(**values)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 0.01 or self.top_k == 1

    def changed(self) -> dict[str, object]:
        """The settings that differ from exllamav2's defaults, by field name."""
        default = SamplerSettings()
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)
        }

    @classmethod
    def option_names(cls) -> dict[str, str]:
        """Every name a setting answers to -> its field: exllamav2's (`token_repetition_penalty`) and the
        short option name (`rep_penalty`) the magics use."""
        return {name: o.name for o in declared(cls) for name in {o.name, o.keyword}}

    def with_options(self, **options) -> SamplerSettings:
        """These settings with some changed, by field or short option name; unknown names are refused."""
        names = self.option_names()
        check_option_names(options, valid=names)
        return replace(self, **{names[k]: v for k, v in options.items()})


def _is_bias(pair: object) -> bool:
    """One (token id, number) pair of `token_bias`."""
    return isinstance(pair, (tuple, list)) and len(pair) == 2 and is_number(pair[0], int) and is_number(pair[1], float)


def sampled_option_names(cls: type) -> list[str]:
    """Every keyword a declared class that carries a `sampler` (`JobOptions`, `GenerationRequest`) takes: its own
    options, `sampler`, and every name of a sampler setting."""
    return [*(o.keyword for o in declared(cls)), "sampler", *SamplerSettings.option_names()]


def build_sampled(cls: type, options: Mapping[str, object], **given: object):
    """`cls` from keyword options as a user writes them: its own by keyword, a whole `sampler=SamplerSettings(...)`
    to start from, and sampler settings by their exllamav2 or short name (`temperature=0.7`, `rep_penalty=1.1`)
    folded into it; a misspelt name is refused naming every valid one. `given` are taken as they are."""
    check_option_names(options, valid=sampled_option_names(cls))
    own = {o.keyword: o.name for o in declared(cls)}
    settings = {name: value for name, value in options.items() if name not in own and name != "sampler"}
    sampler = options.get("sampler")
    if sampler is not None and not isinstance(sampler, SamplerSettings):
        raise TypeError(
            f"sampler={sampler!r} has the wrong type: it must be a SamplerSettings, e.g. SamplerSettings.greedy(), "
            "or give settings by name (temperature=0)"
        )
    sampler = (sampler or SamplerSettings()).with_options(**settings)
    return cls(**given, **{own[k]: v for k, v in options.items() if k in own}, sampler=sampler)
