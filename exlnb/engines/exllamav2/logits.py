"""What the ExLlamaV2 engine reads of a job's logits for the token view (token_info.py): which per-token outputs a
job asks exllamav2 0.3.2 for, the logits kept as the model made them (its sampler penalises them in place first),
and the stop token's, which exllamav2 reports without any."""

from __future__ import annotations

import torch

from exlnb.engines.base import JobSpec


def token_info_outputs(spec: JobSpec) -> dict:
    """The per-token outputs a job asks exllamav2 for: the model's logits, from which exlnb takes the model's own
    probabilities (token_info.py), and, for a sampled job, each drawn token's probability after the sampler
    (`return_probs`; a greedy job is top_k = 1 in sample_basic, certain, and needs no such figure)."""
    if not spec.top_tokens:
        return {}
    if spec.sampler.is_greedy:
        return {"return_logits": True}
    return {"return_logits": True, "return_probs": True}


class KeptRawLogits:
    """A job's `receive_logits` that leaves the model's logits as they came, and keeps the last step's: exllamav2
    0.3.2's sampler applies the repetition, frequency and presence penalties, token bias and bans to them in place,
    and the job then keeps what is left as the logits it returns (`return_logits`), which exlnb reads as the
    model's own. A penalised token's probability fell from 0.709 to 0.579 that way (the bundled model's sample tree
    at the default repetition penalty of 1.025, against its own whole-sequence pass and the CPU engine's, H100,
    2026-11-28). The last step's logits are the stop token's, which exllamav2 reports without any."""

    def __init__(self, own) -> None:
        self.own = own
        self.last: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor):
        raw = logits.clone()
        drawn = self.own(logits)
        logits.copy_(raw)
        self.last = raw
        return drawn


def stop_token_logits(job, stopped: bool) -> tuple[dict, ...]:
    """The stop token's logits as one more result part (`_token_info`), where its job ended on it and kept them."""
    kept = getattr(job, "receive_logits", None)
    if stopped and isinstance(kept, KeptRawLogits) and kept.last is not None:
        return ({"logits": kept.last.reshape(1, 1, -1)},)
    return ()
