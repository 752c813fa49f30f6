"""One row times an fp16 matrix in Triton: the batch-1 product of the projections cuBLAS reads slowest.

At one row cuBLAS splits a 7B layer's o and down products over their inputs (a split-K kernel and a reduce
kernel each) and reads their weights at 75 % of copy bandwidth on an H200; this kernel, one program per
BLOCK_N outputs reading whole rows of the output-major weight, at 89 % (32 layers of o and down replayed as one
graph: 1.246 ms against 1.051 ms, benchmarks/results/gemv-sweep-nvidia-h200-2026-11-28). The block sizes are the
fastest of the 26 configurations timed there. At eight rows cuBLAS is the faster, so only single rows come here.
The head takes it too: cuBLAS read a 7B head's 262 MB at 63 % in the same card's profile; with it, the step's 65
calls read 4.22 GB at 85 % (benchmarks/results/speed-nvidia-h200-2026-11-28-attention).

A residual can be added as the outputs are written (`row_times_matrix_plus`), where exllamav2 adds it in a kernel of
its own after the product: in a step's graph every launch costs its kernel's time and about 0.88 us more
(docs/performance.md).

This module imports triton at its top: callers import it only where CUDA (and with it triton) is present.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from exlnb.engines.dependent_launch import dependent_launch, let_the_next_kernel_start, wait_for_the_kernel_before

BLOCK_N = 16  # outputs per program: 256 programs for 4,096 outputs, about two per SM
BLOCK_K = 1024  # inputs per tile: a program reads 2 KiB of each of its weight rows at a time
WARPS, STAGES = 8, 3


def row_times_matrix(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x @ weight.T for one row: x (..., in) holding a single row, weight (out, in), contiguous fp16 on the GPU;
    the sums are float32, written as out_dtype (fp16 or float32). Returns x's leading shape with out outputs."""
    return _launch(x, weight, None, out_dtype)


def row_times_matrix_plus(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + x @ weight.T for one row, in fp16: the product rounded to fp16, then the residual added as torch
    adds two fp16 tensors (in float32, the sum rounded), so the bits are those of the product and a separate add.
    x (..., in) and residual (..., out) hold a single row each; weight is (out, in). Returns residual's shape."""
    return _launch(x, weight, residual, torch.half)


def _launch(x, weight, residual, out_dtype: torch.dtype) -> torch.Tensor:
    outputs, inputs = weight.shape
    row = x.reshape(inputs).contiguous()
    plus = residual is not None
    out = torch.empty(outputs, dtype=out_dtype, device=x.device)
    pdl = dependent_launch(x.device)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # Triton launches on the current one
        _row_times_matrix[(triton.cdiv(outputs, BLOCK_N),)](
            row,
            weight,
            residual.reshape(outputs).contiguous() if plus else out,  # never read without PLUS
            out,
            outputs,
            inputs,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
            PLUS=plus,
            PDL=pdl,
            num_warps=WARPS,
            num_stages=STAGES,
            launch_pdl=pdl != 0,
        )
    return out.view(*(residual if plus else x).shape[:-1], outputs)


@triton.jit
def _row_times_matrix(
    x,
    weight,
    residual,
    out,
    OUTPUTS,
    INPUTS,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PLUS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_the_kernel_before(PDL)
    output = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    real_output = output < OUTPUTS
    rows = weight + output[:, None].to(tl.int64) * INPUTS
    sums = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)  # summed across at the end: one reduction, not one a tile
    for first in range(0, INPUTS, BLOCK_K):
        column = first + tl.arange(0, BLOCK_K)
        real_column = column < INPUTS
        tile = tl.load(rows + column[None, :], mask=real_output[:, None] & real_column[None, :], other=0.0)
        values = tl.load(x + column, mask=real_column, other=0.0)
        sums += tile.to(tl.float32) * values.to(tl.float32)[None, :]
    let_the_next_kernel_start(PDL)
    result = tl.sum(sums, 1).to(out.dtype.element_ty)
    if PLUS:  # torch's fp16 add: both in float32, the sum rounded
        result = (result.to(tl.float32) + tl.load(residual + output, mask=real_output).to(tl.float32)).to(
            out.dtype.element_ty
        )
    tl.store(out + output, result, mask=real_output)
