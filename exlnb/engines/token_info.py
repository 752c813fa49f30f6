"""What a job can carry per generated token: the model's probability of it, the sampler's, and the model's
likeliest alternatives.

Off by default (`JobSpec.top_tokens == 0`): then no engine computes any of it. Two probabilities, because a
researcher asks two questions of a token:
- `probability`, the model's own: the softmax at temperature 1 of the logits the model produced, before any
  sampler step (penalties, bans, a constraint, temperature, truncation). How sure the model was. The token view
  shades by it, and the alternatives are the model's k likeliest tokens with these probabilities.
- `sampled_probability`, the sampler's: the chance the token had in the distribution it was drawn from (after
  penalties, temperature and truncation, renormalised; 1.0 for a greedy step). Under top-k or top-p it is
  often 1.0 when the model was far from sure, which is why it is never shown alone.
The CPU engine computes both. ExLlamaV2 0.3.2 returns the model's logits (`return_logits`; its sampler penalises
them in place first, which the engine undoes) and the drawn token's sampled probability (`return_probs`).
ExLlamaV3 1.6.5's `return_probs` is the model's softmax at temperature 1 before its sampler, and it reports no
sampled figure: there `sampled_probability` is None, except for a greedy step, which is certain on every engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_TOP_TOKENS = 20  # alternatives per token; exllamav2's job takes any k, a list longer than this is unread


@dataclass(frozen=True)
class TokenInfo:
    """One generated token: its text, the model's probability of it and its k likeliest tokens (most likely
    first), and the probability the sampler drew it with (None where the engine does not report it)."""

    token_id: int
    text: str
    probability: float  # the model's own: softmax at temperature 1, before any sampler step
    alternatives: tuple[tuple[int, str, float], ...]  # (token id, text, the model's probability), descending
    sampled_probability: float | None = None  # in the distribution the token was drawn from


def token_info(
    tokenizer,
    token_id: int,
    probability: float,
    ids: Sequence[int],
    probs: Sequence[float],
    sampled: float | None = None,
) -> TokenInfo:
    """A token's record with every token's own text (a lone byte of a multi-byte character decodes as U+FFFD)."""
    return TokenInfo(
        token_id=int(token_id),
        text=tokenizer.decode([int(token_id)], special=True),
        probability=float(probability),
        alternatives=tuple((int(i), tokenizer.decode([int(i)], special=True), float(p)) for i, p in zip(ids, probs)),
        sampled_probability=None if sampled is None else float(sampled),
    )
