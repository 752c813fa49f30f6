"""An RMS norm folded into the fused product after it, at one row, in one Triton kernel.

At one row the ExLlamaV2 engine runs each norm as a launch of its own (65 of a 7B step's 455 on an H200, 0.174 ms,
each costing its kernel's time and about 0.88 us more) and then the fused group after it, one cuBLAS batched
product (benchmarks/results/speed-nvidia-h200-2026-11-29-c). Here every program computes the row's RMS itself (the
row is 8 KiB, read from L2) and multiplies its block of outputs by the normed row as it reads the weights. The norm
is exllamav2's arithmetic (each input clamped to fp16's range, the mean of squares plus epsilon, its approximate
reciprocal square root) but not its order of summation, so the outputs agree with the norm and product to the
tolerance a graph's replay is held to, not to the bit. A configuration's last field says how the row is read: in
one pass (True), beside the weights, each product summing x times the norm's weight and scaling its sums by the
inverse RMS at the end; or in two (False), the RMS first, each program then reading the row normed and rounded to
fp16 as exllamav2's norm writes it. Two passes put a serial read of the row before the first weight; the sweep times
both.

`python -m benchmarks norm-product-sweep` times it against the norm and cuBLAS's product: over output-major weights
it beats them (CONFIG, the fastest of its configurations on both of a 7B layer's groups); over the input-major stack
the groups otherwise keep it loses (benchmarks/results/speed-nvidia-h200-2026-11-29-d), so the engine folds a norm
only into a group laid out output-major (engines/exllamav2/folded_norm.py). Two epilogues ride on the same reading,
each program then summing two sets of rows (`_paired_sums`): a gated MLP's activation from gate and up
(`normed_gated_row`), and NEOX RoPE on q and k from a head's two halves (`normed_roped_rows`).

This module imports triton at its top: callers import it only where CUDA (and with it triton) is present.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from exlnb.engines.dependent_launch import dependent_launch, let_the_next_kernel_start, wait_for_the_kernel_before
from exlnb.engines.gated_activation import LIBDEVICE, silu_times_values

# outputs a program, inputs a tile, warps, stages, over output-major weights, the row in one pass: the sweep's fastest
# for q, k and v (0.842 ms for 32 layers, against 0.960 for the norm and exlnb's GEMV and 0.979 for the norm and
# cuBLAS) and for gate and up (1.428 against 1.545 for the norm and cuBLAS), on an H200
# (benchmarks/results/speed-nvidia-h200-2026-11-29-f)
CONFIG = (8, 1024, 4, 3, True)
# the same for a gated MLP's gate and up with its activation in the epilogue (`normed_gated_row`): 2 outputs of each
# a program, 1,024 inputs a tile, 3 stages, the fastest of the sweep's nine gated rows (32 layers: 1.511 ms, against
# 1.626 at 4 and 512, 1.682 for the norm, cuBLAS and the activation apart, and 1.415 for the plain kernel without the
# activation; benchmarks/results/speed-nvidia-h200-2026-11-29-g); it runs only with the MLP's fold, off by default
GATED_CONFIG = (2, 1024, 4, 3, True)
# and for q, k and v with RoPE in the epilogue (`normed_roped_rows`): 8 rows of a head's first half and their 8
# partners a program, the fastest of the sweep's roped rows in two starts (0.924 ms against 0.943 at 4 and 1,024 and
# 0.828 for the plain kernel without the RoPE), and faster in the step than 4 and 1,024 or 2,048 (0.013 and 0.044
# ms a token; speed-nvidia-h200-2026-11-29-g)
ROPED_CONFIG = (8, 256, 4, 4, True)
# each paired kernel's shape in the step where its variable is set, so the speed suite can time a sweep's shape
# against the configuration in turns
GATED_TILES, ROPED_TILES = "EXLNB_GATED_TILES", "EXLNB_ROPED_TILES"
FP16_MAX: tl.constexpr = tl.constexpr(65504.0)  # exllamav2's norm clamps its inputs to fp16's range


def paired_config(variable: str, default: tuple) -> tuple:
    """A paired kernel's configuration: its `variable` (GATED_TILES, ROPED_TILES) where it is set ("B,K,W,S":
    outputs of each set a program, inputs a tile, warps, stages, powers of two but the stages, 1 to 6; the row read
    in one pass), read at each launch, so set it before a model loads (its graphs keep what they captured); else
    `default`."""
    value = os.environ.get(variable)
    if not value:
        return default
    try:
        block_n, block_k, warps, stages = (int(part) for part in value.split(","))
    except ValueError:
        block_n = block_k = warps = stages = 0
    powers = all(n > 0 and n & (n - 1) == 0 for n in (block_n, block_k, warps))
    if not (powers and block_n <= 64 and 16 <= block_k <= 4096 and warps <= 16 and 1 <= stages <= 6):
        raise ValueError(
            f"{variable}={value!r}: B,K,W,S (outputs a program up to 64, inputs a tile 16 to 4,096, warps up to "
            "16, each a power of two; stages 1 to 6)"
        )
    return block_n, block_k, warps, stages, True


def output_major_rows(stack: torch.Tensor, caller: str) -> torch.Tensor:
    """A group's (P, K, N) stack as the contiguous (P, N, K) output-major weights it is a view of (the layout the
    configurations were timed on); any other stack refused in a line."""
    rows = stack.transpose(1, 2)
    if not rows.is_contiguous():
        raise ValueError(f"{caller} reads output-major weights: a (P, K, N) view of (P, N, K)")
    return rows


def normed_row_times_stack(x: torch.Tensor, norm: torch.Tensor, eps: float, stack: torch.Tensor) -> torch.Tensor:
    """rmsnorm(x) @ stack[p] for each of a fused group's P products at one row: x holds a single row of K, norm
    its K weights, stack the group's (P, K, N) stack, a transposed view of contiguous output-major (P, N, K) weights
    (the layout CONFIG was timed on). Returns (P, N) fp16, the products in the stack's order, contiguous."""
    products, inputs, outputs = stack.shape
    rows = output_major_rows(stack, "normed_row_times_stack")
    out = normed_product(x.reshape(-1), norm, rows.reshape(products * outputs, inputs), CONFIG, eps)
    return out.view(products, outputs)


def normed_roped_rows(x, norm, eps: float, stack, rotated, sin, cos, positions, config=None) -> torch.Tensor:
    """normed_row_times_stack with exllamav2's NEOX RoPE applied as the sums are written to the products in
    `rotated` (their places in the stack: q's and k's), at the position `positions[0]` holds on the device, as
    `ext_c.rope_` computes it (fp16: the rotated half times -sin rounded, then fused with x times cos): one launch
    for an attention's norm, q, k and v and RoPE. Each program reads a block of rows of a head's first half (8 in
    ROPED_CONFIG) and the rows of its second half they pair with. sin, cos: (..., positions, head_dim) fp16 tables,
    head_dim dividing N. Returns (P, N) fp16, contiguous."""
    block_n, block_k, warps, stages, one_pass = config or paired_config(ROPED_TILES, ROPED_CONFIG)
    products, inputs, outputs = stack.shape
    rows = output_major_rows(stack, "normed_roped_rows")
    head_dim = sin.shape[-1]
    if outputs % head_dim or head_dim % 2 or cos.shape[-1] != head_dim or products > 3:
        raise ValueError(f"normed_roped_rows: {products} products of {outputs}, heads of {head_dim}: not q, k and v")
    rotates = [slot in rotated for slot in range(3)]  # the kernel's ROTATE_0..2
    out = torch.empty(products, outputs, dtype=torch.half, device=x.device)
    programs = products * (outputs // head_dim) * triton.cdiv(head_dim // 2, block_n)
    pdl = dependent_launch(x.device)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # Triton's current device
        _normed_roped_rows[(programs,)](
            x.reshape(-1), norm, rows, out, sin, cos, positions, eps, outputs, inputs, *rotates,
            HEAD_DIM=head_dim, BLOCK_N=block_n, BLOCK_K=block_k, ONE_PASS=one_pass, PDL=pdl, num_warps=warps,
            num_stages=stages, launch_pdl=pdl != 0,
        )  # fmt: skip
    return out


def normed_gated_row(x: torch.Tensor, norm: torch.Tensor, eps: float, stack: torch.Tensor, slots, config=None):
    """clamp(silu(g) * u) for g, u = rmsnorm(x) @ gate, rmsnorm(x) @ up at one row, in one launch: each program
    reads its outputs' rows of gate and of up, rounds both sums to fp16 as the products write them, and computes the
    activation as `gated_activation.silu_times` does. stack: a gated MLP's (2, K, N) stack, a view of output-major
    weights; slots: gate's and up's places in it; config: GATED_CONFIG unless told. Returns N fp16 outputs."""
    block_n, block_k, warps, stages, one_pass = config or paired_config(GATED_TILES, GATED_CONFIG)
    _, inputs, outputs = stack.shape
    rows = output_major_rows(stack, "normed_gated_row")
    out = torch.empty(outputs, dtype=torch.half, device=x.device)
    pdl = dependent_launch(x.device)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # Triton's current device
        _normed_gated_row[(triton.cdiv(outputs, block_n),)](
            x.reshape(-1), norm, rows[slots[0]], rows[slots[1]], out, eps, outputs, inputs,
            BLOCK_N=block_n, BLOCK_K=block_k, ONE_PASS=one_pass, PRECISE=LIBDEVICE, PDL=pdl, num_warps=warps,
            num_stages=stages, launch_pdl=pdl != 0,
        )  # fmt: skip
    return out


def normed_product(x: torch.Tensor, norm: torch.Tensor, weight: torch.Tensor, config: tuple, eps: float):
    """rmsnorm(x) times a fused group's products at one row, in one launch, their outputs one after the other:
    weight the output-major (PN, K) matrix or the group's input-major (P, K, N) stack; config is (outputs a program,
    inputs a tile, warps, stages, the row in one pass), a program's outputs within one product. Returns PN fp16
    outputs."""
    block_n, block_k, warps, stages, one_pass = config
    if weight.dim() == 3:  # (P, K, N), input-major
        slices, inputs, outputs = weight.shape
        slice_stride, stride_k, stride_n = weight.stride()
    else:  # (PN, K), output-major: one slice of all its rows
        (outputs, inputs), slices = weight.shape, 1
        (stride_n, stride_k), slice_stride = weight.stride(), 0
    out = torch.empty(slices * outputs, dtype=torch.half, device=x.device)
    pdl = dependent_launch(x.device)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # Triton's current device
        _normed_row_times_matrix[(triton.cdiv(slices * outputs, block_n),)](
            x, norm, weight, out, eps, slices * outputs, inputs, outputs, slice_stride, stride_n, stride_k,
            BLOCK_N=block_n, BLOCK_K=block_k, ONE_PASS=one_pass, PDL=pdl, num_warps=warps, num_stages=stages,
            launch_pdl=pdl != 0,
        )  # fmt: skip
    return out


@triton.jit
def _inverse_rms(squares, K: tl.constexpr, eps):
    """exllamav2's rsqrt(mean(x * x) + eps) from a tile's worth of the row's squares summed, in float32."""
    return tl.math.rsqrt(tl.sum(squares, 0) * (1.0 / K) + eps)


@triton.jit
def _row_scale(x, K: tl.constexpr, eps, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr):
    """What each tile of the row is multiplied by as it is read: 1 in one pass (its sums are scaled at the end),
    else the inverse RMS from a first pass over the row."""
    scale = 1.0
    if not ONE_PASS:
        squares = tl.zeros((BLOCK_K,), tl.float32)
        for first in range(0, K, BLOCK_K):
            k = first + tl.arange(0, BLOCK_K)
            values = tl.clamp(tl.load(x + k, mask=k < K, other=0.0).to(tl.float32), -FP16_MAX, FP16_MAX)
            squares += values * values
        scale = _inverse_rms(squares, K, eps)
    return scale


@triton.jit
def _normed_tile(x, norm, k, real_k, scale, ONE_PASS: tl.constexpr):
    """The row at inputs k clamped to fp16's range (whose squares give the RMS), and the row the products read
    there, in float32: x times the norm's weight times `scale`, rounded to fp16 as exllamav2's norm writes it where
    the scale is the inverse RMS (two passes), left unrounded where the sums are scaled at the end (one pass)."""
    values = tl.clamp(tl.load(x + k, mask=real_k, other=0.0).to(tl.float32), -FP16_MAX, FP16_MAX)
    normed = values * tl.load(norm + k, mask=real_k, other=0.0).to(tl.float32) * scale
    if not ONE_PASS:
        normed = normed.to(tl.float16).to(tl.float32)
    return values, normed


@triton.jit
def _end_scale(squares, K: tl.constexpr, eps, ONE_PASS: tl.constexpr):
    """What a program's reduced sums are multiplied by: the inverse RMS of the row's squares where the row was read
    in one pass, else 1 (`_row_scale` scaled it as it was read)."""
    scale = 1.0
    if ONE_PASS:
        scale = _inverse_rms(squares, K, eps)
    return scale


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
    ONE_PASS: tl.constexpr,
    PDL: tl.constexpr,
):
    """out = rmsnorm(x) @ W for W's element (k, n) at w + (n // SLICE) * slice_stride + (n % SLICE) * stride_n
    + k * stride_k: SLICE outputs a product, so a group's products read as they lie, output-major (stride_k 1) or
    as the fused group's input-major stack (stride_n 1), which Triton, specialising a stride of 1, reads along its
    contiguous side. The row read in one pass or two (`_normed_tile`)."""
    wait_for_the_kernel_before(PDL)
    scale = _row_scale(x, K, eps, BLOCK_K, ONE_PASS)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    real_n = n < N
    rows = w + (n // SLICE) * slice_stride + (n % SLICE) * stride_n  # int32: a 7B layer's 50 M weights fit
    sums = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    squares = tl.zeros((BLOCK_K,), tl.float32)
    for first in range(0, K, BLOCK_K):
        k = first + tl.arange(0, BLOCK_K)
        real_k = k < K
        values, normed = _normed_tile(x, norm, k, real_k, scale, ONE_PASS)
        squares += values * values  # read only in one pass
        tile = tl.load(rows[:, None] + k[None, :] * stride_k, mask=real_n[:, None] & real_k[None, :], other=0.0)
        sums += tile.to(tl.float32) * normed[None, :]
    let_the_next_kernel_start(PDL)
    result = tl.sum(sums, 1) * _end_scale(squares, K, eps, ONE_PASS)
    tl.store(out + n, result.to(out.dtype.element_ty), mask=real_n)


@triton.jit
def _paired_sums(
    x, norm, first, second, real, eps, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ONE_PASS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """rmsnorm(x) times two sets of BLOCK_N output-major rows (`first`, `second`: each row's first weight), each
    sum rounded to fp16 as a product writes it, in float32; the row read in one pass or two (`_normed_tile`)."""
    scale = _row_scale(x, K, eps, BLOCK_K, ONE_PASS)
    first_sums = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    second_sums = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    squares = tl.zeros((BLOCK_K,), tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        real_k = k < K
        values, normed = _normed_tile(x, norm, k, real_k, scale, ONE_PASS)
        squares += values * values  # read only in one pass
        both = real[:, None] & real_k[None, :]
        first_sums += tl.load(first[:, None] + k[None, :], mask=both, other=0.0).to(tl.float32) * normed[None, :]
        second_sums += tl.load(second[:, None] + k[None, :], mask=both, other=0.0).to(tl.float32) * normed[None, :]
    let_the_next_kernel_start(PDL)
    end = _end_scale(squares, K, eps, ONE_PASS)  # one reduction of the squares for both sets
    first_row, second_row = tl.sum(first_sums, 1) * end, tl.sum(second_sums, 1) * end
    return first_row.to(tl.float16).to(tl.float32), second_row.to(tl.float16).to(tl.float32)


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
    ONE_PASS: tl.constexpr,
    PRECISE: tl.constexpr,
    PDL: tl.constexpr,
):
    """out = silu_times(rmsnorm(x) @ gate.T, rmsnorm(x) @ up.T) for output-major (N, K) gate and up, each sum
    rounded to fp16 first, as the two products write them."""
    wait_for_the_kernel_before(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    real_n = n < N
    first, second = gate + n * K, up + n * K  # int32: fits
    g, u = _paired_sums(x, norm, first, second, real_n, eps, K, BLOCK_N, BLOCK_K, ONE_PASS, PDL)
    tl.store(out + n, silu_times_values(g, u, PRECISE), mask=real_n)


@triton.jit
def _normed_roped_rows(
    x,
    norm,
    w,
    out,
    sin,
    cos,
    positions,
    eps,
    N,
    K: tl.constexpr,
    ROTATE_0,
    ROTATE_1,
    ROTATE_2,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_PASS: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[p] = rmsnorm(x) @ w[p].T for output-major (P, N, K) w, each program BLOCK_N rows of one head's first
    half and the rows of its second half they pair with; where product p rotates (ROTATE_p), NEOX RoPE at
    positions[0] as exllamav2's rope.cu computes it in fp16: l' = fma(l, cos, round(r * -sin)), r' = fma(r, cos,
    round(l * sin)), with the first half's sin and cos for both."""
    wait_for_the_kernel_before(PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    BLOCKS_A_HALF: tl.constexpr = (HALF + BLOCK_N - 1) // BLOCK_N
    program = tl.program_id(0)
    blocks_a_product = N // HEAD_DIM * BLOCKS_A_HALF
    product = program // blocks_a_product
    head = program % blocks_a_product // BLOCKS_A_HALF
    column = program % BLOCKS_A_HALF * BLOCK_N + tl.arange(0, BLOCK_N)  # within the head's first half
    real = column < HALF
    first = product * N + head * HEAD_DIM + column  # a row of (P * N, K); its partner HALF rows on
    rows, partners = w + first * K, w + (first + HALF) * K
    left, right = _paired_sums(x, norm, rows, partners, real, eps, K, BLOCK_N, BLOCK_K, ONE_PASS, PDL)
    rotates = ((product == 0) & ROTATE_0) | ((product == 1) & ROTATE_1) | ((product == 2) & ROTATE_2)
    if rotates:
        at = tl.load(positions).to(tl.int64) * HEAD_DIM + column
        c = tl.load(cos + at, mask=real, other=0.0).to(tl.float32)
        s = tl.load(sin + at, mask=real, other=0.0).to(tl.float32)
        rotated_left = left * c + (right * -s).to(tl.float16).to(tl.float32)
        right = right * c + (left * s).to(tl.float16).to(tl.float32)
        left = rotated_left
    tl.store(out + first, left.to(tl.float16), mask=real)
    tl.store(out + first + HALF, right.to(tl.float16), mask=real)
