"""exllamav2 0.3.2's quirks that exlnb works around in plain Python, checked without a GPU (docs/gpu.md)."""

from __future__ import annotations

import torch

from exlnb.engines.exllamav2 import without_taken_back


def test_the_tokens_of_a_banned_string_that_exllamav2_took_back_are_not_reported():
    # what exllamav2 emits after banning " Paris" (ids 7042, 9): its held ids still end with the taken-back ones
    result = {"text": " Lon", "token_ids": torch.tensor([[11, 7042, 9]]), "suppressed_tokens": torch.tensor([[7042, 9]])}
    assert without_taken_back(result["token_ids"].flatten().tolist(), result) == [11]


def test_ids_are_left_alone_when_nothing_was_taken_back_or_the_library_already_dropped_them():
    assert without_taken_back([11, 12], {"token_ids": torch.tensor([[11, 12]])}) == [11, 12]
    assert without_taken_back([11], {"suppressed_tokens": torch.tensor([[7042, 9]])}) == [11]  # a fixed exllamav2
    assert without_taken_back([11, 12], {"suppressed_tokens": torch.tensor([[], []], dtype=torch.long)[:1]}) == [11, 12]
