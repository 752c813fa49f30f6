"""ExLlamaV2 engine checks that only make sense on a GPU (`pytest -m gpu`).

The engine-level acceptance (tests/test_session.py) runs on this engine too, through `engine_session`; with
the default `paged="auto"` and no flash-attn, that is paged mode served by exlnb's paged attention.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from benchmarks.paged_acceptance import QUESTIONS, answers_alone, answers_together, shared_prompt_pages
from exlnb import get_session
from exlnb.engines.exllamav2 import paged_attention
from exlnb.engines.job_options import JobOptions
from exlnb.models import resolve_model
from exlnb.session import Session
from tests.test_session import max_overlap

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def exl_session():
    if not torch.cuda.is_available():
        pytest.skip("the ExLlamaV2 engine needs CUDA")
    session = get_session()
    session.load("smollm2-135m-instruct", engine="exllamav2", progress=False)
    return session


@pytest.fixture(scope="module")
def transformers_logits():
    """HF transformers fp32 on the GPU: the reference both attention paths are held to."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m-instruct"), dtype=torch.float32).cuda()

    def logits(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([ids]).cuda()).logits.float().cpu()

    yield logits
    model = None  # the closure holds the model until here: let it go
    torch.cuda.empty_cache()


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).norm() / reference.norm())


def test_logits_match_transformers_within_one_percent(exl_session, transformers_logits):
    engine = exl_session.engine
    ids = exl_session.tokenizer.encode("The capital of France is Paris. " * 8)
    reference = transformers_logits(ids)
    ours = exl_session.run_on_engine(lambda e: e.model.forward(torch.tensor([ids])).float().cpu())

    assert relative_error(ours, reference) < 1e-2
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() > 0.95
    assert engine.config.rotary_embedding_base == 100000.0


def paged_prefill_logits(engine, ids: list[int], first_chunk: int, pages: list[int]) -> torch.Tensor:
    """The prompt through exllamav2's paged forward pass in two chunks, on pages out of order, in a cache of
    its own (the engine's free pages may hold prefixes kept for reuse). The first chunk fits one page, so
    exllamav2 writes its keys itself; the second spans two non-adjacent pages, so the attention writes them.
    Returns the second chunk's logits."""
    from exllamav2 import ExLlamaV2Cache

    page = engine.generator.page_size
    cache = ExLlamaV2Cache(engine.model, max_seq_len=page * (max(pages) + 1))
    table = torch.tensor([pages], dtype=torch.int32)
    with torch.inference_mode():
        for start, stop in ((0, first_chunk), (first_chunk, len(ids))):
            params = engine.generator.get_paged_params(
                1, table[:, : -(-stop // page)].contiguous(), torch.tensor([start], dtype=torch.int32), stop - start
            )
            logits = engine.model.forward_chunk(torch.tensor([ids[start:stop]]), cache=cache, attn_params=params)
    return logits["logits"].float().cpu()


def test_paged_forward_matches_transformers_within_one_percent(exl_session, transformers_logits):
    if not exl_session.status().paged:
        pytest.skip("the engine is unpaged here")
    ids = exl_session.tokenizer.encode("The capital of France is Paris. " * 60)[:300]
    reference = transformers_logits(ids)[:, 200:]
    ours = exl_session.run_on_engine(lambda e: paged_prefill_logits(e, ids, 200, [2, 0]))[..., : reference.shape[-1]]

    assert relative_error(ours, reference) < 1e-2
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() > 0.95


def test_status_says_which_attention_serves_the_engine(exl_session):
    from exllamav2 import attn

    status = exl_session.status()
    assert status.engine == "exllamav2"
    assert status.device_memory_bytes > 0
    if attn.has_flash_attn:
        assert status.attention.startswith("flash-attn")
    else:  # paged="auto" without flash-attn: exlnb's paged attention serves exllamav2's paged mode
        kernels = "Triton decode, PyTorch prefill" if paged_attention.decodes_on_triton() else "PyTorch"
        assert status.paged and status.attention == f"exlnb paged attention ({kernels})"
        assert paged_attention.installed()
        assert any("exlnb's PyTorch paged attention" in note for note in status.notes)


def test_sixteen_prompts_together_in_paged_mode_equal_each_alone_unpaged(exl_session):
    if not exl_session.status().paged:
        pytest.skip("the engine is unpaged here")
    unpaged = Session()
    status = unpaged.load("smollm2-135m-instruct", engine="exllamav2", paged=False, progress=False)
    try:
        assert not status.paged
        alone = [r.text for r in answers_alone(unpaged, QUESTIONS, 48)]
    finally:
        unpaged.unload()

    streams = answers_together(exl_session, QUESTIONS, 48)
    together = [s.result().text for s in streams]

    assert together == alone
    assert len(set(alone)) == len(QUESTIONS)  # the prompts really differ, so mixing would show
    assert max_overlap(streams) >= 8  # they ran batched, not one after another


def test_jobs_with_the_same_long_prompt_share_its_pages(exl_session):
    if not exl_session.status().paged:
        pytest.skip("the engine is unpaged here")
    sharing = shared_prompt_pages(exl_session)

    assert sharing["shared_pages_while_both_run"] >= 2
    assert all(p["ref_count"] == 2 and len(p["owners"]) == 2 for p in sharing["shared_pages"])
    assert sharing["cached_tokens"][2] >= 2 * sharing["page_size"]  # the later job reuses the prompt's pages
    assert sharing["same_text"], {k: sharing[k] for k in ("first_different_token", "cached_tokens", "ttft_s")}
    view = exl_session.cache_view()
    assert view.free_pages == view.total_pages


def test_paged_attention_refuses_an_unverified_exllamav2(exl_session, monkeypatch):
    import exllamav2

    monkeypatch.setattr(exllamav2, "__version__", "0.3.3")
    with pytest.raises(RuntimeError, match="verified against exllamav2 0.3.2, found 0.3.3"):
        paged_attention.install()


def test_every_sampler_setting_reaches_exllamav2(exl_session):
    from dataclasses import fields

    from exllamav2.generator import ExLlamaV2Sampler

    from exlnb import SamplerSettings

    ours = SamplerSettings(
        temperature=0.9,
        top_a=0.1,
        tfs=0.9,
        typical=0.9,
        smoothing_factor=0.2,
        min_temp=0.5,
        max_temp=1.5,
        temperature_last=True,
        skew=0.5,
        mirostat=True,
        mirostat_tau=2.0,
        mirostat_eta=0.2,
        token_bias={5: -2.0},
        dry_multiplier=0.8,
        dry_sequence_breakers={"\n"},
        dry_range=64,
        xtc_probability=0.5,
        xtc_threshold=0.2,
    )
    theirs = exl_session.run_on_engine(lambda e: e._upstream_settings(ours, ExLlamaV2Sampler.Settings))
    for f in fields(ours):
        if f.name not in ("token_bias", "dry_sequence_breakers"):
            assert getattr(theirs, f.name) == getattr(ours, f.name), f.name
    assert theirs.token_bias[5] == -2.0 and theirs.token_bias.numel() % 32 == 0
    assert exl_session.tokenizer.encode("\n")[0] in theirs.dry_sequence_breakers


def test_the_exllamav2_engine_refuses_the_loop_detector(exl_session):
    with pytest.raises(ValueError, match="the exllamav2 engine does not implement stop_on_loop"):
        exl_session.submit(replace(exl_session.spec_for("Hi", JobOptions(max_new_tokens=4)), stop_on_loop=(300, 3)))


def test_new_settings_sample_on_the_gpu(exl_session):
    from exlnb import SamplerSettings

    settings = SamplerSettings(
        temperature=1.0,
        dry_multiplier=0.8,
        xtc_probability=0.5,
        typical=0.9,
        tfs=0.95,
        top_a=0.1,
        mirostat=True,
        smoothing_factor=0.3,
        max_temp=1.5,
        min_temp=0.5,
        skew=0.2,
        token_bias={5: -2.0},
    )
    result = exl_session.complete("Once upon a time", max_new_tokens=16, sampler=settings, seed=1)
    assert result.new_tokens > 0
