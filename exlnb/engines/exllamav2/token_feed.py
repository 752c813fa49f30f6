"""An ExLlamaV2 model's token embedding on its card, so that a decode step can be queued before the host knows the
step's tokens: the argmax of the step before, still on the card, is embedded there and fed to the next replay.

exllamav2 0.3.2 keeps the embedding table on the CPU and embeds each step's tokens there, so the graph decoder used
to read each step's argmax back (waiting for the step to end) and then embed, stage and launch the next one while
the GPU sat idle. exllamav2's generator never waits for the whole device, so a step queued on a stream of its
own behind the last one runs while the host reads the last one's logits.

The copy costs the card the table's bytes (262 MB for Llama-2-7B's 32,000 by 4,096 in fp16), so it is made only
where the table takes at most `SHARE_OF_CARD` of the card's memory and fits in what is free; else the decoder
reads the tokens back as before, and the status line says why. It is held to the library's own embedding, to the
bit, at load. `EXLNB_TOKEN_FEED=0` turns it off, so that the two ways can be timed in turns.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

SHARE_OF_CARD = 1 / 32  # the most of a card's memory the table's copy may take
CHECK_TOKENS = 64  # token ids the load compares, spread over the vocabulary


def token_feed_on() -> bool:
    """Whether the ExLlamaV2 decoder embeds a queued step's tokens on the card (on unless `EXLNB_TOKEN_FEED=0`,
    read at each load)."""
    return os.environ.get("EXLNB_TOKEN_FEED", "1") != "0"


@dataclass(frozen=True)
class TokenFeed:
    """exllamav2's `ExLlamaV2Embedding.forward` for plain token ids, over a copy of its table on the card: the row
    of each id, in float32 where the model keeps its residual stream in float32, scaled by the square root of the
    hidden size where it normalizes its embeddings."""

    table: torch.Tensor  # (vocab, hidden) on the card
    float_residual: bool
    scale: float | None

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.embedding(ids.clamp(min=0), self.table)
        if self.float_residual:
            x = x.float()
        if self.scale is not None:
            x *= self.scale
        return x


def feed_for(host_modules: list, device: torch.device) -> tuple[TokenFeed | None, str]:
    """A checked `TokenFeed` for the modules a decode step runs on the host before its graph, or None and why not,
    in a few words."""
    from exllamav2.embedding import ExLlamaV2Embedding

    if len(host_modules) != 1 or not isinstance(host_modules[0], ExLlamaV2Embedding):
        return None, "the modules before the graph are not one embedding"
    weight = host_modules[0].embedding.weight
    size = weight.numel() * weight.element_size()
    free, total = torch.cuda.mem_get_info(device)
    if size > min(SHARE_OF_CARD * total, free):
        return None, f"the embedding table ({size / 2**20:.0f} MiB) is over {SHARE_OF_CARD:.1%} of the card"
    return checked_feed(host_modules[0], device)


def checked_feed(module, device: torch.device) -> tuple[TokenFeed | None, str]:
    """A `TokenFeed` over a copy of `module`'s table on `device`, if it embeds ids spread over the vocabulary
    exactly as the module itself does; else None and why not."""
    weight = module.embedding.weight
    archparams = module.archparams
    feed = TokenFeed(
        weight.detach().to(device),
        bool(archparams.residual_stream_fp32),
        module.model.config.hidden_size**0.5 if archparams.normalize_embeddings else None,
    )
    ids = torch.linspace(0, weight.shape[0] - 1, CHECK_TOKENS).long().view(-1, 1)
    mine, theirs = feed(ids.to(device)).cpu(), module.forward(ids)
    if mine.dtype != theirs.dtype or not torch.equal(mine, theirs):
        return None, "the embedding on the card differs from exllamav2's"
    return feed, ""
