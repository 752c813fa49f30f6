"""A constraint as an exllamav2 0.3.2 filter: `ExLlamaV2Filter`'s begin / feed / next over a `GrammarMatcher`.

exllamav2 0.3.2 has no llguidance filter of its own (formatron and lm-format-enforcer bring theirs), so this one
is ours. `next()` returns the tokens that may come next and the tokens that end the filter; the job's stop
tokens are allowed only where the grammar may end, so they end the answer there ("stop_token"). Imported by
the ExLlamaV2 engine only, where exllamav2 is importable.
"""

from __future__ import annotations

from exllamav2.generator.filters import ExLlamaV2Filter

from exlnb.engines.grammar import GrammarMatcher


class GrammarFilter(ExLlamaV2Filter):
    def __init__(self, model, tokenizer, matcher: GrammarMatcher) -> None:
        super().__init__(model, tokenizer)
        self.matcher = matcher

    def begin(self, prefix_str: str) -> None:
        self.matcher.reset()

    def feed(self, token) -> None:
        self.matcher.consume(int(token))  # exllamav2 feeds a (1, 1) tensor

    def next(self) -> tuple[set[int], set[int]]:
        return self.matcher.allowed_ids(), set()

    def use_background_worker(self) -> bool:
        return True  # computing the mask overlaps the forward pass, as exllamav2 advises for grammars
