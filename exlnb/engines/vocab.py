"""Token classes some samplers need, derived from the vocabulary as exllamav2 0.3.2 derives them."""

from __future__ import annotations

from functools import lru_cache

import torch

from exlnb.engines.tokenizer import HfTokenizer

# exllamav2's get_dry_default_sequence_breaker_tokens: these characters, and every added (special) token
DEFAULT_DRY_BREAKERS = frozenset('.,!?<>[](){}\n\t"')


@lru_cache(maxsize=8)
def dry_breakers(tokenizer: HfTokenizer, breakers: frozenset[str] | None, vocab_size: int) -> torch.Tensor:
    """True for tokens no DRY repeat may span: their text holds a breaker (the default set adds special tokens).

    Ids the tokenizer does not know (the model's head may be larger) break repeats, as in exllamav2.
    """
    strings = DEFAULT_DRY_BREAKERS if breakers is None else breakers
    mask = torch.ones(vocab_size, dtype=torch.bool)
    pieces = tokenizer.pieces()[:vocab_size]
    mask[: len(pieces)] = torch.tensor([any(b in piece for b in strings) for piece in pieces], dtype=torch.bool)
    if breakers is None:
        mask[[i for i in tokenizer.special_tokens().values() if i < vocab_size]] = True
    return mask


@lru_cache(maxsize=2)
def xtc_excludable(tokenizer: HfTokenizer, vocab_size: int) -> torch.Tensor:
    """False for tokens XTC never excludes: exllamav2's get_default_xtc_mask_tokens (newlines, special tokens)."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    pieces = tokenizer.pieces()[:vocab_size]
    mask[: len(pieces)] = torch.tensor(["\n" not in piece for piece in pieces], dtype=torch.bool)
    mask[[i for i in tokenizer.special_tokens().values() if i < vocab_size]] = False
    return mask


@lru_cache(maxsize=8)
def dry_breaker_ids(tokenizer: HfTokenizer, breakers: frozenset[str] | None, vocab_size: int) -> frozenset[int]:
    """`dry_breakers` as token ids, the form exllamav2's and exllamav3's DRY take."""
    return frozenset(torch.nonzero(dry_breakers(tokenizer, breakers, vocab_size)).flatten().tolist())


@lru_cache(maxsize=2)
def xtc_protected_ids(tokenizer: HfTokenizer, vocab_size: int) -> frozenset[int]:
    """The ids XTC never excludes (`xtc_excludable`'s complement), the form exllamav3's XTC takes."""
    return frozenset(torch.nonzero(~xtc_excludable(tokenizer, vocab_size)).flatten().tolist())
