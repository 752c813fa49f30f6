"""One job's place in its constraint's grammar: which tokens may come next, and each token it was given.

llguidance's `LLMatcher` computes the allowed tokens as a bitmask. Where the grammar may end, it allows the
tokenizer's end-of-sequence tokens; here that means the job's own stop tokens, which end the job, so an answer
ends only where its constraint is satisfied. The CPU engine masks its logits with `allowed()`; the ExLlamaV2
engine's filter hands exllamav2 the same set.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from llguidance import LLMatcher

from exlnb.engines.constraint import OutputConstraint
from exlnb.engines.tokenizer import HfTokenizer


def drawn_outside_mask(library: str, token: int, allowed: int, constraint: str) -> RuntimeError:
    """A library's sampler drew a token its filter had masked: the grammar would refuse it too, but the fault is
    the sampler's, and the error says so, with how many tokens the mask it ignored let through."""
    return RuntimeError(
        f"{library}'s sampler drew token {token}, outside the {allowed} tokens {constraint} allowed at this step"
    )


class GrammarMatcher:
    def __init__(
        self, constraint: OutputConstraint, tokenizer: HfTokenizer, vocab_size: int, stop_token_ids: Iterable[int]
    ) -> None:
        self.constraint = constraint
        self.vocab_size = vocab_size
        self._matcher = LLMatcher(tokenizer.grammar_tokenizer(vocab_size), constraint.grammar())
        self._check()
        self._eos = torch.tensor(tokenizer.eos_token_ids, dtype=torch.long)
        self._stop_ids = frozenset(stop_token_ids)
        self._stop = torch.tensor(sorted(self._stop_ids), dtype=torch.long)
        self._bitmask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    @property
    def complete(self) -> bool:
        """The grammar has ended: no token but the end of sequence can follow."""
        return self._matcher.is_stopped()

    def allowed(self) -> torch.Tensor:
        """A bool per token of the vocabulary: may it come next?"""
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        self._check()
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self.vocab_size]
        mask = torch.from_numpy(bits.astype(bool))
        may_end = bool(mask[self._eos].any())
        mask[self._eos] = False
        mask[self._stop] = may_end
        return mask

    def allowed_ids(self) -> set[int]:
        return set(torch.nonzero(self.allowed()).flatten().tolist())

    def consume(self, token: int) -> None:
        """Advance past a sampled token; a stop token ends the job instead."""
        if token in self._stop_ids:
            return
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"token {token} broke {self.constraint.describe()}: {self._matcher.get_error()}")

    def reset(self) -> None:
        self._matcher.reset()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise ValueError(
                f"{self.constraint.describe()} cannot constrain this model's tokens: {self._matcher.get_error()}"
            )
