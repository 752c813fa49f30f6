"""The context investigation's timing design on the real CPU engine: every context length is timed in every
round, in an order that rotates, so the run's warm-up and drift fall on each length alike; the chat's two
modes take turns."""

from __future__ import annotations

import pytest

from exlnb.engines.base import Stage, StreamEvent
from exlnb.experiments.context import _chat, _decode_against_context, _token_intervals


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


def test_an_event_that_carries_several_tokens_shares_its_gap_out_over_them():
    # as the 7B-shaped model's random tokens came on the H100: one token, then 6 held back together, then 9
    events = [StreamEvent(1, Stage.DECODE, t, token_ids=tuple(range(n))) for t, n in ((0.0, 1), (0.09, 6), (0.225, 9))]
    events.insert(1, StreamEvent(1, Stage.DECODE, 0.05))  # an event with no token has no interval

    intervals = _token_intervals(events)

    assert len(intervals) == 15  # every token after the first event's counts once
    assert intervals == pytest.approx([0.015] * 15)


def test_the_7b_shaped_speed_is_said_not_timed_without_cuda_and_the_session_model_is_timed(cpu_session):
    from exlnb.experiments.context import run

    result = run(
        cpu_session,
        turns=2,
        answer_tokens=3,
        context_lengths=(32, 64),
        decode_tokens=3,
        timing_repeats=1,
        prompt_lengths=(16,),
        prompt_models=("bundled",),
    )

    assert set(result.tables["turns"].model) == set(result.tables["context"].model) == {"bundled"}
    assert result.values["speed_not_timed"] == [
        "7b-shaped: the 7B-shaped model is made and run on CUDA: this machine has none; its chat and "
        "context-length timings were not taken."
    ]
    assert result.values["speed_not_timed"][0] in result.findings
    assert [e.name for e in result.effects][:2] == ["decode time per token in turn 2", "decode time per token"]
    assert set(result.values["speed_by_model"]) == {"bundled"}
    assert result.values["decode_tokens_per_s_by_context"].keys() == {32, 64}


def test_an_unknown_speed_model_is_refused_before_anything_runs(cpu_session):
    from exlnb.experiments.context import run

    with pytest.raises(ValueError, match="no model '13b' to time: choose from bundled, 7b-shaped"):
        run(cpu_session, speed_models=("13b",))


@pytest.mark.gpu
def test_on_cuda_the_7b_shaped_model_times_its_chat_and_the_contexts_its_positions_hold():
    from exlnb.experiments.context import run
    from exlnb.random_model import cannot_make_here
    from exlnb.session import get_session
    from tests.helpers import skip_without_library

    skip_without_library("exllamav2")
    if reason := cannot_make_here():
        pytest.skip(reason)
    session = get_session()
    session.load("smollm2-135m-instruct", engine="exllamav2", progress=False)

    result = run(
        session,
        turns=2,
        answer_tokens=4,
        context_lengths=(128, 4090),
        decode_tokens=8,
        timing_repeats=1,
        prompt_lengths=(16,),
        prompt_models=("bundled",),
    )

    context = result.tables["context"]
    assert sorted(set(context.model)) == ["7b-shaped", "bundled"]
    assert set(context[context.model == "7b-shaped"].context_tokens) == {128}  # 4090 + 8 exceed 4096 positions
    assert result.values["speed_not_timed"] == [
        "7b-shaped: context 4090 and 8 new tokens exceed its 4096 positions; not timed."
    ]
    chat = result.tables["turns"]
    assert (chat[chat.model == "7b-shaped"].groupby(["mode", "turn"]).size() == 3).all()  # 4 tokens each: no early end
    assert "7b-shaped model, decode time per token" in [e.name for e in result.effects]


def test_the_7b_shaped_model_gets_the_bundled_models_tokenizer_and_chat_template(tmp_path):
    from exlnb.engines.tokenizer import HfTokenizer
    from exlnb.models import resolve_model
    from exlnb.random_model import copy_tokenizer

    bundled = resolve_model("smollm2-135m-instruct", progress=False)
    copy_tokenizer(bundled, tmp_path)
    (tmp_path / "config.json").write_text((bundled / "config.json").read_text())
    messages = [{"role": "user", "content": "What is the capital of France?"}]

    assert HfTokenizer(tmp_path).apply_chat_template(messages) == HfTokenizer(bundled).apply_chat_template(messages)
