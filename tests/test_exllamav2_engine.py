"""ExLlamaV2 engine checks that only make sense on a GPU (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from exlnb import get_session
from exlnb.models import resolve_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def exl_session():
    if not torch.cuda.is_available():
        pytest.skip("the ExLlamaV2 engine needs CUDA")
    session = get_session()
    session.load("smollm2-135m-instruct", engine="exllamav2", progress=False)
    return session


def test_logits_match_transformers_within_one_percent(exl_session):
    from transformers import AutoModelForCausalLM

    engine = exl_session.engine
    ids = torch.tensor([exl_session.tokenizer.encode("The capital of France is Paris. " * 8)])
    hf = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m-instruct"), dtype=torch.float32).cuda()
    with torch.inference_mode():
        reference = hf(ids.cuda()).logits.float().cpu()
        ours = exl_session.run_on_engine(lambda e: e.model.forward(ids).float().cpu())
    del hf
    torch.cuda.empty_cache()

    relative_error = float((ours - reference).norm() / reference.norm())
    assert relative_error < 1e-2, f"relative error {relative_error:.4g}"
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() > 0.95
    assert engine.config.rotary_embedding_base == 100000.0


def test_status_says_which_attention_serves_the_engine(exl_session):
    status = exl_session.status()
    assert status.engine == "exllamav2"
    assert status.attention
    assert status.device_memory_bytes > 0
    if not status.paged:
        assert any("unpaged" in note for note in status.notes)
