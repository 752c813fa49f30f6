"""A constraint as an exllamav2 0.3.2 filter: `ExLlamaV2Filter`'s begin / feed / next over a `GrammarMatcher`.

exllamav2 0.3.2 has no llguidance filter of its own (formatron and lm-format-enforcer bring theirs), so this one
is ours. `next()` returns the tokens that may come next and the tokens that end the filter; the job's stop
tokens are allowed only where the grammar may end, so they end the answer there ("stop_token"). Imported by
the ExLlamaV2 engine only, where exllamav2 is importable.

exllamav2 calls the filter inside `iterate()`, where an exception ends every job of the batch. So an error
(the grammar refusing a token it was fed) is kept in `error` instead, the filter stops constraining, and the
engine fails this filter's job alone after the step.
"""

from __future__ import annotations

from exllamav2.generator.filters import ExLlamaV2Filter

from exlnb.engines.grammar import GrammarMatcher, drawn_outside_mask


class GrammarFilter(ExLlamaV2Filter):
    def __init__(self, model, tokenizer, matcher: GrammarMatcher) -> None:
        super().__init__(model, tokenizer)
        self.matcher = matcher
        self.error: Exception | None = None
        self.allowed: set[int] | None = None  # what the last next() let exllamav2 sample

    def begin(self, prefix_str: str) -> None:
        self.matcher.reset()
        self.allowed = None

    def feed(self, token) -> None:
        token = int(token)  # exllamav2 feeds a (1, 1) tensor
        if self.error is None and self.allowed is not None and token not in self.allowed:
            self.error = drawn_outside_mask("exllamav2", token, len(self.allowed), self.matcher.constraint.describe())
        if self.error is None:
            try:
                self.matcher.consume(token)
            except Exception as error:  # noqa: BLE001 - kept for the engine, which fails this job alone
                self.error = error

    def next(self) -> tuple[set[int] | None, set[int]]:
        if self.error is None:
            try:
                allowed = self.matcher.allowed_ids()
            except Exception as error:  # noqa: BLE001 - as in feed
                self.error = error
            else:
                if allowed:
                    self.allowed = allowed
                    return allowed, set()
                # exllamav2 asserts "Filter excluded all tokens" inside iterate(), which would end every job
                self.error = RuntimeError(
                    f"{self.matcher.constraint.describe()} allows no token after this answer's start"
                )
        return None, set()  # None: no restriction for the one step left before the engine removes the job

    def use_background_worker(self) -> bool:
        return True  # computing the mask overlaps the forward pass, as exllamav2 advises for grammars
