"""exlnb's kernels launched dependent on the kernel before them (engines/dependent_launch.py): off unless asked,
never on the CPU, under Triton's interpreter or before compute capability 9.0; on such a card (`-m gpu`) a decode
step's order of exlnb's kernels, each reading what the one before it wrote, gives the same bits launched dependent
(letting the next kernel start after the main loop, or at once) as apart, eagerly and replayed from one CUDA graph
with new inputs. The decode attention's own comparison is in test_triton_decode.py. Skipped where triton is not
installed."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

HIDDEN, INTERMEDIATE, HEAD_DIM, LAYERS = 4096, 11008, 128, 4  # a 7B layer's widths, a few layers deep


def test_it_is_off_unless_asked_and_only_where_the_card_has_it(monkeypatch):
    from exlnb.engines import dependent_launch as launch

    monkeypatch.delenv(launch.VARIABLE, raising=False)
    assert not launch.dependent_launch_on()
    for value, mode in (("1", launch.AFTER_THE_LOOP), ("early", launch.AT_ONCE), ("0", launch.APART)):
        monkeypatch.setenv(launch.VARIABLE, value)
        assert launch.dependent_launch_mode() == mode and launch.dependent_launch_on() is (mode != launch.APART)
        assert launch.dependent_launch(torch.device("cpu")) == launch.APART
    monkeypatch.setenv(launch.VARIABLE, "yes")
    with pytest.raises(ValueError, match=r"^EXLNB_DEPENDENT_LAUNCH='yes': one of 0, 1, early$"):
        launch.dependent_launch_on()
    monkeypatch.setenv(launch.VARIABLE, "early")
    monkeypatch.setattr(launch, "INTERPRETED", False)
    for hopper, mode in ((True, launch.AT_ONCE), (False, launch.APART)):
        monkeypatch.setattr(launch, "_hopper_or_later", lambda index, hopper=hopper: hopper)
        assert launch.dependent_launch(torch.device("cuda", 0)) == mode
    monkeypatch.setattr(launch, "TRITON_HAS_IT", False)  # a Triton before 3.3
    assert launch.dependent_launch(torch.device("cuda", 0)) == launch.APART
    monkeypatch.setattr(launch, "TRITON_HAS_IT", True)
    monkeypatch.setattr(launch, "INTERPRETED", True)  # the interpreter runs no inline PTX
    assert launch.dependent_launch(torch.device("cuda", 0)) == launch.APART


@pytest.fixture(scope="module")
def weights() -> dict:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("dependent launch needs compute capability 9.0")
    g = torch.Generator().manual_seed(3)

    def rand(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g) * scale).half().cuda()

    positions = torch.arange(64)[:, None] * 10000 ** (-torch.arange(HEAD_DIM // 2) / (HEAD_DIM // 2))
    angles = torch.cat([positions, positions], -1)[None, None]
    return {
        "norm": (1 + rand(HIDDEN, scale=0.1)),
        "qkv": rand(3, HIDDEN, HIDDEN).transpose(1, 2),  # (P, K, N): a view of output-major weights
        "o": rand(HIDDEN, HIDDEN),
        "gate_up": rand(2, INTERMEDIATE, HIDDEN).transpose(1, 2),
        "down": rand(HIDDEN, INTERMEDIATE),
        "sin": angles.sin().half().cuda(),
        "cos": angles.cos().half().cuda(),
    }


def step(x: torch.Tensor, position: torch.Tensor, w: dict) -> torch.Tensor:
    """LAYERS of a Llama layer's single-row kernels in a decode step's order, each reading the one before's output:
    q, k and v with the norm and RoPE; o (v standing in for the attention) adding the residual; gate and up with the
    norm and the activation; down adding the residual; gate and up again through the activation's own kernel. The
    step's row first copied, as a graph's first node is often a copy: the first kernel waits for a copy, not a
    kernel."""
    from exlnb.engines.gated_activation import silu_times
    from exlnb.engines.gemv import row_times_matrix, row_times_matrix_plus
    from exlnb.engines.normed_gemv import normed_gated_row, normed_roped_rows

    x = x.clone()
    for _ in range(LAYERS):
        qkv = normed_roped_rows(x, w["norm"], 1e-5, w["qkv"], (0, 1), w["sin"], w["cos"], position)
        x = row_times_matrix_plus(qkv[2], w["o"], x)
        x = row_times_matrix_plus(normed_gated_row(x, w["norm"], 1e-5, w["gate_up"], (0, 1)), w["down"], x)
    gate, up = (row_times_matrix(x, w["gate_up"][i].t(), torch.half) for i in (0, 1))
    return row_times_matrix(silu_times(gate.contiguous(), up.contiguous()), w["down"], torch.float32)


@pytest.mark.gpu
def test_a_step_s_kernels_give_the_same_bits_launched_dependent_eagerly_and_from_a_graph(weights, monkeypatch):
    from exlnb.engines.dependent_launch import VARIABLE

    inputs = [torch.randn(HIDDEN, device="cuda").half() for _ in range(3)]
    position = torch.tensor([5], dtype=torch.int32, device="cuda")
    monkeypatch.setenv(VARIABLE, "0")
    apart = [step(x, position, weights) for x in inputs]
    for mode in ("1", "early"):
        monkeypatch.setenv(VARIABLE, mode)
        assert all(torch.equal(step(x, position, weights), a) for x, a in zip(inputs, apart, strict=True)), mode

        static = inputs[0].clone()
        step(static, position, weights)  # compiled outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(static, position, weights)
        for x, expected in zip(inputs, apart, strict=True):  # each replay reads the input copied in just before
            static.copy_(x)
            graph.replay()
            assert torch.equal(out, expected), mode
