"""DRY, "don't repeat yourself": penalise the tokens that would extend a repeat of the text's own tail.

Same result as exllamav2 0.3.2's `ExLlamaV2Sampler.apply_dry`, which keeps a trie of every n-gram of the
sequence (no longer than `dry_max_ngram`, spanning no sequence breaker) and walks it each token. Here the
occurrences are found directly: for every earlier position, how many tokens before it match the tail.
"""

from __future__ import annotations

import torch

from exlnb.engines.base import SamplerSettings


def apply_dry(logits: torch.Tensor, sequence: torch.Tensor, s: SamplerSettings, breakers: torch.Tensor) -> torch.Tensor:
    """The longest tail of the sequence that occurred before (at least `dry_allowed_length` long) makes each
    token that followed it there lose `dry_multiplier x dry_base^(length - allowed) x times it followed`."""
    n = sequence.numel()
    if n < 2:
        return logits
    is_breaker = torch.ones(n, dtype=torch.bool)
    in_vocab = sequence < breakers.numel()
    is_breaker[in_vocab] = breakers[sequence[in_vocab]]
    lowest_start = max(0, n - 1 - s.dry_range) if s.dry_range else 0
    ends = torch.arange(n - 1)  # where an earlier occurrence may end: anywhere before the last token
    matched = torch.zeros(n - 1, dtype=torch.long)
    alive = torch.ones(n - 1, dtype=torch.bool)
    for k in range(min(s.dry_max_ngram, n - 1)):
        tail = n - 1 - k
        if is_breaker[tail]:
            break
        starts = ends - k
        alive &= (starts >= lowest_start) & (sequence[starts.clamp(min=0)] == sequence[tail])
        if not alive.any():
            break
        matched += alive
    length = int(matched.max())
    if length < s.dry_allowed_length:
        return logits
    followers = ends[(matched >= length) & (ends + 1 <= n - 2)] + 1
    if length + 1 > s.dry_max_ngram or followers.numel() == 0:
        return logits  # exllamav2's trie holds no n-gram longer than dry_max_ngram
    tokens = sequence[followers]
    tokens = tokens[~is_breaker[followers]]
    out = logits.clone()
    penalty = s.dry_multiplier * s.dry_base ** (length - s.dry_allowed_length)
    out.index_add_(0, tokens, torch.full((tokens.numel(),), -penalty, dtype=out.dtype))
    return out
