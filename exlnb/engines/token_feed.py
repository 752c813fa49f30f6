"""A model's token embedding on its first card, so that a decode step's tokens are embedded there rather than on the
host: both libraries keep the embedding table on the CPU and embed each step's tokens there, then copy the hidden
state up. A graph decoder that embeds on the card needs neither, and the ExLlamaV2 decoder can embed a step's
argmax that has not yet reached the host.

The copy costs the card the table's bytes (262 MB for Llama-2-7B's 32,000 by 4,096 in fp16), so it is made only
where the table takes at most `SHARE_OF_CARD` of the card's memory and fits in what is free. It is held to the
library's own embedding, to the bit, at load (`checked`); where it differs, or does not fit, the decoder embeds on
the host as before and its status says why. `EXLNB_TOKEN_FEED=0` turns it off, so that the two ways can be timed in
turns. Each engine's `token_feed.py` says how its library's embedding maps onto a `TokenFeed`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

SHARE_OF_CARD = 1 / 32  # the most of a card's memory the table's copy may take
CHECK_TOKENS = 64  # token ids the load compares, spread over the vocabulary


def token_feed_on() -> bool:
    """Whether a graph decoder embeds a step's tokens on the card (on unless `EXLNB_TOKEN_FEED=0`, read at each
    load)."""
    return os.environ.get("EXLNB_TOKEN_FEED", "1") != "0"


@dataclass(frozen=True)
class TokenFeed:
    """An embedding over a table on the card: the row of each id (negative ids as 0), times `multiplier` in the
    table's dtype, in `dtype`, times `scale` (a model that normalizes its embeddings by the square root of the
    hidden size); each step where the libraries take it."""

    table: torch.Tensor  # (vocab, hidden) on the card
    dtype: torch.dtype
    multiplier: float = 1.0
    scale: float | None = None

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.embedding(ids.clamp(min=0), self.table)
        if self.multiplier != 1.0:
            x = x * self.multiplier
        x = x.to(self.dtype)
        if self.scale is not None:
            x *= self.scale
        return x


def too_big(weight: torch.Tensor, device: torch.device) -> str:
    """Why a copy of `weight` may not go on `device`, in a few words ("" where it may)."""
    size = weight.numel() * weight.element_size()
    free, total = torch.cuda.mem_get_info(device)
    if size > min(SHARE_OF_CARD * total, free):
        return f"the embedding table ({size / 2**20:.0f} MiB) is over {SHARE_OF_CARD:.1%} of the card"
    return ""


def checked(feed: TokenFeed, library: Callable[[torch.Tensor], torch.Tensor], library_name: str):
    """`feed` and "" where it embeds ids spread over the vocabulary exactly as `library` (ids (n, 1) on the host
    -> hidden states) does; else None and why not."""
    ids = torch.linspace(0, feed.table.shape[0] - 1, CHECK_TOKENS).long().view(-1, 1)
    mine, theirs = feed(ids.to(feed.table.device)).cpu(), library(ids).cpu()
    if mine.dtype != theirs.dtype or not torch.equal(mine, theirs):
        return None, f"the embedding on the card differs from {library_name}'s"
    return feed, ""
