"""What a job can carry per generated token: its probability and the most likely alternatives.

Off by default (`JobSpec.top_tokens == 0`): then no engine computes any of it. The probabilities are those of
the distribution the token was drawn from, as exllamav2 0.3.2's `return_probs` / `return_top_tokens` report
them (sample_basic's candidates after penalties, temperature and truncation, renormalised). A greedy step
draws from a single candidate, which says nothing, so there exlnb reports the softmax of the processed logits
at temperature 1: how sure the model was of the token it was bound to pick. ExLlamaV3 1.6.5 reports that
greedy figure for every step (its Job's return_probs: the softmax of the logits before its sampler), so on it
a sampled token's probability is the model's, not the truncated distribution's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_TOP_TOKENS = 20  # alternatives per token; exllamav2's job takes any k, a hover list longer than this is unread


@dataclass(frozen=True)
class TokenInfo:
    """One generated token: its text, its probability and the k likeliest tokens, most likely first."""

    token_id: int
    text: str
    probability: float
    alternatives: tuple[tuple[int, str, float], ...]  # (token id, text, probability), descending


def token_info(tokenizer, token_id: int, probability: float, ids: Sequence[int], probs: Sequence[float]) -> TokenInfo:
    """A token's record with every token's own text (a lone byte of a multi-byte character decodes as U+FFFD)."""
    return TokenInfo(
        token_id=int(token_id),
        text=tokenizer.decode([int(token_id)], special=True),
        probability=float(probability),
        alternatives=tuple(
            (int(i), tokenizer.decode([int(i)], special=True), float(p)) for i, p in zip(ids, probs) if p > 0
        ),
    )
