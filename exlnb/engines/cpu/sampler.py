"""Token sampling with exllamav2 0.3.2's semantics, so an experiment means the same on either engine.

Mirrors `ExLlamaV2Sampler.sample` and the C++ it calls (`apply_rep_penalty_cpu`, `sample_basic`):
penalties on the raw logits, then a softmax at the temperature, then top-k, top-p, min-p, each followed by
renormalisation, then a draw: the first candidate (in descending probability) whose cumulative probability
reaches a uniform random number.
"""

from __future__ import annotations

import torch

from exlnb.engines.base import SamplerSettings


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


def sample_token(
    logits: torch.Tensor, sequence: torch.Tensor, s: SamplerSettings, generator: torch.Generator
) -> int:
    """Pick the next token from one position's logits (1-D, float32)."""
    if s.token_repetition_penalty != 1.0 or s.token_frequency_penalty or s.token_presence_penalty:
        logits = apply_penalties(logits, sequence, s)
    if s.is_greedy:  # exllamav2: temperature < 0.01 means top_k = 1
        return int(torch.argmax(logits))

    probs, order = torch.sort(torch.softmax(logits.float() / s.temperature, dim=-1), descending=True)
    if 0 < s.top_k < probs.numel():
        probs, order = probs[: s.top_k], order[: s.top_k]
        probs = probs / probs.sum()
    if s.top_p < 1.0 and probs.numel() > 1:
        # exllamav2 keeps the largest head of the distribution whose mass stays within top_p (at least one)
        keep = max(1, int((torch.cumsum(probs, 0) <= s.top_p).sum()))
        probs, order = probs[:keep], order[:keep]
        probs = probs / probs.sum()
    if s.min_p > 0 and probs.numel() > 1:
        keep = int((probs >= probs[0] * s.min_p).sum())
        probs, order = probs[:keep], order[:keep]
        probs = probs / probs.sum()

    draw = torch.rand((), generator=generator)
    index = int(torch.searchsorted(torch.cumsum(probs, 0), draw))
    return int(order[min(index, order.numel() - 1)])
