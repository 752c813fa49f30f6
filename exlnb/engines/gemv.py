"""One row times an fp16 matrix in Triton: the batch-1 product of the projections cuBLAS reads slowest.

At one row cuBLAS splits a 7B layer's o and down products over their inputs (a split-K kernel and a reduce
kernel each) and reads their weights at 75 % of copy bandwidth on an H200; this kernel, one program per
BLOCK_N outputs reading whole rows of the output-major weight, at 89 % (32 layers of o and down replayed as one
graph: 1.246 ms against 1.051 ms, benchmarks/results/gemv-sweep-nvidia-h200-2026-11-28). The block sizes are the
fastest of the 26 configurations timed there. At eight rows cuBLAS is the faster, so only single rows come here.
The head takes it too: cuBLAS read a 7B head's 262 MB at 63 % in the same card's profile; with it, the step's 65
calls read 4.22 GB at 85 % (benchmarks/results/speed-nvidia-h200-2026-11-28-attention).

A gated MLP's tail can run in the same kernel (`gated_row_times_matrix_plus`): the SiLU of gate times up read as
the down product's input, and the residual added as its outputs are written. exllamav2 runs those as four kernels
of their own a layer around the product (SiLU, the multiply, a clamp, the add), each a launch of a step's graph;
in one step every launch costs its kernel's time and about 0.88 us more (docs/performance.md).

This module imports triton at its top: callers import it only where CUDA (and with it triton) is present.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

BLOCK_N = 16  # outputs per program: 256 programs for 4,096 outputs, about two per SM
BLOCK_K = 1024  # inputs per tile: a program reads 2 KiB of each of its weight rows at a time
WARPS, STAGES = 8, 3
FP16_MAX: tl.constexpr = tl.constexpr(65504.0)  # exllamav2 clamps the activation to fp16's range
# libdevice's expf, as torch's SiLU uses, where the kernel is compiled; Triton's interpreter has no libdevice (it
# reads TRITON_INTERPRET once, when the kernel is defined, and so does this)
LIBDEVICE = os.environ.get("TRITON_INTERPRET") != "1"


def row_times_matrix(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x @ weight.T for one row: x (..., in) holding a single row, weight (out, in), contiguous fp16 on the GPU;
    the sums are float32, written as out_dtype (fp16 or float32). Returns x's leading shape with out outputs."""
    return _launch(x, None, weight, None, out_dtype)


def gated_row_times_matrix_plus(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor
) -> torch.Tensor:
    """residual + clamp(silu(gate) * up) @ weight.T for one row, in fp16: a gated MLP's activation, down product
    and residual add, rounded to fp16 where torch's kernels round each step (after the SiLU, after the multiply,
    after the product, after the add), so the bits are theirs. gate and up (..., in) and residual (..., out) hold a
    single row each; weight is (out, in). Returns residual's shape."""
    return _launch(gate, up, weight, residual, torch.half)


def _launch(x, up, weight, residual, out_dtype: torch.dtype) -> torch.Tensor:
    outputs, inputs = weight.shape
    row = x.reshape(inputs).contiguous()
    gated, plus = up is not None, residual is not None
    out = torch.empty(outputs, dtype=out_dtype, device=x.device)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # Triton launches on the current one
        _row_times_matrix[(triton.cdiv(outputs, BLOCK_N),)](
            row,
            up.reshape(inputs).contiguous() if gated else row,
            weight,
            residual.reshape(outputs).contiguous() if plus else out,
            out,
            outputs,
            inputs,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
            GATED=gated,
            PLUS=plus,
            PRECISE=LIBDEVICE,
            num_warps=WARPS,
            num_stages=STAGES,
        )
    return out.view(*(residual if plus else x).shape[:-1], outputs)


@triton.jit
def _row_times_matrix(
    x,
    up,
    weight,
    residual,
    out,
    OUTPUTS,
    INPUTS,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATED: tl.constexpr,
    PLUS: tl.constexpr,
    PRECISE: tl.constexpr,
):
    output = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    real_output = output < OUTPUTS
    rows = weight + output[:, None].to(tl.int64) * INPUTS
    sums = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)  # summed across at the end: one reduction, not one a tile
    for first in range(0, INPUTS, BLOCK_K):
        column = first + tl.arange(0, BLOCK_K)
        real_column = column < INPUTS
        tile = tl.load(rows + column[None, :], mask=real_output[:, None] & real_column[None, :], other=0.0)
        values = tl.load(x + column, mask=real_column, other=0.0).to(tl.float32)
        if GATED:  # each program computes the activation it reads, in place of three launches (the speed suite's
            # kit-exllamav2-mlp-tail/-apart pair times whether that work hides behind the weight reads)
            # as torch: SiLU x / (1 + exp(-x)) in float32 with IEEE division, rounded; the multiply, rounded; the clamp
            if PRECISE:
                silu = tl.math.div_rn(values, 1.0 + libdevice.exp(-values))
            else:
                silu = values / (1.0 + tl.exp(-values))
            gated = silu.to(tl.float16).to(tl.float32) * tl.load(up + column, mask=real_column, other=0.0).to(
                tl.float32
            )
            values = tl.clamp(
                gated.to(tl.float16).to(tl.float32), -FP16_MAX, FP16_MAX, propagate_nan=tl.PropagateNan.ALL
            )
        sums += tile.to(tl.float32) * values[None, :]
    result = tl.sum(sums, 1).to(out.dtype.element_ty)
    if PLUS:  # torch's fp16 add: both in float32, the sum rounded
        result = (result.to(tl.float32) + tl.load(residual + output, mask=real_output).to(tl.float32)).to(
            out.dtype.element_ty
        )
    tl.store(out + output, result, mask=real_output)
