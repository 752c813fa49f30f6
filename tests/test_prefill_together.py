"""Prompts that arrive together, prefilled in one forward pass on both GPU engines (`EXLNB_PREFILL_TOGETHER=1`,
exlnb/engines/prefill_together.py and each engine's prefill_together.py).

How held passes are grouped runs everywhere; the rest needs CUDA (`pytest -m gpu`): the same greedy tokens as
with a pass a prompt, for 8 prompts of one length (one forward pass for all), for chat prompts of different
lengths that begin alike (exllamav2 copies the keys of a page that begins as a new prompt does, so a held pass
runs first), and with a long prompt twice (its pages shared); every page free after."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from benchmarks.decode import random_prompt
from benchmarks.paged_acceptance import LONG_PROMPT, QUESTIONS
from exlnb.engines.exllamav3.prefill_together import PrefillTogether
from exlnb.engines.job_options import JobOptions
from exlnb.engines.prefill_together import NOTE, batches, pages
from exlnb.engines.sampling import SamplerSettings
from exlnb.session import Session
from exlnb.templates import chatml


def test_held_passes_of_one_length_run_as_one_batch_within_the_token_limit():
    assert batches([5, 3, 5, 8, 3, 5], max_tokens=100) == [[0, 2, 5], [1, 4], [3]]
    assert batches([4] * 5, max_tokens=8) == [[0, 1], [2, 3], [4]]  # at most 8 tokens a batch
    assert batches([300, 300], max_tokens=256) == [[0], [1]]  # a pass past the limit alone, as it came
    assert batches([], max_tokens=8) == []


def test_a_pass_touches_the_pages_its_tokens_lie_in():
    assert list(pages(0, 256, 256)) == [0]
    assert list(pages(250, 10, 256)) == [0, 1]  # across a page's end
    assert list(pages(256, 1, 256)) == [1]


class Model:
    """A model as exllamav3's generator calls it: its prompt pass, its decode step, and a step queued ahead."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def prefill(self, input_ids, params):
        self.calls.append(("prefill", input_ids.shape[0], int(params["cache_seqlens"][0])))

    def forward(self, input_ids, params):
        self.calls.append(("forward", input_ids.shape[0]))

    def prefetch_tokens(self, tokens):
        self.calls.append(("prefetch_tokens", len(tokens)))


class Generator:
    """One `iterate()` as exllamav3's: two new jobs' prompt passes, then the decode step that gives each its first
    token (in the same iteration), then the next step queued ahead."""

    max_chunk_size, draft_model = 2048, None

    def __init__(self) -> None:
        self.calls: list = []
        self.model, self.cache = Model(self.calls), SimpleNamespace(copy_page=None)

    def iterate(self) -> list:
        for page in (0, 1):
            params = {"attn_mode": "flash_attn", "cache": self.cache, "block_table": torch.tensor([[page]]),
                      "cache_seqlens": torch.tensor([0], dtype=torch.int32)}  # fmt: skip
            self.model.prefill(torch.zeros((1, 39), dtype=torch.long), params)
        self.model.forward(torch.zeros((2, 1), dtype=torch.long), {})
        self.model.prefetch_tokens([1, 2])
        return []


def test_held_prompt_passes_run_before_the_decode_step_that_reads_their_keys(monkeypatch):
    monkeypatch.setenv("EXLNB_PREFILL_TOGETHER", "1")
    generator = Generator()
    together = PrefillTogether.start(generator, [], batchable=True)
    generator.iterate()
    assert generator.calls == [("prefill", 2, 0), ("forward", 2), ("prefetch_tokens", 2)]  # both prompts, one pass
    assert (together.passes_held, together.passes_run) == (2, 1)
    assert "forward" not in vars(generator.model) and "prefill" not in vars(generator.model)  # as it was, after


def test_prompts_are_prefilled_together_by_default_on_both_engines_and_the_switch_turns_it_off(monkeypatch):
    from exlnb.engines.exllamav2.prefill_together import PrefillTogether as OnExllamav2

    paged = Generator()
    paged.page_size = 256
    monkeypatch.delenv("EXLNB_PREFILL_TOGETHER", raising=False)
    notes: list[str] = []
    assert OnExllamav2.start(paged, notes, batchable=True) is not None and notes == [NOTE]
    assert PrefillTogether.start(Generator(), [], batchable=True) is not None
    monkeypatch.setenv("EXLNB_PREFILL_TOGETHER", "0")
    assert OnExllamav2.start(paged, [], batchable=True) is None
    assert PrefillTogether.start(Generator(), [], batchable=True) is None
    monkeypatch.setenv("EXLNB_PREFILL_TOGETHER", "1")
    assert PrefillTogether.start(Generator(), [], batchable=True) is not None


def load(engine: str, together: bool, monkeypatch) -> Session:
    monkeypatch.setenv("EXLNB_PREFILL_TOGETHER", "1" if together else "0")
    session = Session()
    session.load("smollm2-135m-instruct", engine=engine, progress=False)
    return session


def greedy_together(session: Session, prompts: list, max_new_tokens: int = 24) -> list[tuple[int, ...]]:
    options = JobOptions(max_new_tokens=max_new_tokens, sampler=SamplerSettings.greedy(), stop_at_eos=False)
    streams = session.submit_together([session.spec_for(p, options) for p in prompts])
    return [stream.result().token_ids for stream in streams]


def passes(session: Session) -> tuple[int, int]:
    return session.run_on_engine(lambda e: (e.prefill.passes_held, e.prefill.passes_run))


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["exllamav2", "exllamav3"])
def test_prompts_prefilled_together_decode_as_with_a_pass_each(engine, monkeypatch):
    if not torch.cuda.is_available() or importlib.util.find_spec(engine) is None:
        pytest.skip(f"the {engine} engine needs CUDA and {engine}")
    apart = load(engine, False, monkeypatch)
    try:
        assert apart.run_on_engine(lambda e: e.prefill) is None
        one_length = [random_prompt(40, seed) for seed in range(8)]  # no prefix in common: no keys copied
        groups = (one_length, [chatml(q) for q in QUESTIONS[:6]], [LONG_PROMPT, chatml(QUESTIONS[0]), LONG_PROMPT])
        expected = [greedy_together(apart, prompts) for prompts in groups]
    finally:
        apart.unload()
    together = load(engine, True, monkeypatch)
    try:
        assert NOTE in together.status().notes
        for prompts, tokens in zip(groups, expected):
            held, run = passes(together)
            assert greedy_together(together, prompts) == tokens
            assert together.cache_view().free_pages == together.cache_view().total_pages
            if prompts is one_length:  # 8 passes of 39 tokens (the prompt but its last token): one forward
                assert passes(together) == (held + 8, run + 1)
    finally:
        together.unload()
