"""The graph decoders' token feed (exlnb/engines/token_feed.py and each engine's token_feed.py): a step's tokens
embedded on the card, used only where that embeds ids exactly as the library's own module does. Both libraries'
modules need CUDA to import, so here the check runs against modules that embed as theirs do (accepted) or do more
(refused); on the GPU the decoders check the real modules at load (tests/test_graph_decode.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from exlnb.engines.exllamav2.token_feed import checked_feed
from exlnb.engines.token_feed import TokenFeed, checked, token_feed_on

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


def exllamav3_embedding(ids: torch.Tensor, table: torch.Tensor, multiplier: float, normalize: bool) -> torch.Tensor:
    """exllamav3 1.6.5's `Embedding.forward` for plain token ids with a resident table: the rows, times the
    multiplier in the table's dtype, in float32, then scaled by the square root of their width where it normalizes."""
    x = torch.nn.functional.embedding(ids, table)
    if multiplier != 1.0:
        x *= multiplier
    x = x.float()
    if normalize:
        x *= x.shape[-1] ** 0.5
    return x


@pytest.mark.parametrize(("multiplier", "normalize"), [(1.0, False), (12.0, False), (1.0, True), (0.3, True)])
def test_a_feed_for_exllamav3_s_embedding_embeds_as_it_does_to_the_bit(multiplier, normalize):
    table = (torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(1)) * 3).half()
    feed = TokenFeed(table, torch.float32, multiplier=multiplier, scale=HIDDEN**0.5 if normalize else None)

    checked_one, why = checked(feed, lambda ids: exllamav3_embedding(ids, table, multiplier, normalize), "exllamav3")

    assert checked_one is feed and why == ""
    ids = torch.tensor([[0], [5], [VOCAB - 1]])
    assert torch.equal(feed(ids), exllamav3_embedding(ids, table, multiplier, normalize))


def test_a_feed_that_multiplies_after_the_cast_is_refused():
    """exllamav3 multiplies in the table's dtype, then casts: the other order rounds differently, which the check
    at load must catch rather than let a step's hidden state drift from eager decode."""
    table = (torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(2)) * 3).half()

    def cast_first(ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, table).float() * 0.3

    feed = TokenFeed(table, torch.float32, multiplier=0.3)

    assert checked(feed, cast_first, "exllamav3") == (None, "the embedding on the card differs from exllamav3's")


def test_the_feed_is_on_unless_switched_off(monkeypatch):
    monkeypatch.delenv("EXLNB_TOKEN_FEED", raising=False)
    assert token_feed_on()
    monkeypatch.setenv("EXLNB_TOKEN_FEED", "0")
    assert not token_feed_on()
