"""exlnb's exllamav2 filter over a real grammar and the bundled tokenizer, without exllamav2 (its base class is
stood in for): an error is kept for the engine, and a token the sampler drew outside the mask is named as the
sampler's fault, not the grammar's."""

from __future__ import annotations

import pytest

from exlnb.engines.constraint import OutputConstraint
from exlnb.engines.grammar import GrammarMatcher
from exlnb.engines.tokenizer import HfTokenizer
from exlnb.models import resolve_model
from tests.helpers import imported_over_stand_ins


@pytest.fixture(scope="module")
def tokenizer():
    return HfTokenizer(resolve_model("smollm2-135m-instruct", progress=False))


@pytest.fixture
def grammar_filter(tokenizer, monkeypatch):
    """GrammarFilter over `(yes|no)`, with exllamav2's ExLlamaV2Filter replaced by a bare base class."""
    base = type("ExLlamaV2Filter", (), {"__init__": lambda self, model, tokenizer: None})
    with imported_over_stand_ins(
        monkeypatch, "exlnb.engines.exllamav2.filter", "exllamav2.generator.filters", ExLlamaV2Filter=base
    ) as module:
        matcher = GrammarMatcher(OutputConstraint.given(regex="(yes|no)"), tokenizer, 49152, tokenizer.eos_token_ids)
        yield module.GrammarFilter(None, None, matcher)


def test_a_token_inside_the_mask_advances_the_grammar(grammar_filter, tokenizer):
    grammar_filter.begin("")
    allowed, _ = grammar_filter.next()
    yes = tokenizer.encode("yes")[0]
    assert yes in allowed
    grammar_filter.feed(yes)
    assert grammar_filter.error is None and grammar_filter.matcher.complete


def test_a_token_the_sampler_drew_outside_the_mask_is_named_as_the_samplers(grammar_filter, tokenizer):
    grammar_filter.begin("")
    allowed, _ = grammar_filter.next()
    colon = tokenizer.encode(":")[0]
    assert colon not in allowed
    grammar_filter.feed(colon)
    assert f"exllamav2's sampler drew token {colon}, outside the {len(allowed)} tokens" in str(grammar_filter.error)
    assert grammar_filter.next() == (None, set())  # no restriction for the step before the engine drops the job
