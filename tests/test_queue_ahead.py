"""Queuing the next decode step ahead (exlnb/engines/queue_ahead.py): how the next step is guessed and when the
guess is refused, and how the step the generator then asks for is held against it. The decoders that use it run
on the GPU (tests/test_graph_decode.py); the guess and the check are host arithmetic and run everywhere."""

from __future__ import annotations

import torch

from exlnb.engines.base import JobSpec
from exlnb.engines.constraint import OutputConstraint
from exlnb.engines.queue_ahead import Ahead, Step, next_step, pages_hold, queue_ahead_on, said, takes_the_argmax
from exlnb.engines.sampling import SamplerSettings

PAGE = 256


def step(lengths: list[int], width: int = 16) -> Step:
    batch = len(lengths)
    table = torch.arange(batch * width, dtype=torch.int32).view(batch, width)
    return Step.of((batch, width), table, torch.tensor(lengths, dtype=torch.int32))


def test_the_next_step_is_the_same_rows_one_token_longer_over_the_same_table():
    last = step([40, 300])

    following = next_step(last, 2, [512, 1024], PAGE)

    assert following.key == last.key
    assert torch.equal(following.block_table, last.block_table)
    assert following.lengths.tolist() == [41, 301]
    assert last.lengths.tolist() == [40, 300]  # the step it was guessed from is left as it was


def test_no_step_is_guessed_that_would_write_past_a_row_s_pages_or_the_table():
    assert next_step(step([510, 20]), 2, [512, 512], PAGE) is not None  # writes at 511, the pages' last
    assert next_step(step([511, 20]), 2, [512, 512], PAGE) is None  # would write at 512, past its pages
    assert next_step(step([4095], width=16), 1, [8192], PAGE) is None  # past the table's 16 pages
    assert next_step(step([40, 41]), 1, [512, 512], PAGE) is None  # one row where the step had two
    assert next_step(step([40, 41]), 2, [512], PAGE) is None  # the rows are not the step's
    assert next_step(step([40]), 1, None, PAGE) is None  # the engine cannot say
    # a table narrower than the graph's bucket (exllamav2 pads it on the card with each row's first page)
    narrow = Step.of((1, 4), torch.zeros((1, 2), dtype=torch.int32), torch.tensor([511], dtype=torch.int32))
    assert next_step(narrow, 1, [4 * PAGE], PAGE) is None  # 512 would be written past the table's two pages
    # a graph that reads fewer pages than the library's table (exllamav3's, cut to the pages the step needs)
    cut = Step.of((1, 2), torch.zeros((1, 16), dtype=torch.int32), torch.tensor([510], dtype=torch.int32))
    assert next_step(cut, 1, [4 * PAGE], PAGE).lengths.tolist() == [511]  # writes at 511, the second page's last
    at_edge = Step.of((1, 2), torch.zeros((1, 16), dtype=torch.int32), torch.tensor([511], dtype=torch.int32))
    assert next_step(at_edge, 1, [4 * PAGE], PAGE) is None  # 512 lies past the two pages the graph reads


def test_exllamav2_rows_hold_the_pages_their_tokens_so_far_need():
    """exllamav2 0.3.2 gives a decode row the pages for its cached tokens and this step's input: a guess may write
    the next position only while that lies on the same last page."""
    lengths = torch.tensor([0, 254, 255, 256, 300], dtype=torch.int32)
    assert pages_hold(lengths, PAGE) == [256, 256, 256, 512, 512]
    last = Step.of((5, 2), torch.zeros((5, 2), dtype=torch.int32), lengths)
    assert next_step(last, 5, pages_hold(lengths, PAGE), PAGE) is None  # the row at 255 needs a new page
    fits = Step.of((2, 2), torch.zeros((2, 2), dtype=torch.int32), torch.tensor([254, 300], dtype=torch.int32))
    assert next_step(fits, 2, pages_hold(fits.lengths, PAGE), PAGE).lengths.tolist() == [255, 301]


def test_a_row_is_guessed_by_its_argmax_only_where_nothing_changes_its_logits_first():
    def spec(constraint=None, banned=(), **settings) -> JobSpec:
        sampler = SamplerSettings.greedy(**settings)
        stops = frozenset({0})  # a constrained job needs one
        return JobSpec((1, 2, 3), sampler=sampler, stop_token_ids=stops, constraint=constraint, banned_strings=banned)

    assert takes_the_argmax(spec())
    assert takes_the_argmax(spec(top_k=1, temperature=0.8))  # greedy by top-k
    for changed in (
        spec(temperature=0.8, top_k=50),
        spec(token_repetition_penalty=1.1),
        spec(token_frequency_penalty=0.2),
        spec(token_presence_penalty=0.2),
        spec(token_bias=((5, 2.0),)),
        spec(dry_multiplier=0.8),
        spec(xtc_probability=0.5),
        spec(banned=("no",)),
        spec(constraint=OutputConstraint.given(regex="[a-z]+")),
    ):
        assert not takes_the_argmax(changed), changed
    assert said(True, 38, 39) == ", 38 of 39 steps queued ahead used" and said(False, 0, 0) == ""


def test_the_step_asked_for_is_held_against_the_queued_one_field_by_field():
    last = step([40, 41])
    guess = next_step(last, 2, [512, 512], PAGE)
    ahead = Ahead(guess, torch.tensor([[7], [8]]), torch.zeros(2, 1, 5))
    table, lengths = guess.block_table.clone(), torch.tensor([41, 42], dtype=torch.int32)

    assert ahead.matches((2, 16), torch.tensor([[7], [8]]), table, lengths)
    assert not ahead.matches((2, 16), torch.tensor([[7], [9]]), table, lengths)  # a row took another token
    assert not ahead.matches((2, 16), torch.tensor([[7], [8]]), table, torch.tensor([41, 41], dtype=torch.int32))
    moved = table.clone()
    moved[1, 0] = 99
    assert not ahead.matches((2, 16), torch.tensor([[7], [8]]), moved, lengths)  # the pages moved (a defrag)
    assert not ahead.matches((2, 32), torch.tensor([[7], [8]]), table, lengths)  # another graph's shape


def test_queuing_ahead_is_on_unless_switched_off(monkeypatch):
    monkeypatch.delenv("EXLNB_QUEUE_AHEAD", raising=False)
    assert queue_ahead_on()
    monkeypatch.setenv("EXLNB_QUEUE_AHEAD", "0")
    assert not queue_ahead_on()
