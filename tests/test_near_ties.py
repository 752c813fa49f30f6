"""The near-tie map on the real bundled model and CPU engine: margins read from a result's records agree with the
engine's own logits, the noise floor is measured and says in one line what this engine cannot compare, the near
ties are the positions at or under it, the token view shades by margin, and bad input fails in one line."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from exlnb import NoiseFloor, SamplerSettings
from exlnb.generation import start
from exlnb.near_ties import FloorComparison
from exlnb.noise_floor import LAYOUT_NAMES, noise_floor

QUESTION = "Why is the sky blue?"


@pytest.fixture(scope="module")
def answer(cpu_session):
    # greedy with no penalties: the token drawn is the model's own argmax, whose margin the map reads
    return start(QUESTION, sampler=SamplerSettings.greedy(), max_new_tokens=24, tokens=5).wait()[0]


@pytest.fixture(scope="module")
def floor(cpu_session) -> NoiseFloor:
    return noise_floor(cpu_session, probes=2, max_new_tokens=12)


def test_margins_are_the_top_logit_over_the_runner_ups(cpu_session, answer):
    prompt = answer.origin.prompt_ids
    logits = cpu_session.run_on_engine(lambda e: e.score([*prompt, *answer.token_ids]))[len(prompt) - 1 : -1]
    top = logits.topk(2, dim=-1)
    margins = answer.margins()
    assert list(margins.position) == list(range(len(answer.token_ids)))
    assert list(margins.top_id) == top.indices[:, 0].tolist() == list(answer.token_ids)  # greedy: the argmax
    assert list(margins.runner_up_id) == top.indices[:, 1].tolist()
    scored = (top.values[:, 0] - top.values[:, 1]).tolist()
    assert margins.margin.tolist() == pytest.approx(scored, abs=1e-3)  # decode's logits against one pass's


def test_the_floor_compares_each_batch_and_the_whole_sequence_pass_and_names_what_it_cannot(floor):
    names = [c.name for c in floor.comparisons]
    assert names == [f"alone against inside a batch of {b}" for b in (2, 8, 16)] + [
        "decode against a whole-sequence pass"
    ]
    assert all(c.probes == 2 and 0 < c.positions <= 24 for c in floor.comparisons)
    assert floor.value == max(c.max_shift for c in floor.comparisons) >= 0
    assert floor.not_compared.startswith("not compared here: ") and "\n" not in floor.not_compared
    assert all(name in floor.not_compared for name in LAYOUT_NAMES)
    assert "the cpu engine has no quantized cache" in floor.not_compared
    assert floor.table().splitlines()[0].startswith("noise floor on the cpu engine")


def test_near_ties_are_the_positions_at_or_under_the_floor(answer):
    margins = answer.margins()
    cut = sorted(margins.margin)[3]
    ties = answer.near_ties(cut)
    assert list(ties.position) == list(margins[margins.margin <= cut].position) and len(ties) == 4
    assert ties.likely_flip.all()
    assert answer.near_ties(NoiseFloor("cpu", "m", (FloorComparison("x", 1, 1, cut, 0),))).equals(ties)


def test_a_result_measures_its_engines_floor_once_by_default(answer, monkeypatch):
    calls = []

    def counted(session):
        calls.append(session)
        return NoiseFloor("cpu", "m", (FloorComparison("x", 1, 1, 0.05, 0),))

    monkeypatch.setattr("exlnb.noise_floor.noise_floor", counted)
    monkeypatch.setattr("exlnb.noise_floor._measured", type(__import__("weakref").WeakKeyDictionary())())
    first, second = answer.near_ties(), answer.near_ties()
    assert len(calls) == 1 and first.equals(second)
    assert (first.margin <= 0.05).all()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda s: s.complete("Hi", max_new_tokens=3, temperature=0), "has no per-token data: generate with tokens=2"),
        (lambda s: s.complete("Hi", max_new_tokens=3, temperature=0, top_tokens=1), "recorded 1: generate with tokens"),
    ],
)
def test_a_result_without_two_alternatives_is_refused_in_one_line(cpu_session, make, message):
    with pytest.raises(ValueError, match=message) as raised:
        make(cpu_session).margins()
    assert "\n" not in str(raised.value)


def test_a_result_that_keeps_no_session_needs_a_floor(cpu_session):
    result = cpu_session.complete("Hi", max_new_tokens=3, temperature=0, top_tokens=2)
    with pytest.raises(ValueError, match="does not keep the session that ran it: pass floor="):
        result.near_ties()
    with pytest.raises(ValueError, match="floor=-1.0: a noise floor is a margin shift in nats, 0 or more"):
        result.near_ties(-1)


def test_bad_floor_measurements_are_refused_in_one_line(cpu_session):
    with pytest.raises(ValueError, match="batch_sizes=\\[1\\]: give batches of 2 or more"):
        noise_floor(cpu_session, batch_sizes=(1,))
    with pytest.raises(ValueError, match="layouts=\\['a cache of ice'\\]: choose from"):
        noise_floor(cpu_session, layouts=("a cache of ice",))


def test_the_token_view_shades_by_margin(shell, capsys):
    shell.run_cell_magic(
        "exl_generate", "--tokens 2 --token-colour margin --temperature 0 --max-new-tokens 6 --display text", QUESTION
    )
    assert "tokens [text nats over the runner-up]: [" in capsys.readouterr().out
    with pytest.raises(UsageError, match="token_colour='margin' shades by the top logit over the runner-up"):
        shell.run_cell_magic("exl_generate", "--token-colour margin --tokens 1", QUESTION)


def test_the_noise_floor_magic_prints_the_floor(shell, capsys):
    shell.run_line_magic("exl_noise_floor", "--probes 1 --max-new-tokens 4 --batch-sizes 2 --out floor")
    printed = capsys.readouterr().out
    assert printed.startswith("noise floor on the cpu engine") and "alone against inside a batch of 2" in printed
    assert isinstance(shell.user_ns.pop("floor"), NoiseFloor)
