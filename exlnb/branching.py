"""Branching: a finished answer run again from one of its tokens, with another token forced there.

A branch at position k is a new job whose prompt is the original prompt, the answer's first k tokens and the
forced token; it goes on with the original request's settings, for what is left of its `max_new_tokens`. The
prompt's full pages are found in the cache by their prefix hash (`engines/cpu/pages.py`), so a branch recomputes
only the tokens after them. Every mistake is refused here, in one line, before a job is queued.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from exlnb.engines.base import Tokenizer
from exlnb.engines.token_info import TokenInfo
from exlnb.request import GenerationRequest
from exlnb.streaming import GenerationResult


@dataclass(frozen=True)
class BranchPlan:
    """What a branch runs: its request (one sample, the tokens left), the tokens before the forced one, and it;
    and what its views show of where it left its parent (the kept tokens' text, the token it replaces)."""

    request: GenerationRequest
    prefix: tuple[int, ...]  # the prompt and the parent's first `at` tokens
    forced: int
    forced_text: str
    kept_text: str  # the parent's first `at` tokens, as text
    replaced_text: str  # the parent's token at `at`, which the forced one replaces
    forced_info: TokenInfo | None  # the forced token's record, where the parent recorded its alternatives there

    @property
    def input_ids(self) -> tuple[int, ...]:
        return (*self.prefix, self.forced)


def plan_branch(
    result: GenerationResult,
    at: int,
    token: int | str | None,
    *,
    request: GenerationRequest,
    prompt_ids: Sequence[int],
    lead: Sequence[int],
    seed: int | None,
    tokenizer: Tokenizer,
) -> BranchPlan:
    """The branch of `result` (run by `request` after `prompt_ids`, starting with the given tokens `lead`) at `at`."""
    if request.constraint is not None:
        raise ValueError(
            f"job {result.job_id} ran under a {request.constraint.describe()}, which would start again "
            "at the forced token: branch an unconstrained answer"
        )
    n = len(result.token_ids)
    if not 0 <= at < n:
        raise ValueError(
            f"at={at} is not a position of job {result.job_id}'s answer: give 0 to {n - 1} (it has {n} tokens)"
        )
    budget = request.max_new_tokens + len(lead)  # what the answer may hold in all, its given tokens included
    left = budget - at - 1
    if left < 1:
        raise ValueError(
            f"at={at} leaves no token of the answer's {budget} (max_new_tokens) after the forced one: "
            f"branch at 0 to {budget - 2}"
        )
    forced = forced_token(result, at, token, tokenizer)
    branch_request = request.with_options(
        n=1,
        chat=None,
        amnesia=False,
        max_new_tokens=left,
        seed=seed,
        min_new_tokens=max(0, min(left, request.min_new_tokens + len(lead) - at - 1)),
    )
    forced_text = tokenizer.decode([forced])
    return BranchPlan(
        branch_request,
        (*prompt_ids, *result.token_ids[:at]),
        forced,
        forced_text,
        tokenizer.decode(result.token_ids[:at]),
        tokenizer.decode([result.token_ids[at]]),
        forced_record(result, at, forced, forced_text),
    )


def forced_record(result: GenerationResult, at: int, forced: int, text: str) -> TokenInfo | None:
    """The forced token's record, so that a branch's token view starts with it as its text does: after the same
    tokens, the model's distribution there is the one the parent recorded at `at`, so its alternatives are the
    parent's, and its probability the one they give it (NaN where it is not among them). Nothing sampled it."""
    record = next((r for r in result.token_records if r.position == at), None)
    if record is None:
        return None
    alternatives = record.info.alternatives
    probability = next((p for i, _text, p in alternatives if i == forced), math.nan)
    return TokenInfo(forced, text, probability, alternatives, sampled_probability=None)


def forced_token(result: GenerationResult, at: int, token: int | str | None, tokenizer: Tokenizer) -> int:
    """`token` as an id: an id of the vocabulary, the text of exactly one token, or (None) the likeliest
    alternative to the answer's token at `at` that the token view recorded."""
    if token is None:
        return top_alternative(result, at)
    if isinstance(token, bool) or not isinstance(token, (int, str)):
        raise TypeError(f"token={token!r}: give a token id (int) or the text of one token (str)")
    if isinstance(token, int):
        vocab_size = tokenizer.vocab_size
        if not 0 <= token < vocab_size:
            raise ValueError(f"token={token} is not in the vocabulary: give an id from 0 to {vocab_size - 1}")
        return token
    ids = tokenizer.encode(token, special=True)
    if len(ids) != 1:
        pieces = [tokenizer.decode([i]) for i in ids]
        raise ValueError(
            f"token={token!r} is {len(ids)} tokens {pieces}, not one: give the text of one token, or its id"
        )
    return ids[0]


def top_alternative(result: GenerationResult, at: int) -> int:
    """The likeliest token at `at`, other than the one the answer has there, as its token view recorded."""
    record = next((r for r in result.token_records if r.position == at), None)
    if record is None:
        why = "it was given, not generated" if result.token_records else "generate with tokens=N (--tokens N)"
        raise ValueError(
            f"no alternatives were recorded at position {at} of job {result.job_id} ({why}): name the "
            "token to force (token=...)"
        )
    chosen = result.token_ids[at]
    others = [i for i, _text, _p in record.info.alternatives if i != chosen]
    if not others:
        raise ValueError(
            f"the token view recorded no alternative to token {chosen} at position {at}: name the token "
            "to force (token=...), or generate with more alternatives (tokens=N)"
        )
    return others[0]
