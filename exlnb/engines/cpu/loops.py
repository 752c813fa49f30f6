"""ExLlamaV3's loop detector (generator/loop_detect.py), as a check of the generated tokens' tail.

A job loops when its whole last `window` tokens repeat with a period of at most window // min_reps: the
condition exllamav3 tracks incrementally, here tested directly (about a millisecond a token at 300 tokens).
"""

from __future__ import annotations

import torch


def only_repeats(tokens: list[int], window: int, min_reps: int) -> bool:
    if len(tokens) < window:
        return False
    tail = torch.tensor(tokens[-window:])
    longest = min(window // min_reps, window // 2)
    return any(torch.equal(tail[period:], tail[:-period]) for period in range(1, longest + 1))
