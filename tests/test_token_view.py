"""The token view's data on the real bundled model and CPU engine: per-token probabilities that match the
model's own softmax beside the sampler's, the model's alternatives most likely first, nothing computed when the
view is off."""

from __future__ import annotations

import dataclasses
import html
import re

import pytest
import torch

from exlnb.engines.cpu import engine as cpu_engine
from exlnb.generation import branch_result, start, start_branch
from exlnb.request import GenerationRequest
from exlnb.token_records import TokenRecord
from exlnb.widgets.branches import BranchChoices, branch_key
from exlnb.widgets.figures import generation_html, generation_text
from exlnb.widgets.tokens import LATENCY_BANDS, band, latency_bands

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def reference_model(cpu_session):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cpu_session.options.model_dir, dtype=torch.float32)
    return model.eval()


def model_softmax(model, session, result) -> torch.Tensor:
    """The reference model's own distribution at each new token's position (softmax at temperature 1)."""
    prompt = session.tokenizer.encode(PROMPT, special=True)
    ids = torch.tensor([prompt + list(result.token_ids)])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.softmax(logits, dim=-1)


def test_greedy_probabilities_match_the_models_softmax(cpu_session, greedy, reference_model):
    result = cpu_session.generate(PROMPT, max_new_tokens=4, sampler=greedy, top_tokens=5, stop_at_eos=False).result()
    expected = model_softmax(reference_model, cpu_session, result)

    assert [r.info.token_id for r in result.token_records] == list(result.token_ids)
    for record, probs in zip(result.token_records, expected):
        info = record.info
        assert info.probability == pytest.approx(float(probs[info.token_id]), abs=1e-4)
        assert info.sampled_probability == 1.0  # a greedy step is certain
        assert info.alternatives[0][0] == info.token_id  # greedy picks the likeliest
        alternative_probs = [p for _, _, p in info.alternatives]
        assert alternative_probs == sorted(alternative_probs, reverse=True)
        assert 0 < sum(alternative_probs) <= 1 + 1e-6
        assert all(p == pytest.approx(float(probs[i]), abs=1e-4) for i, _, p in info.alternatives)


def test_a_truncated_draw_shows_the_models_probability_beside_the_sampled_one(cpu_session, reference_model):
    result = cpu_session.generate(
        PROMPT, max_new_tokens=6, temperature=0.8, top_k=2, seed=5, top_tokens=5, stop_at_eos=False
    ).result()
    expected = model_softmax(reference_model, cpu_session, result)

    for record, probs in zip(result.token_records, expected):
        info = record.info
        assert len(info.alternatives) == 5  # the requested number, not the two candidates top-k kept
        assert [i for i, _, _ in info.alternatives] == torch.topk(probs, 5).indices.tolist()
        assert info.probability == pytest.approx(float(probs[info.token_id]), abs=1e-4)
        # renormalised over two candidates, the drawn token's sampled probability is at least the model's
        assert info.probability <= info.sampled_probability <= 1
    assert any(r.info.sampled_probability - r.info.probability > 0.05 for r in result.token_records)


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
    result = cpu_session.generate(
        PROMPT, max_new_tokens=6, sampler=greedy, banned_strings=[banned], top_tokens=2, stop_at_eos=False
    ).result()
    assert [r.info.token_id for r in result.token_records] == list(result.token_ids)


def test_the_dataframe_has_one_row_per_token(cpu_session):
    generation = start(GenerationRequest.build(PROMPT, max_new_tokens=3, temperature=0, tokens=2))
    [result] = generation.wait(60)
    frame = result.tokens()
    assert len(frame) == len(result.token_ids) == 3
    assert list(frame.columns) == [
        "position",
        "token_id",
        "text",
        "probability",
        "sampled_probability",
        "alternatives",
        "arrival_s",
        "latency_s",
    ]
    assert frame["arrival_s"].is_monotonic_increasing and (frame["latency_s"] >= 0).all()


def test_top_tokens_out_of_range_is_refused_in_one_line(cpu_session):
    with pytest.raises(ValueError, match="between 0"):
        GenerationRequest.build(PROMPT, tokens=21)


def test_the_view_shades_each_token_by_band_with_a_popover_of_its_figures(cpu_session):
    generation = start(
        GenerationRequest.build(
            PROMPT, max_new_tokens=3, temperature=0.7, top_k=2, seed=1, tokens=4, show_whitespace=True
        )
    )
    [result] = generation.wait(60)
    page = generation_html(generation, 3)
    popovers = re.findall(r'<span class="exlnb-popover" role="tooltip">(.*?)</table></span>', page)

    assert len(popovers) == len(result.token_records) == 3 and "title=" not in page
    for record, popover in zip(result.token_records, popovers):
        info = record.info
        assert f'exlnb-chip exlnb-p{band(info.probability)}" tabindex="0">' in page  # a tab stop, shaded by the model
        assert f"model's probability {info.probability:.3f}" in popover
        assert f"sampled with {info.sampled_probability:.3f}" in popover
        assert popover.count("<tr>") == 4 and popover.count("← drawn") == (
            info.token_id in [i for i, _, _ in info.alternatives]
        )
    assert "·" in page  # a leading space drawn as a mark
    text = generation_text(generation)
    assert "the model's probability/sampled with" in text
    for record in result.token_records:
        assert f"{record.info.probability:.2f}/{record.info.sampled_probability:.2f}]" in text


def branch_choices(page: str) -> list[tuple[int, int]]:
    """(position, token id) of each alternative that the page's token views make a choice of a branch."""
    return [
        (int(at), int(token)) for at, token in re.findall(r'class="exlnb-alt" data-at="(\d+)" data-token="(\d+)"', page)
    ]


def test_a_view_held_by_a_chooser_makes_each_alternative_but_the_drawn_token_a_branch_there(cpu_session):
    generation = start(GenerationRequest.build(PROMPT, max_new_tokens=3, temperature=0.7, top_k=3, seed=1, tokens=4))
    choices = BranchChoices(generation)
    [result] = generation.wait(60)
    page = generation_html(generation, 3)

    key = branch_key(generation.samples[0])
    assert choices.answers == [key] and page.count(f'data-exlnb-answer="{key}"') == 1
    assert branch_choices(page) == [
        (r.position, i) for r in result.token_records for i, _t, _p in r.info.alternatives if i != r.info.token_id
    ]
    assert page.count("branching here needs the live kernel") == page.count("to branch here") == 3  # each popover
    plain = start(GenerationRequest.build(PROMPT, max_new_tokens=3, temperature=0, tokens=4))
    plain.wait(60)
    assert branch_key(plain.samples[0]) is None and "exlnb-alt" not in generation_html(plain, 3)  # no chooser


def test_a_branch_view_places_its_choices_after_its_forced_token(cpu_session):
    [answer] = start(GenerationRequest.build(PROMPT, max_new_tokens=6, temperature=0, tokens=3)).wait(60)
    branch = start_branch(answer, at=2)
    BranchChoices(branch)
    branch.wait(60)
    positions = sorted({at for at, _token in branch_choices(generation_html(branch, 4))})
    records = branch_result(branch).token_records
    assert records[0].forced and [r.position for r in records] == list(range(len(records)))
    assert positions == [r.position for r in records if not r.forced] and positions[0] == 1


def test_a_branch_view_streams_its_forced_token_first_marked_with_the_parents_alternatives(cpu_session):
    """`%exl_branch dragon --at 3` streamed " as a massive" where `b3.text` read " depicted as a massive": the forced
    token had no record, so the token view, drawn from the records, left it out."""
    [answer] = start(GenerationRequest.build(PROMPT, max_new_tokens=8, temperature=0, tokens=4)).wait(60)
    branch = start_branch(answer, at=3)
    [result] = branch.wait(60)
    page = generation_html(branch, 5)
    chips = re.findall(
        r'<span class="exlnb-chip exlnb-p\d( exlnb-forced)?" tabindex="0">(.*?)<span class="exlnb-popover"', page
    )
    forced, parents = result.token_records[0], answer.token_records[3]

    assert "".join(html.unescape(text) for _forced, text in chips) == result.text  # nothing dropped
    assert [bool(mark) for mark, _text in chips] == [True] + [False] * (len(chips) - 1)
    assert forced.forced and forced.info.token_id == result.token_ids[0] and forced.info.sampled_probability is None
    assert forced.info.alternatives == parents.info.alternatives  # the same place: the parent's distribution
    assert forced.info.probability == next(p for i, _t, p in parents.info.alternatives if i == result.token_ids[0])
    popover = re.search(r'exlnb-forced" tabindex="0">.*?<span class="exlnb-popover" role="tooltip">(.*?)</table>', page)
    assert "forced here by the branch" in popover.group(1) and "← forced" in popover.group(1)
    assert f"[{forced.info.text} forced]" in generation_text(branch)


def test_a_widget_token_view_has_an_output_under_it_for_its_branches(cpu_session, monkeypatch):
    import IPython.display

    from exlnb.widgets.stream import StreamView, generate_live

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, **kwargs: shown.append((obj, kwargs)))
    monkeypatch.setattr(IPython.display, "update_display", lambda obj, **kwargs: shown.append((obj, kwargs)))
    generation = generate_live(PROMPT, max_new_tokens=3, temperature=0, tokens=2, display="widget")
    [(view, _), (under, where), (record, _)] = shown  # the view, the output under it, the view's record
    assert isinstance(view, StreamView) and under == {"text/html": "", "text/plain": ""} and where["raw"]
    assert f'data-exlnb-answer="{branch_key(generation.samples[0])}"' in record["text/html"]
    shown.clear()
    generate_live(PROMPT, max_new_tokens=3, temperature=0, display="widget")  # no token view: nothing under it
    [(view, _), (record, settled)] = shown  # the view and its record, nothing between
    assert isinstance(view, StreamView) and settled["display_id"] == view.display_id


def test_a_popover_says_in_words_when_the_engine_reports_no_sampled_probability(cpu_session):
    """ "sampled with not reported by this engine" """
    from exlnb.widgets.tokens import popover_html

    [result] = start(GenerationRequest.build(PROMPT, max_new_tokens=1, temperature=0, tokens=2)).wait(60)
    record = result.token_records[0]
    unreported = dataclasses.replace(record, info=dataclasses.replace(record.info, sampled_probability=None))
    assert "<br>the sampler's probability is not reported by this engine<br>" in popover_html(unreported)
    assert "sampled with" not in popover_html(unreported) and "sampled with 1.000" in popover_html(record)


def test_on_an_engine_that_cannot_branch_the_alternatives_are_greyed_out_and_say_why(cpu_session):
    """On a chat server a click on an alternative failed with advice that could not work: a view there offers no
    choice, and each popover says what branching needs."""
    from exlnb.engines.remote.engine import CHAT_CANNOT_BRANCH

    generation = start(GenerationRequest.build(PROMPT, max_new_tokens=3, temperature=0, tokens=3))
    generation.branch_refusal = CHAT_CANNOT_BRANCH  # what a generation on a chat server reads from its engine
    [result] = generation.wait(60)
    page = generation_html(generation, 3)

    assert BranchChoices.offer(generation) is None  # nothing that hears a click

    assert branch_choices(page) == [] and "data-exlnb-answer" not in page and "exlnb-branch-on" not in page
    others = sum(i != r.info.token_id for r in result.token_records for i, _t, _p in r.info.alternatives)
    assert page.count('class="exlnb-alt-off"') == others
    assert page.count("branching on a server needs --api completions") == len(result.token_records)


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


def test_every_engine_reports_the_models_probability_before_the_penalties(idle_session):
    """A repetition penalty changes what is drawn, not the model's probability: exllamav2 0.3.2's sampler penalises
    the logits in place before its job keeps them, and the ExLlamaV2 engine once reported the penalised ones."""
    prompt = idle_session.tokenizer.encode("1, 2, 3, 4, 5, 6,", special=True)
    penalised = dict(temperature=0.0, top_k=1, token_repetition_penalty=1.2)  # greedy over the penalised logits
    result = idle_session.generate(prompt, max_new_tokens=10, top_tokens=3, stop_at_eos=False, **penalised).result()
    logits = idle_session.run_on_engine(lambda e: e.score([*prompt, *result.token_ids]))
    probs = logits[len(prompt) - 1 : -1].float().softmax(-1)

    records = result.token_records
    earlier = [[*prompt, *result.token_ids][: len(prompt) + i] for i in range(len(records))]
    assert any(r.info.token_id in seen for r, seen in zip(records, earlier))  # a drawn token the penalty lowered
    for record, p in zip(records, probs):
        assert record.info.probability == pytest.approx(float(p[record.info.token_id]), abs=0.02)


def test_the_logits_an_exllamav2_job_keeps_are_the_models_not_the_penalised_ones():
    from exlnb.engines.exllamav2.logits import KeptRawLogits, stop_token_logits

    def penalising_sampler(logits: torch.Tensor):  # what exllamav2 0.3.2's sampler does to them: in place
        logits[..., 3] /= 1.5
        logits[..., 5] = -1e30
        return "drawn"

    model = torch.arange(8.0).view(1, 1, 8)
    logits = model.clone()
    kept = KeptRawLogits(penalising_sampler)

    assert kept(logits) == "drawn"
    assert torch.equal(logits, model)  # what the job keeps and returns
    assert torch.equal(kept.last, model)

    class Job:
        receive_logits = kept

    (part,) = stop_token_logits(Job(), stopped=True)
    assert torch.equal(part["logits"], model)  # the stop token's record comes from the step that drew it
    assert stop_token_logits(Job(), stopped=False) == ()
    assert stop_token_logits(object(), stopped=True) == ()  # a job drawn on the device keeps none
