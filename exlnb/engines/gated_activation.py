"""A gated MLP's activation at one row in one Triton kernel: clamp(SiLU(gate) * up), with torch's bits.

exllamav2 0.3.2's unquantized MLP runs it as three kernels (`F.silu`, the multiply by up in place, a clamp to fp16's
range), each a launch of a step's graph; in one step a launch costs its kernel's time and about 0.88 us more
(docs/performance.md). Computing it inside the down product instead, in every program that reads it, was slower
on an H200: each of 256 programs repeated the row's 11,008 SiLUs (benchmarks/results/speed-nvidia-h200-2026-11-29-c).
Here each element is computed once and rounded where torch rounds: SiLU in float32 as x / (1 + expf(-x)) with IEEE
division, rounded to fp16; the multiply, rounded; the clamp, which keeps NaN.

This module imports triton at its top: callers import it only where CUDA (and with it triton) is present.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from exlnb.engines.dependent_launch import (
    INTERPRETED,
    dependent_launch,
    let_the_next_kernel_start,
    wait_for_the_kernel_before,
)

BLOCK = 1024  # elements per program: 11 programs for a 7B MLP's 11,008
FP16_MAX: tl.constexpr = tl.constexpr(65504.0)  # exllamav2 clamps the activation to fp16's range
# libdevice's expf, as torch's SiLU uses, where the kernel is compiled; Triton's interpreter has no libdevice
LIBDEVICE = not INTERPRETED


def silu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """clamp(silu(gate) * up, fp16's range) in fp16, to the bits of torch's three kernels. gate and up: fp16 of one
    shape, on the GPU (or CPU tensors in Triton's interpreter). Returns gate's shape."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    count = gate.numel()
    pdl = dependent_launch(gate.device)
    with torch.cuda.device(gate.device) if gate.is_cuda else contextlib.nullcontext():  # Triton's current device
        _silu_times[(triton.cdiv(count, BLOCK),)](
            gate, up, out, count, BLOCK=BLOCK, PRECISE=LIBDEVICE, PDL=pdl, launch_pdl=pdl != 0
        )
    return out


@triton.jit
def _silu_times(gate, up, out, COUNT, BLOCK: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr):
    wait_for_the_kernel_before(PDL)
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    real = index < COUNT
    g = tl.load(gate + index, mask=real, other=0.0).to(tl.float32)
    u = tl.load(up + index, mask=real, other=0.0).to(tl.float32)
    let_the_next_kernel_start(PDL)
    tl.store(out + index, silu_times_values(g, u, PRECISE), mask=real)


@triton.jit
def silu_times_values(g, u, PRECISE: tl.constexpr):
    """clamp(silu(g) * u) in fp16, rounded where torch's three kernels round, for float32 g and u that hold fp16
    values (also the epilogue of normed_gemv's gated product)."""
    if PRECISE:
        silu = tl.math.div_rn(g, 1.0 + libdevice.exp(-g))
    else:
        silu = g / (1.0 + tl.exp(-g))
    product = silu.to(tl.float16).to(tl.float32) * u
    result = tl.clamp(product.to(tl.float16).to(tl.float32), -FP16_MAX, FP16_MAX, propagate_nan=tl.PropagateNan.ALL)
    return result.to(tl.float16)
