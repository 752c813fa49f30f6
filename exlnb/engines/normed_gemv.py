"""An RMS norm folded into the fused product after it, at one row, in one Triton kernel.

At one row the ExLlamaV2 engine runs each norm as a launch of its own (65 of a 7B step's 455 on an H200, 0.174 ms,
each costing its kernel's time and about 0.88 us more) and then the fused group after it, one cuBLAS batched
product (benchmarks/results/speed-nvidia-h200-2026-11-29-c). Here every program computes the row's RMS itself (the
row is 8 KiB, read from L2) and multiplies its block of outputs by the normed row as it reads the weights. The norm
is exllamav2's arithmetic (each input clamped to fp16's range, the mean of squares plus epsilon, its approximate
reciprocal square root, x times the weight times it, rounded to fp16) but not its order of summation, so the outputs
agree with the norm and product to the tolerance a graph's replay is held to, not to the bit.

`python -m benchmarks norm-product-sweep` times it against the norm and cuBLAS's product: over output-major weights
it beats them (CONFIG, the fastest of its configurations on both of a 7B layer's groups); over the input-major stack
the groups otherwise keep it loses (benchmarks/results/speed-nvidia-h200-2026-11-29-d), so the engine folds a norm
only into a group laid out output-major (engines/exllamav2/folded_norm.py).

This module imports triton at its top: callers import it only where CUDA (and with it triton) is present.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from exlnb.engines.gated_activation import LIBDEVICE, silu_times_values

# outputs a program, inputs a tile, warps, stages, over output-major weights: the sweep's fastest for q, k and v (0.839
# ms for 32 layers, against 0.973 for the norm and cuBLAS) and for gate and up (1.418 against 1.522), on an H200
CONFIG = (16, 256, 4, 4)
# the same for a gated MLP's gate and up with its activation in the epilogue (`normed_gated_row`): 8 outputs of each,
# so that a program reads CONFIG's 16 rows; to be chosen by the sweep's gated rows
GATED_CONFIG = (8, 256, 4, 4)
FP16_MAX: tl.constexpr = tl.constexpr(65504.0)  # exllamav2's norm clamps its inputs to fp16's range


def normed_row_times_stack(x: torch.Tensor, norm: torch.Tensor, eps: float, stack: torch.Tensor) -> torch.Tensor:
    """rmsnorm(x) @ stack[p] for each of a fused group's P products at one row: x holds a single row of K, norm
    its K weights, stack the group's (P, K, N) stack, a transposed view of contiguous output-major (P, N, K) weights
    (the layout CONFIG was timed on). Returns (P, N) fp16, the products in the stack's order, contiguous."""
    products, inputs, outputs = stack.shape
    rows = stack.transpose(1, 2)
    if not rows.is_contiguous():
        raise ValueError("normed_row_times_stack reads output-major weights: a (P, K, N) view of (P, N, K)")
    out = normed_product(x.reshape(-1), norm, rows.reshape(products * outputs, inputs), CONFIG, eps)
    return out.view(products, outputs)


def normed_gated_row(x: torch.Tensor, norm: torch.Tensor, eps: float, stack: torch.Tensor, slots, config=None):
    """clamp(silu(g) * u) for g, u = rmsnorm(x) @ gate, rmsnorm(x) @ up at one row, in one launch: each program
    reads its outputs' rows of gate and of up, rounds both sums to fp16 as the products write them, and computes the
    activation as `gated_activation.silu_times` does. stack: a gated MLP's (2, K, N) stack, a view of output-major
    weights; slots: gate's and up's places in it; config: GATED_CONFIG unless told. Returns N fp16 outputs."""
    block_n, block_k, warps, stages = config or GATED_CONFIG
    _, inputs, outputs = stack.shape
    rows = stack.transpose(1, 2)
    if not rows.is_contiguous():
        raise ValueError("normed_gated_row reads output-major weights: a (2, K, N) view of (2, N, K)")
    out = torch.empty(outputs, dtype=torch.half, device=x.device)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # Triton's current device
        _normed_gated_row[(triton.cdiv(outputs, block_n),)](
            x.reshape(-1), norm, rows[slots[0]], rows[slots[1]], out, eps, outputs, inputs,
            BLOCK_N=block_n, BLOCK_K=block_k, PRECISE=LIBDEVICE, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out


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
def _normed_tile(x, norm, k, real_k, scale):
    """The normed row at inputs k, as exllamav2's norm writes it (rounded to fp16), back in float32 for the sums."""
    values = tl.clamp(tl.load(x + k, mask=real_k, other=0.0).to(tl.float32), -FP16_MAX, FP16_MAX)
    normed = values * tl.load(norm + k, mask=real_k, other=0.0).to(tl.float32) * scale
    return normed.to(tl.float16).to(tl.float32)


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
        normed = _normed_tile(x, norm, k, real_k, scale)
        tile = tl.load(rows[:, None] + k[None, :] * stride_k, mask=real_n[:, None] & real_k[None, :], other=0.0)
        sums += tile.to(tl.float32) * normed[None, :]
    tl.store(out + n, tl.sum(sums, 1).to(out.dtype.element_ty), mask=real_n)


@triton.jit
def _normed_gated_row(
    x,
    norm,
    gate,
    up,
    out,
    eps,
    N,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISE: tl.constexpr,
):
    """out = silu_times(rmsnorm(x) @ gate.T, rmsnorm(x) @ up.T) for output-major (N, K) gate and up, each sum
    rounded to fp16 first, as the two products write them."""
    scale = _inverse_rms(x, K, eps, BLOCK_K)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    real_n = n < N
    gate_sums = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    up_sums = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for first in range(0, K, BLOCK_K):
        k = first + tl.arange(0, BLOCK_K)
        real_k = k < K
        normed = _normed_tile(x, norm, k, real_k, scale)
        where = n[:, None] * K + k[None, :]  # int32: a 7B MLP's 45 M weights a product fit
        both = real_n[:, None] & real_k[None, :]
        gate_sums += tl.load(gate + where, mask=both, other=0.0).to(tl.float32) * normed[None, :]
        up_sums += tl.load(up + where, mask=both, other=0.0).to(tl.float32) * normed[None, :]
    g = tl.sum(gate_sums, 1).to(tl.float16).to(tl.float32)
    u = tl.sum(up_sums, 1).to(tl.float16).to(tl.float32)
    tl.store(out + n, silu_times_values(g, u, PRECISE), mask=real_n)
