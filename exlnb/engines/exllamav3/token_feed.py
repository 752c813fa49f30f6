"""exllamav3's token embedding as a `TokenFeed` (exlnb/engines/token_feed.py), so that a replayed decode step embeds
its tokens on the first card.

exllamav3 1.6.5 keeps an unquantized embedding table on the CPU: each step the graph decoder embedded the tokens
there, turned the rows to float32 and copied them up, 49 us of the 327 us the host spends between two steps at
batch 1 while the GPU waits (7B-shaped, H200, benchmarks/results/speed-nvidia-h200-2026-11-28-feed). On the card
the step uploads its token ids (8 bytes a row) and looks them up there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from exlnb.engines.token_feed import TokenFeed, checked, too_big


def feed_for(
    host_modules: list, embed: Callable[[torch.Tensor], torch.Tensor], device: torch.device
) -> tuple[TokenFeed | None, str]:
    """A `TokenFeed` on `device` for the modules a decode step runs on the host before its graph ((module, layer
    instance, index) as exllamav3's `Model.fwd_modules` lists them), held to `embed` (token ids (n, 1) on the host
    -> what the graph takes), or None and why not, in a few words."""
    from exllamav3.modules.embedding import Embedding

    module = host_modules[0][0] if len(host_modules) == 1 else None
    if not isinstance(module, Embedding):
        return None, "the modules before the graph are not one embedding"
    if not isinstance(module.embedding, torch.nn.Embedding):
        return None, "the embedding table is quantized or read from disk"
    if why := too_big(module.embedding.weight, device):
        return None, why
    weight = module.embedding.weight
    feed = TokenFeed(
        weight.detach().to(device),
        module.out_dtype or weight.dtype,
        multiplier=module.multiplier,
        scale=weight.shape[-1] ** 0.5 if module.normalize else None,  # exllamav3 scales by the rows' width
    )
    return checked(feed, embed, "exllamav3")
