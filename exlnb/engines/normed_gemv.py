"""An RMS norm folded into the fused product after it, at one row, in one Triton kernel.

At one row the ExLlamaV2 engine runs each norm as a launch of its own (65 of a 7B step's 455 on an H200, 0.174 ms,
each costing its kernel's time and about 0.88 us more) and then the fused group after it, one cuBLAS batched
product over the group's input-major stack (benchmarks/results/speed-nvidia-h200-2026-11-29-c). Here every program
computes the row's RMS itself (the row is 8 KiB, read from L2) and multiplies its block of outputs by the normed
row as it reads the stack as it lies: no launch for the norm and no weight laid out again. The norm is exllamav2's
arithmetic (each input clamped to fp16's range, the mean of squares plus epsilon, its approximate reciprocal square
root, x times the weight times it, rounded to fp16) but not its order of summation, so the outputs agree with the
norm and product to the tolerance a graph's replay is held to, not to the bit. `python -m benchmarks
norm-product-sweep` times it against the norm and cuBLAS's product.

This module imports triton at its top: callers import it only where CUDA (and with it triton) is present.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

# outputs a program (within one product), inputs a tile, warps, stages: not yet timed in an engine (the sweep's)
CONFIG = (64, 64, 4, 3)
FP16_MAX: tl.constexpr = tl.constexpr(65504.0)  # exllamav2's norm clamps its inputs to fp16's range


def normed_row_times_stack(x: torch.Tensor, norm: torch.Tensor, eps: float, stack: torch.Tensor) -> torch.Tensor:
    """rmsnorm(x) @ stack[p] for each of a fused group's P products at one row: x holds a single row of K, norm
    its K weights, stack the group's (P, K, N) input-major weights. Returns (P, N) fp16, the products in the
    stack's order, contiguous."""
    products, _, outputs = stack.shape
    return normed_product(x.reshape(-1), norm, stack, CONFIG, eps).view(products, outputs)


def normed_product(x: torch.Tensor, norm: torch.Tensor, weight: torch.Tensor, config: tuple, eps: float):
    """rmsnorm(x) times a fused group's products at one row, in one launch, their outputs one after the other:
    weight the output-major (PN, K) matrix or the group's input-major (P, K, N) stack; config is (outputs a program,
    inputs a tile, warps, stages), a program's outputs within one product. Returns PN fp16 outputs."""
    block_n, block_k, warps, stages = config
    if weight.dim() == 3:  # (P, K, N), input-major
        slices, inputs, outputs = weight.shape
        slice_stride, stride_k, stride_n = weight.stride()
    else:  # (PN, K), output-major: one slice of all its rows
        (outputs, inputs), slices = weight.shape, 1
        (stride_n, stride_k), slice_stride = weight.stride(), 0
    out = torch.empty(slices * outputs, dtype=torch.half, device=x.device)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # Triton's current device
        _normed_row_times_matrix[(triton.cdiv(slices * outputs, block_n),)](
            x, norm, weight, out, eps, slices * outputs, inputs, outputs, slice_stride, stride_n, stride_k,
            BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out


@triton.jit
def _inverse_rms(x, K: tl.constexpr, eps, BLOCK_K: tl.constexpr):
    """exllamav2's rsqrt(mean(x * x) + eps) over the row, each input clamped to fp16's range, in float32."""
    squares = tl.zeros((BLOCK_K,), tl.float32)
    for first in range(0, K, BLOCK_K):
        k = first + tl.arange(0, BLOCK_K)
        values = tl.clamp(tl.load(x + k, mask=k < K, other=0.0).to(tl.float32), -FP16_MAX, FP16_MAX)
        squares += values * values
    return tl.math.rsqrt(tl.sum(squares, 0) * (1.0 / K) + eps)


@triton.jit
def _normed_row_times_matrix(
    x,
    norm,
    w,
    out,
    eps,
    N,
    K: tl.constexpr,
    SLICE: tl.constexpr,
    slice_stride,
    stride_n,
    stride_k,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out = rmsnorm(x) @ W for W's element (k, n) at w + (n // SLICE) * slice_stride + (n % SLICE) * stride_n
    + k * stride_k: SLICE outputs a product, so a group's products read as they lie, output-major (stride_k 1) or
    as the fused group's input-major stack (stride_n 1), which Triton, specialising a stride of 1, reads along its
    contiguous side. The normed row is rounded to fp16, as the norm's kernel writes it."""
    scale = _inverse_rms(x, K, eps, BLOCK_K)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    real_n = n < N
    rows = w + (n // SLICE) * slice_stride + (n % SLICE) * stride_n  # int32: a 7B layer's 50 M weights fit
    sums = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for first in range(0, K, BLOCK_K):
        k = first + tl.arange(0, BLOCK_K)
        real_k = k < K
        values = tl.clamp(tl.load(x + k, mask=real_k, other=0.0).to(tl.float32), -FP16_MAX, FP16_MAX)
        normed = (values * tl.load(norm + k, mask=real_k, other=0.0).to(tl.float32) * scale).to(tl.float16)
        tile = tl.load(rows[:, None] + k[None, :] * stride_k, mask=real_n[:, None] & real_k[None, :])
        sums += tile.to(tl.float32) * normed.to(tl.float32)[None, :]
    tl.store(out + n, tl.sum(sums, 1).to(out.dtype.element_ty), mask=real_n)
