"""exllamav2's token embedding as a `TokenFeed` (exlnb/engines/token_feed.py), so that a decode step can be queued
before the host knows the step's tokens: the argmax of the step before, still on the card, is embedded there and
fed to the next replay.

exllamav2 0.3.2 keeps the embedding table on the CPU and embeds each step's tokens there, so the graph decoder used
to read each step's argmax back (waiting for the step to end) and then embed, stage and launch the next one while
the GPU sat idle. exllamav2's generator never waits for the whole device, so a step queued on a stream of its
own behind the last one runs while the host reads the last one's logits.
"""

from __future__ import annotations

import torch

from exlnb.engines.token_feed import TokenFeed, checked, too_big


def feed_for(host_modules: list, device: torch.device) -> tuple[TokenFeed | None, str]:
    """A checked `TokenFeed` for the modules a decode step runs on the host before its graph, or None and why not,
    in a few words."""
    from exllamav2.embedding import ExLlamaV2Embedding

    if len(host_modules) != 1 or not isinstance(host_modules[0], ExLlamaV2Embedding):
        return None, "the modules before the graph are not one embedding"
    if why := too_big(host_modules[0].embedding.weight, device):
        return None, why
    return checked_feed(host_modules[0], device)


def checked_feed(module, device: torch.device) -> tuple[TokenFeed | None, str]:
    """`ExLlamaV2Embedding.forward` for plain token ids over a copy of its table on `device`: the row of each id
    (negative ids clamped to 0), in float32 where the model keeps its residual stream in float32, scaled by the
    square root of the hidden size where it normalizes its embeddings; if it embeds as the module does."""
    weight = module.embedding.weight
    archparams = module.archparams
    feed = TokenFeed(
        weight.detach().to(device),
        torch.float32 if archparams.residual_stream_fp32 else weight.dtype,
        scale=module.model.config.hidden_size**0.5 if archparams.normalize_embeddings else None,
    )
    return checked(feed, module.forward, "exllamav2")
