"""The ExLlamaV3 engine's fused fp16 projections (exllamav3/fused_products.py), on a small random Llama whose q, k
and v are one shape (as Llama-2-7B's): each projection gives what its own product gives, the model's logits stay
those of the separate products, no weight is held twice, and the switch turns it off. The GPU suite's other
ExLlamaV3 tests run the bundled model with the products fused, as the engine loads by default."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from benchmarks.paged_acceptance import QUESTIONS
from exlnb.engines.cuda_graphs import CHECK_TOLERANCE
from exlnb.random_model import LLAMA_7B, random_llama
from exlnb.session import Session
from exlnb.templates import chatml

LAYERS = 3
SHAPE = dict(LLAMA_7B, hidden_size=256, intermediate_size=768, num_hidden_layers=LAYERS, num_attention_heads=4)


@pytest.fixture(scope="module")
def folder():
    if not torch.cuda.is_available():
        pytest.skip("the fused products run on CUDA")
    if importlib.util.find_spec("exllamav3") is None:
        pytest.skip("exllamav3 is not installed")
    with random_llama(dict(SHAPE, num_key_value_heads=4)) as (path, _):
        yield path


def load(folder) -> Session:
    session = Session()
    session.load(str(folder), engine="exllamav3", progress=False)
    return session


@pytest.fixture(scope="module")
def session(folder):
    loaded = load(folder)
    yield loaded
    loaded.unload()


def _whole_sequence_logits(engine, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return engine.model.forward(torch.tensor([token_ids]), {"attn_mode": "flash_attn_nc"}).float().cpu()


@pytest.mark.gpu
def test_the_status_says_how_many_groups_are_fused(session):
    sizes = session.run_on_engine(lambda engine: [len(group.linears) for group in engine.fused.groups])
    assert sizes == [3, 2] * LAYERS  # each layer's q, k and v, then its gate and up
    assert f"{2 * LAYERS} fp16 projection groups fused" in session.status().decode


@pytest.mark.gpu
def test_each_projection_gives_its_own_product_and_another_input_takes_the_separate_path(session):
    def check(engine):
        group = engine.fused.groups[-1]  # the last layer's gate and up: float32 outputs in exllamav3's Llama
        x = torch.randn((3, 1, group.stacked.shape[1]), dtype=torch.half, device=group.stacked.device)
        other = x.clone()
        with torch.inference_mode():
            fused = [linear.forward(x, {}) for linear in group.linears]
            separate = [own(x, {}) for own in group._own]
            alone = group.linears[-1].forward(other, {})  # not the input the group just read: its own product
        return fused, separate, alone, group._pending

    fused, separate, alone, pending = session.run_on_engine(check)
    assert pending is None  # nothing held once the group's last output is handed over
    for mine, theirs in zip(fused, separate, strict=True):
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype and mine.is_contiguous()
        assert float((mine.float() - theirs.float()).abs().max() / theirs.float().abs().max()) < 1e-3
    assert torch.equal(alone, separate[-1])


@pytest.mark.gpu
def test_the_logits_stay_those_of_the_separate_products(session):
    token_ids = session.run_on_engine(lambda engine: engine.tokenizer.encode(chatml(QUESTIONS[0])))

    def both(engine):
        fused = _whole_sequence_logits(engine, token_ids)
        engine.fused.uninstall()
        try:
            return fused, _whole_sequence_logits(engine, token_ids)
        finally:
            engine.fused.install()

    fused, separate = session.run_on_engine(both)
    error = float((fused - separate).abs().max() / separate.abs().max())
    assert error < CHECK_TOLERANCE, error  # as close as a graph's replay must be to the eager step


@pytest.mark.gpu
def test_no_weight_is_held_twice(session):
    def reinstall(engine):
        engine.fused.uninstall()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        engine.fused.install()
        torch.cuda.synchronize()
        largest = max(group.stacked.numel() * group.stacked.element_size() for group in engine.fused.groups)
        return torch.cuda.memory_allocated() - before, largest

    grown, largest = session.run_on_engine(reinstall)
    assert grown <= largest, (grown, largest)  # stacking moves the weights: at most rounding, never a copy


@pytest.mark.gpu
def test_the_switch_keeps_the_separate_products(folder, monkeypatch):
    monkeypatch.setenv("EXLNB_FUSED_PRODUCTS", "0")
    separate = load(folder)
    try:
        assert separate.run_on_engine(lambda engine: engine.fused.groups) == []
        assert "fused" not in separate.status().decode
    finally:
        separate.unload()


class _Projection:
    """A stand-in for an exllamav3 fp16 projection on the CPU: its weight input-major, its forward the product."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.calls = weight, 0

    def forward(self, x: torch.Tensor, params: dict, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        self.calls += 1
        return x @ self.weight


def test_a_group_computes_every_output_at_its_first_projection_and_hands_the_rest_over():
    from exlnb.engines.exllamav3.fused_products import _Group

    torch.manual_seed(0)
    projections = [_Projection(torch.randn(16, 8)) for _ in range(3)]
    stacked = torch.stack([p.weight for p in projections])
    group = _Group(projections, stacked, torch.float32)
    group.install()
    x, other = torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    outputs = [p.forward(x, {}) for p in projections]
    for p, y in zip(projections, outputs, strict=True):
        assert y.shape == (2, 1, 8) and y.is_contiguous()
        assert torch.allclose(y, x @ p.weight, atol=1e-5)
    assert [p.calls for p in projections] == [0, 0, 0] and group._pending is None
    assert torch.allclose(projections[1].forward(other, {}), other @ projections[1].weight)
    assert projections[1].calls == 1  # another input: the projection's own product
    group.uninstall()
    assert projections[0].forward(x, {}) is not None and projections[0].calls == 1
