"""exllamav3 1.6.5's own llguidance filter, keeping its errors for the engine instead of raising them.

exllamav3 runs filters inside `iterate()`: an llguidance error there (a token the grammar refuses, as when a
sampler draws a token outside the mask) raised out of the whole step and failed every job in the batch.
This filter keeps the error in `error`, stops constraining, and never reports itself complete after one (a
stopped matcher would otherwise end the job as if its answer were done, "end_filter"); the engine then fails
this filter's job alone after the step, as the ExLlamaV2 engine does with `exllamav2/filter.py`. Imported by
the ExLlamaV3 engine only, where exllamav3 is importable.
"""

from __future__ import annotations

import torch
from exllamav3.generator.filter import LLGuidanceFilter

from exlnb.engines.grammar import drawn_outside_mask


class KeptErrorFilter(LLGuidanceFilter):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.error: Exception | None = None
        self.allowed: torch.Tensor | None = None  # a copy of the last mask given (llguidance reuses its buffer)

    def accept_token(self, token: int) -> None:
        if self.error is None and self.allowed is not None and not allows(self.allowed, token):
            self.error = drawn_outside_mask("exllamav3", token, allowed_count(self.allowed), "its llguidance filter")
        if self.error is None:
            try:
                super().accept_token(token)
            except Exception as error:  # noqa: BLE001 - kept for the engine, which fails this job alone
                self.error = error

    def get_next_logit_mask(self) -> torch.Tensor:
        if self.error is None:
            try:
                mask = super().get_next_logit_mask()
            except Exception as error:  # noqa: BLE001 - as in accept_token
                self.error = error
            else:
                self.allowed = mask.clone()
                return mask
        # every bit set: no restriction for the one step left before the engine removes the job
        return torch.full_like(self._bitmask_torch, -1)

    def reset(self) -> None:
        super().reset()
        self.allowed = None

    def rewind(self, num_tokens: int) -> None:
        super().rewind(num_tokens)
        self.allowed = None  # the last mask was for a later state

    def is_completed(self) -> bool:
        return self.error is None and super().is_completed()


def allows(bitmask: torch.Tensor, token: int) -> bool:
    """Whether a packed int32 bitmask (bit `token & 31` of word `token >> 5`) lets `token` through."""
    words = bitmask.view(-1)
    return 0 <= token < 32 * words.numel() and bool((int(words[token >> 5]) >> (token & 31)) & 1)


def allowed_count(bitmask: torch.Tensor) -> int:
    return sum(bin(int(word) & 0xFFFFFFFF).count("1") for word in bitmask.view(-1).tolist())
