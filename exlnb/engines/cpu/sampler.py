"""Token sampling with exllamav2 0.3.2's semantics, so an experiment means the same here as on ExLlamaV2.

Mirrors `ExLlamaV2Sampler.sample` and the C++ it calls, in its order: on the raw logits, the penalties
(`apply_rep_penalty_cpu`), blocked tokens, token bias and DRY, then a constraint's mask (exllamav2 evaluates
its filters after DRY); then `sample_basic`'s steps over the
candidates (candidates.py); then a draw: the first candidate, in descending probability, whose cumulative
probability reaches a uniform random number.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from exlnb.engines.base import SamplerSettings
from exlnb.engines.cpu import candidates as steps
from exlnb.engines.cpu.dry import apply_dry

BLOCKED_LOGIT = -1e30  # what exllamav2 writes over a temporarily banned token


@dataclass(frozen=True)
class TokenClasses:
    """Per-vocabulary masks DRY and XTC read; built once per job from the tokenizer (vocab.py)."""

    dry_breakers: torch.Tensor | None = None
    xtc_excludable: torch.Tensor | None = None


@dataclass
class SamplerState:
    """What one job's sampler carries from token to token: mirostat's mu (exllamav2 starts it at 2 x tau)."""

    mirostat_mu: float | None = None


def apply_penalties(logits: torch.Tensor, sequence: torch.Tensor, s: SamplerSettings) -> torch.Tensor:
    """Repetition (multiplicative), presence and frequency (additive) penalties, with range and decay.

    exllamav2 walks the sequence backwards: the most recent occurrence of a token sets its repetition and
    presence penalty, every occurrence subtracts the frequency penalty, and past `token_repetition_range`
    tokens all three fade linearly to nothing over `token_repetition_decay` tokens.
    """
    n = sequence.numel()
    sustain = n if s.token_repetition_range == -1 else s.token_repetition_range
    window = sequence[max(0, n - sustain - s.token_repetition_decay) :].flip(0)  # most recent first
    if window.numel() == 0:
        return logits
    distance = torch.arange(window.numel(), dtype=torch.float32)
    if s.token_repetition_decay:
        fade = (distance - sustain).clamp(min=0) / s.token_repetition_decay
    else:
        fade = torch.zeros_like(distance)
    rep = s.token_repetition_penalty + (1.0 - s.token_repetition_penalty) * fade
    pres = s.token_presence_penalty * (1.0 - fade)
    freq = s.token_frequency_penalty * (1.0 - fade)

    vocab = logits.numel()
    in_vocab = window < vocab
    window, rep, pres, freq = window[in_vocab], rep[in_vocab], pres[in_vocab], freq[in_vocab]
    # first index of each token in the reversed window = its most recent occurrence
    tokens, inverse = torch.unique(window, return_inverse=True)
    first = torch.full((tokens.numel(),), window.numel(), dtype=torch.long)
    first.scatter_reduce_(0, inverse, torch.arange(window.numel()), reduce="amin")

    out = logits.clone()
    picked = out[tokens]
    factor = rep[first]
    picked = torch.where(picked > 0, picked / factor, picked * factor) - pres[first]
    out[tokens] = picked
    out.index_add_(0, window, -freq)
    return out


def adjust_logits(
    logits: torch.Tensor,
    sequence: torch.Tensor,
    s: SamplerSettings,
    blocked: Sequence[int],
    classes: TokenClasses,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Everything exllamav2 does to the raw logits before its softmax, in its order; tokens outside `allowed`
    (a constraint's mask) can never be picked."""
    if s.token_repetition_penalty != 1.0 or s.token_frequency_penalty or s.token_presence_penalty:
        logits = apply_penalties(logits, sequence, s)
    if blocked:
        logits = logits.index_fill(0, torch.tensor(list(blocked), dtype=torch.long), BLOCKED_LOGIT)
    if s.token_bias:
        ids, bias = zip(*s.token_bias)
        logits = logits.index_add(0, torch.tensor(ids, dtype=torch.long), torch.tensor(bias, dtype=logits.dtype))
    if s.dry_multiplier > 0:
        logits = apply_dry(logits, sequence, s, classes.dry_breakers)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    return logits


def truncate(c: steps.Candidates, s: SamplerSettings, state: SamplerState) -> steps.Candidates:
    """sample_basic's steps after the softmax, each applied only while more than one candidate is left."""
    for step in (
        lambda c: steps.top_k(c, s.top_k),
        lambda c: steps.top_p(c, s.top_p),
        lambda c: steps.top_a(c, s.top_a),
        lambda c: steps.min_p(c, s.min_p),
        lambda c: steps.tail_free(c, s.tfs),
        lambda c: steps.typical(c, s.typical),
        lambda c: steps.mirostat_truncate(c, state.mirostat_mu) if s.mirostat else c,
        lambda c: (
            steps.temperature_after(
                c, s.temperature if s.temperature_last else 1.0, s.min_temp, s.max_temp, s.temp_exponent
            )
            if s.temperature_last or s.max_temp > s.min_temp
            else c
        ),
    ):
        if len(c) > 1:
            c = step(c)
    return c


@dataclass(frozen=True)
class Draw:
    """A sampled token and, when asked for, the probabilities token_info.py defines: the model's own (of the token
    and of its k likeliest tokens) and the sampler's."""

    token: int
    probability: float | None = None  # the model's own, softmax of the raw logits at temperature 1
    top_ids: tuple[int, ...] = ()
    top_probs: tuple[float, ...] = ()
    sampled_probability: float | None = None


def draw_token(
    logits: torch.Tensor,
    sequence: torch.Tensor,
    s: SamplerSettings,
    generator: torch.Generator,
    *,
    blocked: Sequence[int] = (),
    classes: TokenClasses = TokenClasses(),
    state: SamplerState | None = None,
    top_tokens: int = 0,
    allowed: torch.Tensor | None = None,
) -> Draw:
    """Pick the next token from one position's logits (1-D, float32); `blocked` tokens cannot be picked, nor
    tokens outside `allowed` (a bool per token, from a constraint). With `top_tokens` k, also the model's and
    the sampler's probability of it and the model's k likeliest tokens (nothing extra is computed when k is 0)."""
    model_logits = logits
    logits = adjust_logits(logits, sequence, s, blocked, classes, allowed)
    if s.is_greedy:  # exllamav2: temperature < 0.01 means top_k = 1
        token = int(torch.argmax(logits))
        return _described(token, 1.0, model_logits, top_tokens)
    state = state or SamplerState()
    if s.mirostat and state.mirostat_mu is None:
        state.mirostat_mu = 2.0 * s.mirostat_tau
    temperature = 1.0 if s.temperature_last else s.temperature
    # a constraint's mask comes before top-k: with one, top-k is the truncating step's to apply
    c = steps.softmax(
        logits.float(), temperature, s.smoothing_factor, top_k=0 if allowed is not None else s.top_k, allowed=allowed
    )
    c = truncate(c, s, state)
    if s.xtc_probability > 0:
        c = steps.exclude_top_choices(c, s.xtc_probability, s.xtc_threshold, classes.xtc_excludable)
    index = steps.draw(c, float(torch.rand((), generator=generator)), s.skew)
    if s.mirostat:
        state.mirostat_mu = steps.mirostat_update(
            state.mirostat_mu, s.mirostat_tau, s.mirostat_eta, float(c.probs[index])
        )
    return _described(int(c.tokens[index]), float(c.probs[index]), model_logits, top_tokens)


def _described(token: int, sampled: float, model_logits: torch.Tensor, k: int) -> Draw:
    """The draw, with the model's own distribution described when `k` alternatives are asked for."""
    if not k:
        return Draw(token)
    probs = torch.softmax(model_logits.float(), dim=-1)
    top = torch.topk(probs, min(k, probs.numel()))
    return Draw(token, float(probs[token]), tuple(top.indices.tolist()), tuple(top.values.tolist()), sampled)
