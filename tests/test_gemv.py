"""exlnb's GEMV (engines/gemv.py) against torch's product: shapes that fill its blocks and shapes that do not, both
output types, the residual added as it writes; the gated activation (engines/gated_activation.py) against torch's
three kernels; and the GEMV with the norm folded in (engines/normed_gemv.py) against the norm and the product.
Compiled on CUDA (`-m gpu`), eagerly and inside a CUDA graph; without CUDA in Triton's interpreter, which must be
on before the kernels are defined (set at this module's top where there is no CUDA). Skipped where triton is not
installed."""

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


@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_with_its_residual_is_the_product_then_torch_s_add(device, shape):
    """The MLP's and the attention's residual added as the product's outputs are written: the bits of the product
    rounded to fp16 and then torch's add, on CUDA and in the interpreter alike."""
    from exlnb.engines.gemv import row_times_matrix, row_times_matrix_plus

    outputs, inputs = shape
    g = torch.Generator().manual_seed(outputs + inputs)
    weight = (torch.randn(shape, generator=g) * 0.05).half().to(device)
    x = torch.randn(1, 1, inputs, generator=g).half().to(device)
    residual = (torch.randn(1, 1, outputs, generator=g) * 4).half().to(device)

    got = row_times_matrix_plus(x, weight, residual)

    assert got.shape == residual.shape and got.dtype == torch.half
    assert torch.equal(got, row_times_matrix(x, weight, torch.half) + residual)


def activation_as_torch_runs_it(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """exllamav2's fp16 MLP between its gate/up and down products, kernel by kernel: SiLU, the multiply by up in
    place, the clamp to fp16's range (on the CPU, which has no fp16 SiLU, each step in float32 rounded to fp16)."""
    if gate.is_cuda:
        y = torch.nn.functional.silu(gate)
        y *= up
        return y.clamp_(min=-65504.0, max=65504.0)
    y = torch.nn.functional.silu(gate.float()).half()
    return (y.float() * up.float()).half().clamp_(min=-65504.0, max=65504.0)


@pytest.mark.parametrize("inputs", [11008, 3000, 1])
def test_the_gated_activation_is_torch_s_silu_multiply_and_clamp(device, inputs):
    """Bit for bit on CUDA; in the interpreter, whose exp is numpy's, within one fp16 step. Products past fp16's
    range are held at its largest value, and NaN stays NaN, as torch's clamp leaves them."""
    from exlnb.engines.gated_activation import silu_times

    g = torch.Generator().manual_seed(inputs)
    gate, up = (torch.randn(2, 1, 1, inputs, generator=g) * 3).half()
    extremes = {"past fp16's range": (300.0, 300.0), "below it": (300.0, -300.0), "NaN": (float("nan"), 1.0)}
    for at, (gate_value, up_value) in enumerate(list(extremes.values())[:inputs]):
        gate[..., at], up[..., at] = gate_value, up_value
    gate, up = gate.to(device), up.to(device)

    got = silu_times(gate, up)
    expected = activation_as_torch_runs_it(gate, up)

    assert got.shape == gate.shape and got.dtype == torch.half
    if device == "cuda":
        assert torch.equal(got.nan_to_num(), expected.nan_to_num()) and torch.equal(got.isnan(), expected.isnan())
    else:
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-3, atol=1e-7, equal_nan=True)
    if inputs >= 3:
        assert got[..., 0].item() == 65504.0 and got[..., 1].item() == -65504.0 and got[..., 2].isnan().item()


# -- a GEMV with the norm folded in (engines/normed_gemv.py), as the norm-product sweep times it ----------------


@pytest.mark.parametrize("output_major", [True, False], ids=["output-major", "input-major-stack"])
@pytest.mark.parametrize("config", [(8, 64, 4, 2, False), (32, 128, 4, 3, True)], ids=["two-passes", "one-pass"])
@pytest.mark.parametrize("products", [3, 2], ids=["q-k-v", "gate-up"])
def test_one_launch_gives_the_norm_then_the_group_s_products_in_the_stack_s_order(
    device, output_major, config, products
):
    """The row normed as the norm's kernel writes it (fp16), then each of the stack's products, their outputs one
    after the other, whether the weights are read output-major or as the fused group's stack lies, and whether the
    row is read in two passes (the RMS first) or in one (the sums scaled at the end); a block of outputs past the
    last is masked."""
    from benchmarks.norm_product_sweep import output_major_of
    from exlnb.engines.normed_gemv import normed_product

    inputs, outputs = 256, 40  # 40 outputs a product: not a multiple of any block
    g = torch.Generator().manual_seed(inputs + outputs)
    stack = (torch.randn(products, inputs, outputs, generator=g) * 0.05).half()
    x = (torch.randn(inputs, generator=g) * 3).half()
    norm = (1 + 0.1 * torch.randn(inputs, generator=g)).half()
    normed = (x.float() * torch.rsqrt(x.float().pow(2).mean() + 1e-5) * norm.float()).half()
    expected = torch.bmm(normed.float().view(1, 1, -1).expand(products, -1, -1), stack.float()).view(-1)
    weight = output_major_of([stack])[0] if output_major else stack

    got = normed_product(x.to(device), norm.to(device), weight.to(device), config, 1e-5)

    assert got.shape == (products * outputs,) and got.dtype == torch.half
    torch.testing.assert_close(got.float().cpu(), expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("products, outputs", [(3, 40), (2, 72)], ids=["q-k-v", "gate-up"])
def test_the_engine_s_entry_reads_an_output_major_stack_and_refuses_an_input_major_one(device, products, outputs):
    """`normed_row_times_stack`, as a folded tail calls it: the group's (P, K, N) stack a view of output-major
    weights, the (P, N) outputs those of the norm and each product, in the engine's CONFIG; the input-major stack,
    which that CONFIG was not timed on and which the sweep found slower than the norm and cuBLAS, refused."""
    from exlnb.engines.normed_gemv import normed_row_times_stack

    inputs = 512
    g = torch.Generator().manual_seed(products)
    rows = (torch.randn(products, outputs, inputs, generator=g) * 0.05).half()  # (P, N, K), as the engine lays them
    x = (torch.randn(1, 1, inputs, generator=g) * 3).half()
    norm = (1 + 0.1 * torch.randn(inputs, generator=g)).half()
    normed = (x.float().view(-1) * torch.rsqrt(x.float().pow(2).mean() + 1e-5) * norm.float()).half()
    expected = torch.stack([weights.float() @ normed.float() for weights in rows])

    got = normed_row_times_stack(x.to(device), norm.to(device), 1e-5, rows.to(device).transpose(1, 2))

    assert got.shape == (products, outputs) and got.is_contiguous()
    torch.testing.assert_close(got.float().cpu(), expected, rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="output-major"):
        normed_row_times_stack(x.to(device), norm.to(device), 1e-5, rows.transpose(1, 2).contiguous().to(device))


@pytest.mark.parametrize("config", [None, (16, 128, 4, 3, False)], ids=["engine-config", "two-passes"])
def test_one_launch_gives_the_norm_both_products_and_the_activation_of_a_gated_mlp(device, config):
    """`normed_gated_row`: the row normed, gate and up each rounded to fp16 as the products write them, then
    clamp(silu(gate) * up) as torch computes it, from an output-major stack whose slots put up first; 40 outputs
    fill no block."""
    from exlnb.engines.normed_gemv import normed_gated_row

    inputs, outputs = 384, 40
    g = torch.Generator().manual_seed(7)
    up_gate = (torch.randn(2, outputs, inputs, generator=g) * 0.05).half()  # (2, N, K): up in slot 0, gate in 1
    x = (torch.randn(inputs, generator=g) * 3).half()
    norm = (1 + 0.1 * torch.randn(inputs, generator=g)).half()
    normed = (x.float() * torch.rsqrt(x.float().pow(2).mean() + 1e-5) * norm.float()).half().float()
    up, gate = ((weights.float() @ normed).half() for weights in up_gate)
    expected = torch.clamp(torch.nn.functional.silu(gate.float()).half().float() * up.float(), -65504, 65504).half()

    got = normed_gated_row(x.to(device), norm.to(device), 1e-5, up_gate.to(device).transpose(1, 2), (1, 0), config)

    assert got.shape == (outputs,) and got.dtype == torch.half
    torch.testing.assert_close(got.float().cpu(), expected.float(), rtol=4e-3, atol=4e-3)
    with pytest.raises(ValueError, match="output-major"):
        normed_gated_row(x.to(device), norm.to(device), 1e-5, up_gate.transpose(1, 2).contiguous().to(device), (1, 0))


@pytest.mark.parametrize("products", [3, 2], ids=["q-k-v", "gate-up"])
def test_every_way_the_norm_product_sweep_times_gives_the_same_outputs(device, products):
    """The sweep's ways, on a small group (its configurations' blocks masked to fit): each gives its outputs'
    first way's (the norm and the batched product; for gate and up, then the activation; for q, k and v, rotated),
    so that the sweep times the same work every way."""
    from benchmarks import norm_product_sweep

    inputs, outputs, layers = 64, 24, 2
    g = torch.Generator().manual_seed(products)
    stacks = [(torch.randn(products, inputs, outputs, generator=g) * 0.1).half().to(device) for _ in range(layers)]
    x = torch.randn(inputs, generator=g).half().to(device)
    norm = (1 + 0.1 * torch.randn(inputs, generator=g)).half().to(device)
    found = norm_product_sweep.ways(x, norm, stacks, norm_product_sweep.output_major_of(stacks))

    references = {}
    for name, fn in found.items():
        outputs_of_layers = fn()
        assert len(outputs_of_layers) == layers, name
        for layer, out in enumerate(outputs_of_layers):
            kind = norm_product_sweep.same_outputs(name, out)
            reference = references.setdefault((kind, layer), out.float().cpu())
            torch.testing.assert_close(out.float().cpu(), reference, rtol=5e-3, atol=5e-3, msg=name)
    kinds = {kind for kind, _ in references}
    assert kinds == {(products * outputs, False), (outputs, False) if products == 2 else (products * outputs, True)}


@pytest.mark.parametrize("head_dim", [64, 80], ids=["head-64", "head-80"])
def test_one_launch_gives_the_norm_q_k_and_v_and_rope_at_the_position_on_the_device(device, head_dim):
    """`normed_roped_rows`: the row normed, each product rounded to fp16 as written, then NEOX RoPE on the products
    it is told to rotate (here the stack's third and first), at the position the positions tensor holds, against
    RoPE in float64 on the products; the other product as normed_row_times_stack gives it (its sums may run in
    another order on a GPU: to fp16's last place)."""
    from exlnb.engines.normed_gemv import normed_roped_rows, normed_row_times_stack

    inputs, heads, positions = 256, 2, 12
    outputs = heads * head_dim
    g = torch.Generator().manual_seed(head_dim)
    rows = (torch.randn(3, outputs, inputs, generator=g) * 0.05).half()  # (P, N, K), output-major
    x = (torch.randn(inputs, generator=g) * 3).half()
    norm = (1 + 0.1 * torch.randn(inputs, generator=g)).half()
    frequencies = torch.arange(positions)[:, None] * 10000 ** (-torch.arange(head_dim // 2) / (head_dim // 2))
    angles = torch.cat([frequencies, frequencies], -1)[None, None]  # exllamav2's (1, 1, positions, head_dim)
    sin, cos = angles.sin().half(), angles.cos().half()
    stack = rows.to(device).transpose(1, 2)
    plain = normed_row_times_stack(x.to(device), norm.to(device), 1e-5, stack).cpu()

    for position in (0, 7):
        at = torch.tensor([position], dtype=torch.int32)
        got = normed_roped_rows(
            x.to(device), norm.to(device), 1e-5, stack, (2, 0), sin.to(device), cos.to(device), at.to(device)
        ).cpu()
        assert got.shape == (3, outputs) and got.is_contiguous()
        torch.testing.assert_close(got[1], plain[1], rtol=1e-3, atol=1e-3)  # not rotated
        c, s = cos[0, 0, position, : head_dim // 2].double(), sin[0, 0, position, : head_dim // 2].double()
        for product in (0, 2):
            left, right = plain[product].double().view(heads, 2, head_dim // 2).unbind(1)
            expected = torch.stack([left * c - right * s, right * c + left * s], 1).view(-1)
            torch.testing.assert_close(got[product].double(), expected, rtol=4e-3, atol=4e-3)
    assert not torch.equal(got[0], plain[0])  # a position past 0 turns the heads


def test_each_paired_kernel_takes_the_tiles_its_variable_names_at_each_launch(device, monkeypatch):
    """`EXLNB_GATED_TILES` (the speed suite's other shapes for the activation's kernel): a gated row launched with it
    set gives the bits of that configuration passed by hand, read in one pass; RoPE's variable leaves it alone."""
    from exlnb.engines.normed_gemv import GATED_CONFIG, GATED_TILES, ROPED_TILES, normed_gated_row

    inputs, outputs = 2048, 24
    g = torch.Generator().manual_seed(11)
    gate_up = (torch.randn(2, outputs, inputs, generator=g) * 0.05).half().to(device).transpose(1, 2)
    x, norm = torch.randn(inputs, generator=g).half().to(device), torch.ones(inputs).half().to(device)
    by_hand = normed_gated_row(x, norm, 1e-5, gate_up, (0, 1), (4, 512, 4, 4, True))
    own = normed_gated_row(x, norm, 1e-5, gate_up, (0, 1), GATED_CONFIG)
    monkeypatch.setenv(ROPED_TILES, "4,512,4,4")
    assert torch.equal(normed_gated_row(x, norm, 1e-5, gate_up, (0, 1)), own)
    monkeypatch.setenv(GATED_TILES, "4,512,4,4")
    assert torch.equal(normed_gated_row(x, norm, 1e-5, gate_up, (0, 1)), by_hand)


@pytest.mark.parametrize("value", ["4,1024,4", "3,1024,4,3", "4,1000,4,3", "4,1024,32,3", "4,1024,4,0", "a,b,c,d"])
@pytest.mark.parametrize("variable", ["EXLNB_GATED_TILES", "EXLNB_ROPED_TILES"])
def test_tiles_the_paired_kernels_cannot_take_are_refused_in_one_line(monkeypatch, variable, value):
    pytest.importorskip("triton")
    from exlnb.engines.normed_gemv import GATED_CONFIG, paired_config

    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=rf"^{variable}=.*stages 1 to 6\)$") as error:
        paired_config(variable, GATED_CONFIG)
    assert "\n" not in str(error.value)
