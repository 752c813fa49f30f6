"""exlnb's GEMV (engines/gemv.py) against torch's product: shapes that fill its blocks and shapes that do not, both
output types. Compiled on CUDA (`-m gpu`), eagerly and inside a CUDA graph; without CUDA in Triton's interpreter,
which must be on before the kernel is defined (set at this module's top where there is no CUDA). Skipped where
triton is not installed."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHAPES = [(4096, 4096), (4096, 11008), (40, 3000), (17, 1)]  # (out, in): a 7B layer's o and down, then ragged


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if request.param == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CUDA is here, so the kernel compiled for it: the interpreter runs where there is none")
    return request.param


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.half, torch.float32])
def test_one_row_times_a_matrix_is_torchs_product(device, shape, out_dtype):
    from exlnb.engines.gemv import row_times_matrix

    g = torch.Generator().manual_seed(sum(shape))
    weight = (torch.randn(shape, generator=g) * 0.05).half().to(device)
    x = torch.randn(1, 1, shape[1], generator=g).half().to(device)
    got = row_times_matrix(x, weight, out_dtype)
    expected = x.float().reshape(1, -1) @ weight.float().t()
    assert got.shape == (1, 1, shape[0]) and got.dtype == out_dtype
    tolerance = 2e-3 if out_dtype == torch.half else 1e-4
    assert float((got.float().reshape(1, -1) - expected).abs().max() / expected.abs().max()) < tolerance


@pytest.mark.gpu
def test_the_gemv_captured_in_a_cuda_graph_replays_new_inputs(device):
    if device != "cuda":
        pytest.skip("CUDA graphs need CUDA")
    from exlnb.engines.gemv import row_times_matrix

    weight = torch.randn(4096, 11008, device="cuda").half() * 0.02
    x = torch.randn(1, 11008, device="cuda").half()
    row_times_matrix(x, weight, torch.float32)  # compiles the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = row_times_matrix(x, weight, torch.float32)
    x.copy_(torch.randn(1, 11008, device="cuda").half())
    graph.replay()
    torch.cuda.synchronize()
    expected = x.float() @ weight.float().t()
    assert float((out - expected).abs().max() / expected.abs().max()) < 1e-4


def mlp_tail_as_torch_runs_it(gate, up, weight, residual):
    """exllamav2's fp16 MLP after its gate and up products, kernel by kernel: SiLU, the multiply by up in place,
    the clamp to fp16's range, down (on exlnb's GEMV, as the engine runs it at one row), the residual add."""
    from exlnb.engines.gemv import row_times_matrix

    y = torch.nn.functional.silu(gate)
    y *= up
    y.clamp_(min=-65504.0, max=65504.0)
    return row_times_matrix(y, weight, torch.half) + residual


@pytest.mark.parametrize("shape", SHAPES)
def test_a_gated_row_with_its_residual_is_the_mlp_tail_torch_runs(device, shape):
    """Bit for bit on CUDA; in the interpreter, whose exp is numpy's, to fp16's rounding."""
    from exlnb.engines.gemv import gated_row_times_matrix_plus

    outputs, inputs = shape
    g = torch.Generator().manual_seed(outputs + inputs)
    weight = (torch.randn(shape, generator=g) * 0.05).half().to(device)
    gate, up = (torch.randn(2, 1, 1, inputs, generator=g) * 3).half().to(device)
    extremes = torch.tensor([300.0, -300.0])[:inputs]  # products past fp16's range: the clamp holds them
    gate[..., : len(extremes)], up[..., : len(extremes)] = 300.0, extremes.half().to(device)
    weight[:, : len(extremes)] = 1e-4  # small, so the other inputs and the residual still count in the outputs
    residual = torch.randn(1, 1, outputs, generator=g).half().to(device)
    got = gated_row_times_matrix_plus(gate, up, weight, residual)
    if device == "cpu":  # torch has no fp16 SiLU on the CPU: its steps in float32, each rounded as on the GPU
        gate, up, weight, residual = gate.float(), up.float(), weight.float(), residual.float()
    expected = mlp_tail_as_torch_runs_it(gate, up, weight, residual)
    assert got.shape == residual.shape and got.dtype == torch.half
    if device == "cuda":
        assert torch.equal(got, expected)
    else:
        assert float((got.float() - expected.float()).abs().max() / expected.float().abs().max()) < 2e-3
