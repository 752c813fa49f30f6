"""Paged attention in PyTorch, for exllamav2's dynamic generator where flash-attn is missing.

exllamav2 0.3.2 batches jobs and shares prompt pages only in paged mode, and its paged path calls exactly one
flash-attn function, `flash_attn_with_kvcache`, from `ExLlamaV2Attention.forward_paged` (its unpaged path
runs its own torch attention; flash-attn's other functions serve only that path and tensor parallelism,
neither of which the paged generator uses here). This module implements the subset of that function
exllamav2 calls: a paged cache addressed through a block table, per-sequence cache lengths, new keys and
values written into their pages, grouped-query attention, causal masking aligned bottom-right, softmax
scale, sliding window and softcap. `install()` puts it into exllamav2; nothing happens on import.

Decode-sized calls on CUDA (up to 16 query positions per sequence, fp16) go to triton_decode's kernels, which
read the pages in place instead of gathering them, where triton is installed; `EXLNB_TRITON_DECODE=0` in the
environment before import (or `TRITON_DECODE = False`) keeps every call on this module's PyTorch path. On an H100
the kernels took a 7B-shaped model from 18.5 to 8.1 ms/token at 4,096 tokens of context; they became the default
once the ExLlamaV2 engine's GPU suite passed with them
(benchmarks/results/gpu-suites-nvidia-h100-80gb-hbm3-2026-11-26-triton-default/).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import threading
from dataclasses import dataclass

import torch

VERIFIED_EXLLAMAV2 = "0.3.2"  # the one exllamav2 release exlnb is verified against (docs/gpu.md)

# float32 attention scores held at once: 2**26 of them is 256 MiB. A long prompt chunk against a long cache
# (2048 queries x 8192 keys x 32 heads would be 2 GiB) runs in slices of queries instead.
SCORE_BUDGET = 2**26

TRITON_DECODE = os.environ.get("EXLNB_TRITON_DECODE", "1") != "0"  # decode steps on triton_decode; "0" opts out


@dataclass(frozen=True)
class PagedLayout:
    """Where one forward pass's keys and values live in the paged cache, and which of them each query sees.

    It depends only on the block table, sequence lengths and head shapes, which every layer of a pass shares.
    """

    write_slots: torch.Tensor | None  # (batch * q_len,) rows of the (slots, kv_heads, dim) cache for new keys
    read_rows: torch.Tensor  # (batch * heads * keys,) rows of the (slots * kv_heads, dim) cache, in the
    #                          order (sequence, query head, position): the gather also repeats key heads for GQA
    bias: torch.Tensor  # (batch, 1, q_len, keys): 0 where the query may attend to the key, -inf elsewhere


def paged_layout(
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    q_len: int,
    page_size: int,
    *,
    appends: bool,
    causal: bool,
    window_size: tuple[int, int],
    heads: int,
    kv_heads: int,
    dtype: torch.dtype,
) -> PagedLayout:
    """Slots and mask for queries that follow `cache_seqlens` tokens (plus the `q_len` new ones if `appends`), for
    the PyTorch path (triton_decode reads the pages in place and writes the new keys itself)."""
    device = block_table.device
    block_table = block_table.long()
    cache_seqlens = cache_seqlens.long()
    lengths = cache_seqlens + q_len if appends else cache_seqlens  # keys each sequence attends over
    new_positions = lengths[:, None] - q_len + torch.arange(q_len, device=device)  # (batch, q_len)

    write_slots = None
    if appends:
        pages = block_table.gather(1, new_positions // page_size)
        write_slots = (pages * page_size + new_positions % page_size).flatten()

    # every page in the table: exllamav2 sizes a pass's table to its longest sequence, so little is padding
    offsets = torch.arange(page_size, device=device)
    slots = (block_table[:, :, None] * page_size + offsets).flatten(1)  # (batch, keys)
    keys = torch.arange(slots.shape[1], device=device)
    padding = keys >= lengths[:, None]  # (batch, keys)
    # Padding reads the sequence's first key instead: flash-attn never reads past a sequence, and a padded
    # slot may hold anything (NaN, whose product with a zero weight is still NaN).
    slots = torch.where(padding, slots[:, :1], slots)
    key_head = torch.arange(heads, device=device) // (heads // kv_heads)  # query head h reads key head h // group
    read_rows = (slots[:, None, :] * kv_heads + key_head[None, :, None]).flatten()

    query = new_positions[:, :, None]
    left, right = window_size
    hidden = padding[:, None, :]
    if causal:
        hidden = hidden | (keys > query)  # bottom-right: the last query sees every key
    elif right >= 0:
        hidden = hidden | (keys > query + right)
    if left >= 0:
        hidden = hidden | (keys < query - left)
    bias = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, -math.inf)
    return PagedLayout(write_slots, read_rows, bias[:, None])


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v for q (batch, heads, q_len, dim) and keys/values (batch, heads, keys,
    dim). Long query blocks run in slices so that no more than SCORE_BUDGET scores exist at once."""
    batch, heads, q_len, _ = q.shape
    step = max(1, SCORE_BUDGET // (batch * heads * keys.shape[2]))
    if step >= q_len:
        return _attend_block(q, keys, values, bias, scale, softcap)
    out = torch.empty_like(q)
    for start in range(0, q_len, step):
        rows = slice(start, start + step)
        out[:, :, rows] = _attend_block(q[:, :, rows], keys, values, bias[:, :, rows], scale, softcap)
    return out


def _attend_block(q, keys, values, bias, scale: float, softcap: float) -> torch.Tensor:
    if softcap > 0:
        return _attend_softcapped(q, keys, values, bias, scale, softcap)
    if q.is_cuda and q.shape[-1] % 8 == 0:
        # The memory-efficient kernel, called directly: one fused kernel that takes an additive mask. SDPA's
        # own dispatch picks cuDNN attention on an H100 (torch 2.11): a 7B-shaped model then decoded at
        # 23.0 ms/token paged against 16.8 unpaged, and with this call at 16.3 against 16.2 (decode there
        # is bound by the host: benchmarks/README.md). Two greedy jobs of one prompt, decoding in the same
        # batches, parted ways in one of two runs under cuDNN and in neither of two under this kernel. The
        # explicit mask keeps clear of exllamav2's own SDPA path, which gives wrong logits with torch 2.11.
        batch, heads, q_len, _ = q.shape
        mask = bias.expand(batch, heads, q_len, bias.shape[-1])  # a broadcast view, no copy
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, keys, values, mask, False, scale=scale)[0]
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scale)


def _attend_softcapped(q, keys, values, bias, scale: float, softcap: float) -> torch.Tensor:
    """Scores capped by tanh before the softmax (Gemma 2), which SDPA cannot do: float32 scores by hand."""
    scores = torch.matmul(q.float(), keys.float().transpose(2, 3))
    scores = torch.tanh(scores * (scale / softcap)) * softcap + bias
    return torch.matmul(scores.softmax(-1), values.float()).to(q.dtype)


class _LayoutMemo(threading.local):
    """The layout of the current forward pass, per thread (each session's engine runs on its own thread).

    exllamav2 passes the same block-table and lengths tensors to every layer of a pass and makes new ones
    for the next pass (`PagedParams` copies them to the device once); building the layout once instead of
    per layer saves about twenty kernel launches a layer, and decode of a small model is bound by launches
    (docs/gpu.md). The tensors are compared by identity (their version counters are not tracked under
    `torch.inference_mode`, where exllamav2 runs) and held, so a later tensor cannot reuse their ids.
    """

    def __init__(self) -> None:
        self._tensors: tuple[torch.Tensor, torch.Tensor] | None = None
        self._shape: tuple | None = None
        self._layout: PagedLayout | None = None

    def get(self, block_table, cache_seqlens, *args, **kwargs) -> PagedLayout:
        shape = (args, kwargs)
        current = self._tensors
        if current is None or current[0] is not block_table or current[1] is not cache_seqlens or shape != self._shape:
            self._layout = paged_layout(block_table, cache_seqlens, *args, **kwargs)
            self._tensors, self._shape = (block_table, cache_seqlens), shape
        return self._layout


_memo = _LayoutMemo()


def forget_layout() -> None:
    """Drop this thread's remembered layout. A CUDA graph capture calls it first: a layout remembered from an
    eager pass over the same tensors would be read by the graph instead of computed in it."""
    _memo.__init__()


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> torch.Tensor:
    """flash-attn's `flash_attn_with_kvcache` with a paged cache, as exllamav2 0.3.2 calls it.

    q: (batch, q_len, heads, dim). k_cache, v_cache: (pages, page_size, kv_heads, dim), updated in place
    when k, v (batch, q_len, kv_heads, dim) are given: they are written at positions cache_seqlens[b] ... of
    sequence b, whose pages are block_table[b] (int32, padded with any page index). Queries are the last
    q_len positions of each sequence. Returns (batch, q_len, heads, dim) in q's dtype.

    Unlike flash-attn, it assumes `block_table` and `cache_seqlens` are not modified in place between calls
    (exllamav2 makes new ones for every forward pass): see `_LayoutMemo`.
    """
    batch, q_len, heads, dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads evenly")
    scale = softmax_scale if softmax_scale is not None else dim**-0.5
    if _decodes_on_triton(q, k_cache, v_cache):  # one kernel writes the new keys and values and attends
        from exlnb.engines import triton_decode

        return triton_decode.paged_decode_attention(
            q,
            k_cache,
            v_cache,
            cache_seqlens,
            block_table,
            new_keys=k,
            new_values=v,
            scale=scale,
            causal=causal,
            window_size=tuple(window_size),
            softcap=softcap,
        )
    layout = _memo.get(
        block_table,
        cache_seqlens,
        q_len,
        page_size,
        appends=k is not None,
        causal=causal,
        window_size=tuple(window_size),
        heads=heads,
        kv_heads=kv_heads,
        dtype=q.dtype,
    )
    if k is not None:  # views of the caller's cache: the new keys and values land in its pages
        k_cache.view(-1, kv_heads, dim).index_copy_(0, layout.write_slots, k.reshape(-1, kv_heads, dim))
        v_cache.view(-1, kv_heads, dim).index_copy_(0, layout.write_slots, v.reshape(-1, kv_heads, dim))
    keys = k_cache.view(-1, dim).index_select(0, layout.read_rows).view(batch, heads, -1, dim)
    values = v_cache.view(-1, dim).index_select(0, layout.read_rows).view(batch, heads, -1, dim)
    out = attend(q.transpose(1, 2), keys, values, layout.bias, scale, softcap)
    return out.transpose(1, 2).contiguous()  # free at decode (q_len 1); exllamav2 views the result


def decodes_on_triton() -> bool:
    """Whether decode steps on CUDA go to triton_decode: not opted out of, and triton installed."""
    return TRITON_DECODE and triton_installed()


def _decodes_on_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether a call goes to triton_decode: TRITON_DECODE on, CUDA tensors, triton installed, a call it takes."""
    if not (q.is_cuda and decodes_on_triton()):
        return False
    from exlnb.engines import triton_decode

    return triton_decode.handles(q, k_cache, v_cache)


@functools.cache
def triton_installed() -> bool:
    """Whether triton is installed here (found, not imported): the Triton decode path, its tests and its
    benchmark rows need it."""
    return importlib.util.find_spec("triton") is not None


# -- exllamav2 -----------------------------------------------------------------------------------------------

# What exllamav2 0.3.2 reads at call time, and where: install() checks these before changing anything.
_PINS = {
    "ExLlamaV2Attention.forward_paged": (
        "flash_attn_with_kvcache",
        "has_flash_attn_with_window",
        "has_flash_attn_with_softcap",
    ),
    "assert_paged_attn": ("has_flash_attn_with_paged",),
}


def install() -> None:
    """Serve exllamav2's paged mode with this module's attention. Only where exllamav2 found no flash-attn.

    exllamav2 looks up `flash_attn_with_kvcache` and its capability flags as globals of `exllamav2.attn`
    each time it runs (the dynamic generator checks `has_flash_attn_with_paged` through `assert_paged_attn`),
    so setting them there is all it takes. `has_flash_attn` stays False: the unpaged path keeps exllamav2's
    own torch attention.
    """
    import exllamav2
    from exllamav2 import attn
    from exllamav2.generator import dynamic

    if exllamav2.__version__ != VERIFIED_EXLLAMAV2:
        raise RuntimeError(
            f"exlnb's paged attention is verified against exllamav2 {VERIFIED_EXLLAMAV2}, found "
            f"{exllamav2.__version__}: install exllamav2=={VERIFIED_EXLLAMAV2}, or load with paged=False"
        )
    for where, names in _PINS.items():
        function = attn
        for part in where.split("."):
            function = getattr(function, part)
        missing = set(names) - set(function.__code__.co_names)
        if missing:
            raise RuntimeError(
                f"exllamav2's {where} no longer reads {sorted(missing)}: exlnb cannot serve its paged mode"
            )
    if dynamic.assert_paged_attn is not attn.assert_paged_attn:
        raise RuntimeError("exllamav2's dynamic generator no longer checks paged attention through exllamav2.attn")
    if attn.has_flash_attn:
        raise RuntimeError(
            "flash-attn is importable but older than 2.5.7 (exllamav2 uses it unpaged): upgrade flash-attn for "
            "its paged attention, or load with paged=False"
        )
    attn.flash_attn_with_kvcache = flash_attn_with_kvcache
    attn.has_flash_attn_with_window = True
    attn.has_flash_attn_with_softcap = True
    attn.has_flash_attn_with_paged = True


def installed() -> bool:
    """Whether exllamav2's paged mode runs on this module (rather than on flash-attn, or not at all)."""
    import sys

    attn = sys.modules.get("exllamav2.attn")
    return attn is not None and getattr(attn, "flash_attn_with_kvcache", None) is flash_attn_with_kvcache
