"""The token view's data on the real bundled model and CPU engine: per-token probabilities that match the
model's own softmax, alternatives most likely first, nothing computed when the view is off."""

from __future__ import annotations

import pytest
import torch

from exlnb.engines.cpu import engine as cpu_engine
from exlnb.generation import start
from exlnb.request import GenerationRequest
from exlnb.token_records import TokenRecord
from exlnb.widgets.figures import generation_html, generation_text
from exlnb.widgets.tokens import LATENCY_BANDS, band, latency_bands

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def reference_model(cpu_session):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cpu_session.options.model_dir, dtype=torch.float32)
    return model.eval()


def test_greedy_probabilities_match_the_models_softmax(cpu_session, greedy, reference_model):
    result = cpu_session.generate(PROMPT, max_new_tokens=4, sampler=greedy, top_tokens=5, stop_at_eos=False).result()
    prompt = cpu_session.tokenizer.encode(PROMPT, special=True)
    ids = torch.tensor([prompt + list(result.token_ids)])
    with torch.inference_mode():
        logits = reference_model(ids).logits[0, len(prompt) - 1 : -1].float()
    expected = torch.softmax(logits, dim=-1)

    assert [r.info.token_id for r in result.token_records] == list(result.token_ids)
    for record, probs in zip(result.token_records, expected):
        info = record.info
        assert info.probability == pytest.approx(float(probs[info.token_id]), abs=1e-4)
        assert info.alternatives[0][0] == info.token_id  # greedy picks the likeliest
        alternative_probs = [p for _, _, p in info.alternatives]
        assert alternative_probs == sorted(alternative_probs, reverse=True)
        assert 0 < sum(alternative_probs) <= 1 + 1e-6
        assert all(p == pytest.approx(float(probs[i]), abs=1e-4) for i, _, p in info.alternatives)


def test_sampled_tokens_carry_the_distribution_they_were_drawn_from(cpu_session):
    result = cpu_session.generate(PROMPT, max_new_tokens=4, temperature=0.8, top_k=3, seed=5, top_tokens=5).result()
    for record in result.token_records:
        alternatives = record.info.alternatives
        assert len(alternatives) <= 3  # top-k kept three candidates, renormalised
        assert sum(p for _, _, p in alternatives) == pytest.approx(1.0, abs=1e-5)
        assert record.info.token_id in [i for i, _, _ in alternatives]


def test_with_the_view_off_no_token_records_are_computed(cpu_session, greedy, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a token record was built with the view off")

    monkeypatch.setattr(cpu_engine, "token_info", forbidden)
    stream = cpu_session.generate(PROMPT, max_new_tokens=3, sampler=greedy)
    events = list(stream)
    assert all(e.token_info == () for e in events)
    with pytest.raises(ValueError, match="tokens=N"):
        stream.result().tokens()


def test_token_records_stay_aligned_when_banned_strings_rewind(cpu_session, greedy):
    banned = cpu_session.generate(PROMPT, max_new_tokens=6, sampler=greedy, stop_at_eos=False).result().text.split()[0]
    result = cpu_session.generate(PROMPT, max_new_tokens=6, sampler=greedy, banned_strings=[banned], top_tokens=2,
                                  stop_at_eos=False).result()
    assert [r.info.token_id for r in result.token_records] == list(result.token_ids)


def test_the_dataframe_has_one_row_per_token(cpu_session):
    generation = start(GenerationRequest.build(PROMPT, max_new_tokens=3, temperature=0, tokens=2))
    [result] = generation.wait(60)
    frame = result.tokens()
    assert len(frame) == len(result.token_ids) == 3
    assert list(frame.columns) == ["position", "token_id", "text", "probability", "alternatives", "arrival_s", "latency_s"]
    assert frame["arrival_s"].is_monotonic_increasing and (frame["latency_s"] >= 0).all()


def test_top_tokens_out_of_range_is_refused_in_one_line(cpu_session):
    with pytest.raises(ValueError, match="between 0"):
        GenerationRequest.build(PROMPT, tokens=21)


def test_the_view_shades_each_token_by_band_with_its_alternatives_on_hover(cpu_session):
    generation = start(GenerationRequest.build(PROMPT, max_new_tokens=3, temperature=0, tokens=2, show_whitespace=True))
    [result] = generation.wait(60)
    page = generation_html(generation, 3)
    for record in result.token_records:
        assert f'exlnb-chip exlnb-p{band(record.info.probability)}" title="token {record.info.token_id} ' in page
    assert "alternatives:" in page and "·" in page  # a leading space drawn as a mark
    assert generation_text(generation).count("[") == 3 + 1  # three tokens and the status line


def test_latency_colouring_shades_the_slow_tokens_and_prints_milliseconds(cpu_session):
    request = GenerationRequest.build(PROMPT, max_new_tokens=4, temperature=0, tokens=1, token_colour="latency")
    generation = start(request)
    [result] = generation.wait(60)
    assert "ms]" in generation_text(generation) and "≥4.0× median" in generation_html(generation, 4)
    record = result.token_records[0]
    latencies = [0.5, 0.1, 0.1, 0.45, 0.16, 0.1]  # the first is the time to first token, left out of the median
    records = [TokenRecord(i, record.info, sum(latencies[: i + 1]), s) for i, s in enumerate(latencies)]
    assert latency_bands(records) == [0, len(LATENCY_BANDS), len(LATENCY_BANDS), 0, 2, len(LATENCY_BANDS)]


def test_without_tokens_the_answer_is_plain_text(cpu_session):
    generation = start(GenerationRequest.build(PROMPT, max_new_tokens=2, temperature=0))
    generation.wait(60)
    assert "exlnb-chip" not in generation_html(generation, 2) and "tokens:" not in generation_text(generation)


def test_whitespace_marks_without_the_view_are_refused():
    with pytest.raises(ValueError, match="tokens=5"):
        GenerationRequest.build(PROMPT, show_whitespace=True)


def test_every_engine_reports_the_greedy_tokens_as_the_likeliest(idle_session, greedy):
    result = idle_session.generate(PROMPT, max_new_tokens=4, sampler=greedy, top_tokens=3, stop_at_eos=False).result()
    records = result.token_records
    assert records and [r.info.token_id for r in records] == list(result.token_ids[: len(records)])
    assert any(r.info.probability < 0.99 for r in records)  # a softmax, not exllamav2's certain top_k = 1
    for record in records:
        info = record.info
        assert 0 < info.probability <= 1
        assert info.alternatives[0][0] == info.token_id
        assert [p for _, _, p in info.alternatives] == sorted((p for _, _, p in info.alternatives), reverse=True)
