"""The prompt-format investigation's question set, its scoring, and what its summary says about ranking."""

from __future__ import annotations

from exlnb.datasets import load_questions
from exlnb.experiments.prompt_format import is_correct, rank_formats


def difference(value: float, low: float, high: float) -> dict:
    return {"value": value, "ci95": [low, high], "n": 100, "unit": "fraction"}


def test_every_question_has_a_stable_id_a_topic_and_accepted_answers():
    questions = load_questions()
    assert len(questions) >= 300
    assert list(questions.id) == list(range(1, len(questions) + 1))
    assert questions.question.is_unique
    assert questions.topic.notna().all()
    assert all(answers and all(a.strip() == a and a for a in answers) for answers in questions.answers)


def test_no_accepted_answer_appears_in_its_own_question():
    # a model that repeats the question would be scored correct whatever else it said
    echoed = [(q.id, q.question) for q in load_questions().itertuples() if is_correct(q.question, q.answers)]
    assert not echoed


def test_an_answer_counts_as_a_whole_word_in_any_case():
    assert is_correct("2 plus 2 is 4.", ["four", "4"])
    assert not is_correct("It is 14.", ["4"])
    assert is_correct("The capital is washington, D.C.", ["Washington"])
    assert not is_correct("Germany", ["German"])


def test_formats_whose_intervals_do_not_overlap_can_be_ranked():
    ranking = rank_formats(
        {
            "chatml": difference(0, 0, 0),
            "better": difference(0.1, 0.05, 0.15),
            "worse": difference(-0.3, -0.4, -0.2),
        }
    )
    assert ranking["rankable"]
    assert ranking["tiers"] == [["better"], ["chatml"], ["worse"]]
    assert ranking["statement"].startswith("The formats can be ranked")


def test_formats_joined_by_a_chain_of_overlapping_intervals_cannot_be_ranked():
    # "better" excludes zero, but overlaps "unclear", whose interval includes ChatML's zero
    ranking = rank_formats(
        {
            "chatml": difference(0, 0, 0),
            "better": difference(0.12, 0.03, 0.22),
            "unclear": difference(0.06, -0.1, 0.2),
            "no_template": difference(-0.66, -0.8, -0.5),
        }
    )
    assert not ranking["rankable"]
    assert ranking["tiers"] == [["better", "unclear", "chatml"], ["no_template"]]
    assert "cannot be ranked" in ranking["statement"]
    assert "better ~ unclear ~ chatml > no_template" in ranking["statement"]


def test_a_wide_interval_lower_down_joins_the_tiers_it_overlaps():
    ranking = rank_formats(
        {
            "chatml": difference(0, 0, 0),
            "better": difference(0.1, 0.05, 0.15),
            "wide": difference(-0.2, -0.5, 0.1),
        }
    )
    assert ranking["tiers"] == [["better", "chatml", "wide"]]
