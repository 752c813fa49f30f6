"""Paged attention for decode steps in Triton: keys and values read in place, through the block table.

The PyTorch path (paged_attention.py) gathers every page of every sequence per layer before it attends, so its
cost grows with the context: on an H100 a 7B-shaped fp16 model decoded at 8.5 ms/token with 256 tokens of context
and 19.1 at 4096, where reading the keys and values once costs about 0.7 ms a token. Here, flash-decoding:

- `_attention_split_kernel`: one program per (sequence, key/value head, block of query rows, split of SPLIT_KEYS
  keys). Its rows are the (query position, query head) pairs that read that key/value head, so grouped heads
  share each key tile. It walks its keys a tile at a time with an online softmax in float32, and leaves each row's
  unnormalised sum of values, running maximum and denominator. A tile never leaves its page, so its page number
  is one load (it was one a key: 5 % of the kernel's time at 4,096 tokens on an H200, the same bits). The call's
  new keys and values are read from the call itself, and the first program of each (sequence, key/value head)
  writes them into their pages: no program reads a slot another is writing, and a step needs no kernels of its
  own for the writes (two a layer, 64 of a 7B step's 594 on the ExLlamaV2 engine, H200 profile of 2026-11-28).
  Only the tiles that can hold the call's keys read them (`fresh_tile_apart`; `EXLNB_DECODE_FRESH_APART=0`: all).
- `_attention_combine_kernel`: one program per (sequence, query position, head) brings the splits to one maximum,
  sums them and writes the output in the query's dtype. With a single split the first kernel writes it directly.

The split count follows from the block table's width alone, so the grid and the partial buffers are fixed by
static shapes and the launch can be captured in a CUDA graph (nothing reads `cache_seqlens` on the host); a
split past a sequence's end does nothing. A split's keys depend on neither the batch nor the table's width, so a
sequence's output is the same to the bit alone or in a batch, and at any width the graph decoder pads to
(field report 2: a greedy answer must not change with its batch mates).

The structure follows exllamav3 1.6.5's MIT-licensed `paged_attn_triton_decode`
(exllamav3/modules/attention_fn/triton_paged.py); exllamav3 sizes its splits to the GPU and the batch instead.
This module imports triton at its top: paged_attention imports it on first use, only where triton is installed.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from exlnb.engines.dependent_launch import dependent_launch, let_the_next_kernel_start, wait_for_the_kernel_before

MAX_QUERIES = 16  # query positions per sequence a call may have: decode has 1
MAX_HEAD_DIM = 256  # a row block's float32 accumulator (rows x head dim) lives in registers
SPLIT_KEYS = 256  # keys per split: 16 splits at 4096 tokens keep an H100's 132 SMs busy at batch 1
BLOCK_KEYS = 64  # keys per tile within a split, and a divisor of both SPLIT_KEYS and the page size
MIN_ROWS, MAX_ROWS = 16, 64  # query rows per program: tl.dot needs 16; more share a key tile but hold more registers
COMBINE_SPLITS = 16  # splits the combine kernel reads at once
FRESH_APART = True  # the call's new keys read in their own tiles alone (fresh_tile_apart)
# warps a split's program (split_warps): with the new keys apart, 8 were faster than 4 at 256, 1,024 and 4,096 tokens,
# for 32 and for 8 key/value heads (0.366 against 0.432 ms and 0.911 against 0.963 for a 7B step's 32 layers at 256
# and 4,096; `gemv-sweep --only attention`, benchmarks/results/speed-nvidia-h200-2026-11-29-e)
SPLIT_WARPS = 8


def split_keys() -> int:
    """Keys per split: `EXLNB_DECODE_SPLIT_KEYS` where it is set (a multiple of BLOCK_KEYS; read at each launch, so
    a captured graph keeps what it saw: set it before a model loads, since graphs captured before a change would
    split otherwise than eager steps after it), else SPLIT_KEYS. Fewer, longer splits read more keys a program and
    leave fewer partial sums to combine; the speed suite times 512 against 256 in turns (kit-ENGINE-split512 and
    kit-ENGINE-split256)."""
    value = os.environ.get("EXLNB_DECODE_SPLIT_KEYS")
    if value is None:
        return SPLIT_KEYS
    if not value.isdigit() or int(value) == 0 or int(value) % BLOCK_KEYS:
        raise ValueError(
            f"EXLNB_DECODE_SPLIT_KEYS={value!r}: keys per split must be a positive multiple of {BLOCK_KEYS}"
        )
    return int(value)


def split_warps() -> int:
    """Warps a split's program: `EXLNB_DECODE_SPLIT_WARPS` where it is set (1, 2, 4, 8 or 16; read at each launch,
    so set it before a model loads), else SPLIT_WARPS. The speed suite times 8 against 4 in the step, in turns
    (kit-ENGINE-warps8 and kit-ENGINE-warps4)."""
    value = os.environ.get("EXLNB_DECODE_SPLIT_WARPS")
    if value is None:
        return SPLIT_WARPS
    if value not in ("1", "2", "4", "8", "16"):
        raise ValueError(f"EXLNB_DECODE_SPLIT_WARPS={value!r}: warps a program must be 1, 2, 4, 8 or 16")
    return int(value)


def fresh_tile_apart() -> bool:
    """Whether a split's key loop reads the call's new keys in the tiles that can hold them alone
    (`EXLNB_DECODE_FRESH_APART`, 1 or 0, read at each launch), else FRESH_APART. In one loop every tile also loads
    a tile of the call's keys and one of its values, masked off in all but the last; compiled for sm_90, Triton's
    pipeliner stages those in shared memory too, doubling a stage's shared memory and its copies (88 KB against 39 a
    program at 64 keys a tile). The same arithmetic, tile by tile: the same bits. Apart, a 7B step at 4,096 tokens
    took 0.24 ms less on both GPU engines, level at 256, timed in turns on an H200, and both GPU suites passed with
    it but for a test that failed without it too, at a near tie (benchmarks/results/speed-nvidia-h200-2026-11-29-e)."""
    value = os.environ.get("EXLNB_DECODE_FRESH_APART")
    return FRESH_APART if value is None else value == "1"


def handles(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether these kernels take a call of flash_attn_with_kvcache's shapes: decode-sized queries, fp16
    throughout (exllamav2's only activation dtype), pages of whole key tiles (both libraries' pages hold 256
    tokens), contiguous caches. The device is the caller's to check."""
    return (
        q.shape[1] <= MAX_QUERIES
        and q.shape[-1] <= MAX_HEAD_DIM
        and q.dtype == k_cache.dtype == v_cache.dtype == torch.float16
        and k_cache.shape[1] % BLOCK_KEYS == 0  # a key tile lies within one page
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    new_keys: torch.Tensor | None,
    new_values: torch.Tensor | None,
    scale: float,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
) -> torch.Tensor:
    """flash_attn_with_kvcache's attention, the new keys and values written into the cache by the same kernel.
    q: (batch, q_len, heads, dim); caches: (pages, page_size, kv_heads, dim); new_keys, new_values: (batch, q_len,
    kv_heads, dim) or None where the keys are in the cache already. Sequence b's keys are its first
    cache_seqlens[b] positions on pages block_table[b], then the new ones; its queries are the last q_len of them.
    Returns q's shape and dtype."""
    batch, q_len, heads, dim = q.shape
    appends = new_keys is not None
    new_keys = new_keys.contiguous() if appends else k_cache  # a pointer the kernel never reads without APPENDS
    new_values = new_values.contiguous() if appends else v_cache
    _, page_size, kv_heads, _ = k_cache.shape
    group_rows = q_len * (heads // kv_heads)  # query rows that read one key/value head
    rows = min(MAX_ROWS, max(MIN_ROWS, triton.next_power_of_2(group_rows)))
    keys_a_split = split_keys()
    splits = triton.cdiv(block_table.shape[1] * page_size, keys_a_split)
    dim_pad = max(16, triton.next_power_of_2(dim))
    q = q.contiguous()
    out = torch.empty_like(q)
    partial_sums = torch.empty((batch, q_len, heads, splits, dim_pad), dtype=torch.float32, device=q.device)
    partial_stats = torch.empty((batch, q_len, heads, splits, 2), dtype=torch.float32, device=q.device)
    left, right = window_size
    pdl = dependent_launch(q.device)
    # Triton launches on the current device: a model split over GPUs calls with each layer's own
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _attention_split_kernel[(batch * kv_heads * triton.cdiv(group_rows, rows), splits)](
            q,
            k_cache,
            v_cache,
            new_keys,
            new_values,
            cache_seqlens,
            block_table,
            out,
            partial_sums,
            partial_stats,
            block_table.stride(0),
            block_table.stride(1),
            scale,
            left,
            right,
            Q_LEN=q_len,
            Q_PAD=max(2, triton.next_power_of_2(q_len)),
            APPENDS=appends,
            HEADS=heads,
            KV_HEADS=kv_heads,
            PAGE_SIZE=page_size,
            DIM=dim,
            DIM_PAD=dim_pad,
            SOFTCAP=float(softcap),
            CAUSAL=causal,
            HAS_LEFT=left >= 0,
            HAS_RIGHT=not causal and right >= 0,
            ONE_SPLIT=splits == 1,
            ROWS=rows,
            BLOCK_KEYS=BLOCK_KEYS,
            SPLIT_KEYS=keys_a_split,
            FRESH_APART=appends and fresh_tile_apart(),
            PDL=pdl,
            num_warps=split_warps(),
            launch_pdl=pdl != 0,
        )
        if splits > 1:
            _attention_combine_kernel[(batch * q_len * heads,)](
                partial_sums,
                partial_stats,
                out,
                splits,
                DIM=dim,
                DIM_PAD=dim_pad,
                CHUNK=COMBINE_SPLITS,
                PDL=pdl,
                launch_pdl=pdl != 0,
            )
    return out


@triton.jit
def _tanh(x):
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0  # tl has no tanh of its own; saturates cleanly at +-1


@triton.jit
def _attention_split_kernel(
    q,
    k_cache,
    v_cache,
    new_keys,
    new_values,
    cache_seqlens,
    block_table,
    out,
    partial_sums,
    partial_stats,
    table_row_stride,
    table_column_stride,
    scale,
    window_left,
    window_right,
    Q_LEN: tl.constexpr,
    Q_PAD: tl.constexpr,
    APPENDS: tl.constexpr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_KEYS: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    FRESH_APART: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_the_kernel_before(PDL)
    GROUP: tl.constexpr = HEADS // KV_HEADS
    ROW_BLOCKS: tl.constexpr = (Q_LEN * GROUP + ROWS - 1) // ROWS
    program = tl.program_id(0)
    split = tl.program_id(1)
    sequence = program // (KV_HEADS * ROW_BLOCKS)
    kv_head = program // ROW_BLOCKS % KV_HEADS
    row = program % ROW_BLOCKS * ROWS + tl.arange(0, ROWS)
    real_row = row < Q_LEN * GROUP
    position = row % Q_LEN  # of the query within this call
    out_row = (sequence * Q_LEN + position) * HEADS + kv_head * GROUP + row // Q_LEN  # a row of q and out
    dims = tl.arange(0, DIM_PAD)
    real_dim = dims < DIM
    queries = tl.load(q + out_row[:, None] * DIM + dims[None, :], mask=real_row[:, None] & real_dim[None, :], other=0.0)

    cached = tl.load(cache_seqlens + sequence)  # keys in the cache before this call
    length = cached + Q_LEN if APPENDS else cached
    query_at = length - Q_LEN + position  # bottom-right alignment: the last query is the last key
    if APPENDS:  # the call's new keys and values go into their pages, by one program per (sequence, kv head)
        if (program % ROW_BLOCKS == 0) & (split == 0):
            index = tl.arange(0, Q_PAD)
            real = index < Q_LEN
            at = cached + index
            # names of their own: compiled Triton carries a name assigned before the key loop into it
            table_at = block_table + sequence * table_row_stride + at // PAGE_SIZE * table_column_stride
            at_page = tl.load(table_at, mask=real)
            at_slot = (at_page.to(tl.int64) * PAGE_SIZE + at % PAGE_SIZE) * KV_HEADS + kv_head
            source = ((sequence * Q_LEN + index) * KV_HEADS + kv_head)[:, None] * DIM + dims[None, :]
            target = at_slot[:, None] * DIM + dims[None, :]
            written = real[:, None] & real_dim[None, :]
            tl.store(k_cache + target, tl.load(new_keys + source, mask=written), mask=written)
            tl.store(v_cache + target, tl.load(new_values + source, mask=written), mask=written)
    start = split * SPLIT_KEYS
    end = tl.minimum(start + SPLIT_KEYS, length)
    if HAS_LEFT:  # whole tiles left of every row's window: skipped, not just masked (a tile starts on its edge)
        start = tl.maximum(start, (length - Q_LEN - window_left) // BLOCK_KEYS * BLOCK_KEYS)

    maximum = tl.full((ROWS,), -float("inf"), tl.float32)
    denominator = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, DIM_PAD), tl.float32)
    # tiles wholly before the call's first new key read the cache alone; the rest read the call's keys as well
    calls_from = tl.minimum(end, tl.maximum(start, cached // BLOCK_KEYS * BLOCK_KEYS)) if FRESH_APART else start
    for reads_call in tl.static_range(2):  # compiled as two loops: the first's tiles stage no tile of the call's
        for first in tl.range(
            calls_from if reads_call else start,
            end if reads_call else calls_from,
            BLOCK_KEYS,
            num_stages=1 if FRESH_APART and reads_call else None,  # at most a tile or two: nothing to stage
        ):
            maximum, denominator, acc = _attend_tile(
                first, queries, maximum, denominator, acc, k_cache, v_cache, new_keys, new_values, block_table,
                sequence, table_row_stride, table_column_stride, kv_head, cached, end, query_at, real_row, dims,
                real_dim, scale, window_left, window_right, Q_LEN, KV_HEADS, PAGE_SIZE, DIM, SOFTCAP, CAUSAL,
                HAS_LEFT, HAS_RIGHT, BLOCK_KEYS, APPENDS and reads_call,
            )  # fmt: skip

    let_the_next_kernel_start(PDL)
    if ONE_SPLIT:
        result = acc / tl.where(denominator == 0.0, 1.0, denominator)[:, None]
        tl.store(
            out + out_row[:, None] * DIM + dims[None, :],
            result.to(out.dtype.element_ty),
            mask=real_row[:, None] & real_dim[None, :],
        )
    else:
        part = out_row * tl.num_programs(1) + split  # (batch, q_len, heads, splits)
        tl.store(partial_sums + part[:, None] * DIM_PAD + dims[None, :], acc, mask=real_row[:, None])
        tl.store(partial_stats + part * 2, maximum, mask=real_row)
        tl.store(partial_stats + part * 2 + 1, denominator, mask=real_row)


@triton.jit
def _attend_tile(
    first, queries, maximum, denominator, acc, k_cache, v_cache, new_keys, new_values, block_table, sequence,
    table_row_stride, table_column_stride, kv_head, cached, end, query_at, real_row, dims, real_dim, scale,
    window_left, window_right, Q_LEN: tl.constexpr, KV_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DIM: tl.constexpr, SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    BLOCK_KEYS: tl.constexpr, FRESH: tl.constexpr,
):  # fmt: skip
    """The tile of keys from `first` into a program's online softmax: its (maximum, denominator, acc) after the
    tile. FRESH: the tile may hold the call's new keys, which it reads from the call, never from the slot being
    written (another program writes them)."""
    key = first + tl.arange(0, BLOCK_KEYS)
    in_split = key < end
    # a tile starts at a multiple of BLOCK_KEYS, which divides the page: its page is one load, not one a key
    page = tl.load(block_table + sequence * table_row_stride + first // PAGE_SIZE * table_column_stride)
    slot = (page.to(tl.int64) * PAGE_SIZE + key % PAGE_SIZE) * KV_HEADS + kv_head  # a row of (slots * kv_heads, dim)
    in_cache = in_split & (key < cached)
    keys = tl.load(k_cache + slot[None, :] * DIM + dims[:, None], mask=in_cache[None, :] & real_dim[:, None], other=0.0)
    if FRESH:
        fresh = in_split & (key >= cached)
        new_row = (sequence * Q_LEN + key - cached) * KV_HEADS + kv_head  # a row of (batch * q_len * kv_heads, dim)
        keys = tl.where(
            fresh[None, :],
            tl.load(new_keys + new_row[None, :] * DIM + dims[:, None], mask=fresh[None, :] & real_dim[:, None]),
            keys,
        )
    scores = tl.dot(queries, keys) * scale
    if SOFTCAP > 0:
        scores = _tanh(scores / SOFTCAP) * SOFTCAP
    visible = real_row[:, None] & in_split[None, :]
    if CAUSAL:
        visible = visible & (key[None, :] <= query_at[:, None])
    if HAS_RIGHT:
        visible = visible & (key[None, :] <= query_at[:, None] + window_right)
    if HAS_LEFT:
        visible = visible & (key[None, :] >= query_at[:, None] - window_left)
    scores = tl.where(visible, scores, -float("inf"))

    new_maximum = tl.maximum(maximum, tl.max(scores, 1))
    shift = tl.where(new_maximum == -float("inf"), 0.0, new_maximum)  # a row that has seen no key yet
    weights = tl.exp(scores - shift[:, None])
    rescale = tl.exp(maximum - shift)
    denominator = denominator * rescale + tl.sum(weights, 1)
    values = tl.load(
        v_cache + slot[:, None] * DIM + dims[None, :], mask=in_cache[:, None] & real_dim[None, :], other=0.0
    )
    if FRESH:
        values = tl.where(
            fresh[:, None],
            tl.load(new_values + new_row[:, None] * DIM + dims[None, :], mask=fresh[:, None] & real_dim[None, :]),
            values,
        )
    acc = acc * rescale[:, None] + tl.dot(weights.to(values.dtype), values)
    return new_maximum, denominator, acc


@triton.jit
def _attention_combine_kernel(
    partial_sums,
    partial_stats,
    out,
    splits,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_the_kernel_before(PDL)
    out_row = tl.program_id(0)
    dims = tl.arange(0, DIM_PAD)
    chunk = tl.arange(0, CHUNK)
    first_part = out_row * splits

    maxima = tl.full((CHUNK,), -float("inf"), tl.float32)
    for first in range(0, splits, CHUNK):
        split = first + chunk
        maxima = tl.maximum(
            maxima, tl.load(partial_stats + (first_part + split) * 2, mask=split < splits, other=-float("inf"))
        )
    maximum = tl.max(maxima, 0)
    shift = tl.where(maximum == -float("inf"), 0.0, maximum)

    # A split with no keys has weight 0 and adds exact zeros, so more splits change no bit of the result
    denominators = tl.zeros((CHUNK,), tl.float32)
    acc = tl.zeros((DIM_PAD,), tl.float32)
    for first in range(0, splits, CHUNK):
        split = first + chunk
        part = first_part + split
        weight = tl.exp(tl.load(partial_stats + part * 2, mask=split < splits, other=-float("inf")) - shift)
        denominators += weight * tl.load(partial_stats + part * 2 + 1, mask=split < splits, other=0.0)
        sums = tl.load(
            partial_sums + part[:, None] * DIM_PAD + dims[None, :], mask=(split < splits)[:, None], other=0.0
        )
        acc += tl.sum(sums * weight[:, None], 0)
    denominator = tl.sum(denominators, 0)
    let_the_next_kernel_start(PDL)
    result = acc / tl.where(denominator == 0.0, 1.0, denominator)
    tl.store(out + out_row * DIM + dims, result.to(out.dtype.element_ty), mask=dims < DIM)
