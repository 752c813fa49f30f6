"""The ExLlamaV2 decoder's token feed (exlnb/engines/exllamav2/token_feed.py): a queued step's tokens embedded on
the card, used only where that embeds ids exactly as the library's own module does. exllamav2's module needs CUDA
to import, so here the check runs against modules that embed as it does (accepted) or do more (refused); on the
GPU the decoder checks the real module at load (tests/test_graph_decode.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from exlnb.engines.exllamav2.token_feed import checked_feed, token_feed_on

VOCAB, HIDDEN = 300, 24


class Embedding:
    """exllamav2 0.3.2's `ExLlamaV2Embedding` for plain token ids (its forward without indexed embeddings or
    LoRAs): an fp16 table on the CPU, negative ids clamped to 0, float32 where the residual stream is, scaled by
    the square root of the hidden size where the model normalizes its embeddings."""

    def __init__(self, *, fp32_residual: bool, normalize: bool) -> None:
        table = torch.nn.Embedding(VOCAB, HIDDEN, dtype=torch.half)
        torch.nn.init.normal_(table.weight, std=3.0, generator=torch.Generator().manual_seed(0))
        self.embedding = table.requires_grad_(False)
        self.model = SimpleNamespace(config=SimpleNamespace(hidden_size=HIDDEN))
        self.archparams = SimpleNamespace(residual_stream_fp32=fp32_residual, normalize_embeddings=normalize)

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        x = self.embedding(hidden_states.clamp(min=0))
        if self.archparams.residual_stream_fp32:
            x = x.float()
        if self.archparams.normalize_embeddings:
            x *= self.model.config.hidden_size**0.5
        return x


@pytest.mark.parametrize("fp32_residual", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_a_feed_is_made_where_it_embeds_as_the_module_does_to_the_bit(fp32_residual, normalize):
    module = Embedding(fp32_residual=fp32_residual, normalize=normalize)

    feed, why = checked_feed(module, torch.device("cpu"))

    assert feed is not None and why == ""
    ids = torch.tensor([[0], [7], [VOCAB - 1], [-1]])
    got, expected = feed(ids), module.forward(ids)
    assert got.dtype == expected.dtype == (torch.float32 if fp32_residual else torch.half)
    assert torch.equal(got, expected)


def test_a_module_that_embeds_otherwise_gets_no_feed_and_says_why():
    class Scaled(Embedding):  # a later library that scales its rows, say
        def forward(self, hidden_states, **kwargs):
            return super().forward(hidden_states) * 2

    module = Scaled(fp32_residual=False, normalize=False)

    assert checked_feed(module, torch.device("cpu")) == (None, "the embedding on the card differs from exllamav2's")


def test_the_feed_is_on_unless_switched_off(monkeypatch):
    monkeypatch.delenv("EXLNB_TOKEN_FEED", raising=False)
    assert token_feed_on()
    monkeypatch.setenv("EXLNB_TOKEN_FEED", "0")
    assert not token_feed_on()
