"""The context investigation's timing design on the real CPU engine: every context length is timed in every
round, in an order that rotates, so the run's warm-up and drift fall on each length alike; the chat's two
modes take turns."""

from __future__ import annotations

from exlnb.experiments.context import _chat, _decode_against_context


def test_each_round_times_every_length_starting_from_a_different_one(cpu_session):
    table = _decode_against_context(cpu_session, (32, 64, 96), decode_tokens=3, repeats=3)

    firsts = [g.context_tokens.iloc[0] for _, g in table.groupby("repeat", sort=True)]
    assert firsts == [32, 64, 96]
    assert table.groupby("repeat").context_tokens.apply(set).tolist() == [{32, 64, 96}] * 3
    assert (table.groupby(["repeat", "context_tokens"]).size() == 2).all()  # 3 new tokens: 2 intervals each


def test_the_chat_keeps_its_history_while_the_modes_take_turns(cpu_session):
    table = _chat(cpu_session, turns=3, answer_tokens=4)

    prompts = table.groupby(["mode", "turn"]).prompt_tokens.first().unstack("mode")
    assert prompts.loc[0, "history"] == prompts.loc[0, "amnesia"]
    assert (prompts.loc[1:, "history"] > prompts.loc[1:, "amnesia"]).all()
    assert prompts["history"].is_monotonic_increasing
