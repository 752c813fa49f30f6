"""exlnb's paged attention against a float64 reference written from flash-attn's documented semantics.

Random inputs in the shapes exllamav2 0.3.2's paged generator produces: ragged cache lengths, sequences over
several non-adjacent pages, block tables padded with page 0, grouped-query heads, prefill chunks (new keys
written into the cache, or already there) and batched decode. Runs on the CPU in CI, on CUDA with `-m gpu`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from exlnb.engines.exllamav2 import paged_attention
from exlnb.engines.exllamav2.paged_attention import flash_attn_with_kvcache

PAGE = 16
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@dataclass
class Case:
    cache_lengths: list[int]  # tokens already in each sequence's cache
    q_len: int
    heads: int = 6
    kv_heads: int = 2
    dim: int = 32
    appends: bool = True  # new keys come with the call; else they are in the cache already
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    shared_first_page: bool = False  # every sequence starts on the same page (a shared prompt prefix)


CASES = {
    "decode, ragged lengths across page ends, GQA": Case([0, 7, 16, 40], q_len=1),
    "prefill chunk appended over several pages": Case([21], q_len=37),
    "prefill chunk already written to the cache": Case([30], q_len=10, appends=False),
    "batched multi-token queries": Case([5, 17, 33], q_len=4),
    "decode after a shared prefix page": Case([16, 20, 35], q_len=1, shared_first_page=True),
    "sliding window and softcap": Case([9, 40], q_len=5, window=(8, 8), softcap=30.0),
    "not causal, window to the right": Case([12, 3], q_len=6, causal=False, window=(-1, 2)),
    "multi-head attention (no grouping)": Case([3, 18], q_len=2, heads=4, kv_heads=4),
}


def build(case: Case, dtype: torch.dtype, device: str, seed: int = 0):
    """Random q/k/v and a paged cache: each sequence on shuffled pages, page 0 left out of every sequence and
    filled with NaN, so that reading padding (block tables are padded with 0, as exllamav2 pads them) shows."""
    g = torch.Generator().manual_seed(seed)
    batch = len(case.cache_lengths)
    totals = [n + case.q_len if case.appends else n for n in case.cache_lengths]
    pages_needed = [math.ceil(t / PAGE) for t in totals]
    shared = 1 if case.shared_first_page else 0
    n_pages = 1 + shared + sum(p - shared for p in pages_needed) + 2  # page 0, shared, own pages, two spare
    order = (torch.randperm(n_pages - 1, generator=g) + 1).tolist()
    first = order.pop() if shared else None
    table = torch.zeros(batch, max(pages_needed) + 1, dtype=torch.int32)
    for b, need in enumerate(pages_needed):
        own = [order.pop() for _ in range(need - shared)]
        table[b, :need] = torch.tensor(([first] if shared else []) + own, dtype=torch.int32)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    k_cache = rand(n_pages, PAGE, case.kv_heads, case.dim)
    v_cache = rand(n_pages, PAGE, case.kv_heads, case.dim)
    k_cache[0] = v_cache[0] = math.nan
    if shared:  # a shared page holds the same prefix for everyone: no sequence writes into it
        assert min(case.cache_lengths) >= PAGE
    q = rand(batch, case.q_len, case.heads, case.dim)
    k = rand(batch, case.q_len, case.kv_heads, case.dim) if case.appends else None
    v = rand(batch, case.q_len, case.kv_heads, case.dim) if case.appends else None
    lengths = torch.tensor(case.cache_lengths if case.appends else totals, dtype=torch.int32)
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(q), move(k_cache), move(v_cache), move(k), move(v), move(lengths), move(table)


def reference(q, k_cache, v_cache, k, v, lengths, table, *, scale, causal, window, softcap):
    """flash_attn_with_kvcache as documented, one query and head at a time in float64. Returns the output and
    the caches as they must be after the call."""
    k_cache, v_cache = k_cache.double().cpu().clone(), v_cache.double().cpu().clone()
    q, table, lengths = q.double().cpu(), table.cpu(), lengths.cpu()
    batch, q_len, heads, dim = q.shape
    group = heads // k_cache.shape[2]
    out = torch.zeros(batch, q_len, heads, dim, dtype=torch.float64)
    for b in range(batch):
        n = int(lengths[b])
        if k is not None:
            for i in range(q_len):
                page, slot = int(table[b, (n + i) // PAGE]), (n + i) % PAGE
                k_cache[page, slot], v_cache[page, slot] = k[b, i].double().cpu(), v[b, i].double().cpu()
            n += q_len
        keys = torch.stack([k_cache[int(table[b, j // PAGE]), j % PAGE] for j in range(n)])
        values = torch.stack([v_cache[int(table[b, j // PAGE]), j % PAGE] for j in range(n)])
        positions = torch.arange(n)
        for i in range(q_len):
            p = n - q_len + i  # bottom-right alignment: the last query is the last key
            visible = torch.ones(n, dtype=torch.bool)
            if causal:
                visible &= positions <= p
            elif window[1] >= 0:
                visible &= positions <= p + window[1]
            if window[0] >= 0:
                visible &= positions >= p - window[0]
            for h in range(heads):
                scores = keys[:, h // group] @ q[b, i, h] * scale
                if softcap:
                    scores = softcap * torch.tanh(scores / softcap)
                scores[~visible] = -math.inf
                out[b, i, h] = scores.softmax(0) @ values[:, h // group]
    return out, k_cache, v_cache


def tolerance(dtype: torch.dtype) -> dict:
    return {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_paged_attention_matches_float64_reference(name, dtype, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    case = CASES[name]
    q, k_cache, v_cache, k, v, lengths, table = build(case, dtype, device)
    scale = case.dim**-0.5
    expected, expected_k_cache, expected_v_cache = reference(
        q,
        k_cache,
        v_cache,
        k,
        v,
        lengths,
        table,
        scale=scale,
        causal=case.causal,
        window=case.window,
        softcap=case.softcap,
    )
    out = flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens=lengths,
        block_table=table,
        softmax_scale=scale,
        causal=case.causal,
        window_size=case.window,
        softcap=case.softcap,
    )

    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double().cpu(), expected, **tolerance(dtype))
    # the new keys and values landed in their pages, and nothing else in the cache changed
    torch.testing.assert_close(k_cache.cpu(), expected_k_cache.to(dtype), atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache.cpu(), expected_v_cache.to(dtype), atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("softcap", [0.0, 30.0], ids=["sdpa", "softcap"])
def test_long_prefill_is_computed_in_query_slices_with_the_same_result(device, softcap, monkeypatch):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    case = Case([40], q_len=50)
    q, k_cache, v_cache, k, v, lengths, table = build(case, torch.float32, device, seed=3)
    expected, _, _ = reference(
        q, k_cache, v_cache, k, v, lengths, table, scale=case.dim**-0.5, causal=True, window=(-1, -1), softcap=softcap
    )
    keys_read = table.shape[1] * PAGE  # every page of the table, padding included
    monkeypatch.setattr(paged_attention, "SCORE_BUDGET", case.heads * keys_read * 7)  # 7 queries per slice
    original, blocks = paged_attention._attend_block, []

    def counting(q, *rest):
        blocks.append(q.shape[2])  # queries in this slice
        return original(q, *rest)

    monkeypatch.setattr(paged_attention, "_attend_block", counting)

    out = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table, causal=True, softcap=softcap
    )

    assert blocks == [7] * 7 + [1]
    torch.testing.assert_close(out.double().cpu(), expected, **tolerance(torch.float32))


def test_every_layer_of_a_pass_reuses_one_layout_and_the_next_pass_gets_its_own(monkeypatch):
    """exllamav2 hands every layer the same block table and lengths; the next pass brings new tensors."""
    case = Case([5, 17], q_len=1)
    q, k_cache, v_cache, k, v, lengths, table = build(case, torch.float32, "cpu")
    calls = []
    original = paged_attention.paged_layout

    def counting(*args, **kwargs):
        calls.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(paged_attention, "paged_layout", counting)
    for _layer in range(3):
        flash_attn_with_kvcache(q, k_cache, v_cache, None, None, cache_seqlens=lengths + 1, block_table=table)
    first_pass = len(calls)
    lengths_pass = lengths + 1
    for _layer in range(3):
        flash_attn_with_kvcache(q, k_cache, v_cache, None, None, cache_seqlens=lengths_pass, block_table=table)

    assert first_pass == 3  # a new lengths tensor per call: never reused
    assert len(calls) == 4  # the same tensors for three layers: one layout


def test_uneven_head_grouping_is_refused():
    case = Case([4], q_len=1, heads=5, kv_heads=2)
    q, k_cache, v_cache, k, v, lengths, table = build(case, torch.float32, "cpu")
    with pytest.raises(ValueError, match="5 query heads cannot share 2 key/value heads"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table)
