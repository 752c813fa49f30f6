"""An ExLlamaV3 model's decode attention on exlnb's Triton kernel (engines/triton_decode.py), which writes a step's
new keys and values into their pages in the same kernel that attends.

exllamav3 1.6.5 attends at decode in three kernels a layer: a cache write (`_paged_kv_update_rows_kernel`), a split
pass and a combine pass (`paged_attn_triton_decode`): 0.357 ms of a 7B step's 4.17 ms of kernels at 256 tokens,
96 of its 363 launches; on exlnb's kernel, the ExLlamaV2 engine's decode attention, 0.288 ms and 331 launches
(H200 profiles, benchmarks/results/speed-nvidia-h200-2026-11-28-attention/). Each attention keeps a memo of the
attention function that took its last call (`dispatch_cache`), which exllamav3's `attn_dispatch` tries before its
list; the memo is replaced by one that offers exlnb's kernel first and the library's choice after it. Calls the
kernel does not take (more than 16 queries, quantized caches, sliding windows, softcap, sinks, non-causal spans)
go where they went before, and nothing of exllamav3's own state changes: a raw exllamav3 generator in the same
process keeps the library's kernels.

Only single sequences take it. exlnb's kernel splits the keys by the block table's width, which exllamav3 pads to
16 pages, so a batch of 8 launched 16 splits per sequence and head, nearly all past the sequences' ends, where
exllamav3 sizes its splits to the batch (one at batch 8): the batch-8 step took 6.04 ms against 5.32 on
exllamav3's kernel (7B-shaped, H200, 2026-11-28), while batch 1 went from 4.75 to 4.63 ms a token. No split size
won the batch back: over 32 layers of 8 sequences at 256 tokens exllamav3's kernel took 0.616 ms, exlnb's 0.694
at best, and 0.870 on a table cut to the need (benchmarks/results/speed-nvidia-h200-2026-11-28-cut). The graph
decoder cuts a single sequence's table to the pages it needs, so at short contexts one split does it all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from exlnb.engines.base import one_line
from exlnb.engines.cuda_graphs import beyond_tolerance, relative_difference
from exlnb.engines.exllamav2.paged_attention import decodes_on_triton  # one switch for both engines
from exlnb.engines.fused_products import random_probe

MEMO_KEY = "fn"  # where exllamav3 1.6.5's attn_dispatch keeps the function that took an fp16 cache's last call


class OursFirst(dict):
    """An attention's dispatch memo that answers with exlnb's function first, then the one the library chose."""

    def __init__(self, ours: Callable, memo: dict) -> None:
        super().__init__(memo)
        self._ours = ours
        self._first = _either(ours, memo.get(MEMO_KEY))

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        if key == MEMO_KEY:
            self._first = _either(self._ours, value)

    def get(self, key, default=None):
        return self._first if key == MEMO_KEY else super().get(key, default)


def _either(ours: Callable, library: Callable | None) -> Callable:
    if library is None:
        return ours  # declined, the dispatcher searches its own list and memoises what it finds

    def first(args):
        out = ours(args)
        return out if out is not None else library(args)

    return first


def exlnb_decode(args) -> torch.Tensor | None:
    """exllamav3's attention function protocol (`AttnFn`): the call on exlnb's kernel, or None where it does not
    take it. The new keys are written at `cache_seqlens`, as exllamav3's own decode kernel writes them."""
    if not takes(args):
        return None
    from exlnb.engines import triton_decode  # imports triton: only once a CUDA call has come

    if not triton_decode.handles(args.q, args.k_cache, args.v_cache):
        return None
    return triton_decode.paged_decode_attention(
        args.q,
        args.k_cache,
        args.v_cache,
        args.cache_seqlens,
        args.block_table,
        new_keys=args.k,
        new_values=args.v,
        scale=args.sm_scale,
        causal=args.causal,
        window_size=(-1, -1),
        softcap=0.0,
    )


def takes(args) -> bool:
    """Whether a call is one the kernel is held to exllamav3's for, and faster at: one sequence, an fp16 paged cache
    read in place, new keys to append, every query causal over all its keys, on a GPU. (Its shapes and dtypes:
    `triton_decode.handles`.)"""
    return not (
        args.bsz != 1
        or args.k_cache is None
        or args.k is None
        or args.cu_seqlens is not None
        or args.q_cache is not None
        or args.sinks is not None
        or args.non_causal_spans
        or args.sink_key0
        or args.softcap
        or args.get_window_size() != (-1, -1)
        or not args.q.is_cuda
    )


class DecodeAttention:
    """exlnb's decode attention installed on a model's plain attentions; `uninstall` gives them plain memos."""

    def __init__(self, attentions: list) -> None:
        self.attentions = attentions
        for attention in attentions:
            attention.dispatch_cache = OursFirst(exlnb_decode, attention.dispatch_cache)

    def uninstall(self) -> None:
        for attention in self.attentions:
            attention.dispatch_cache = {}
        self.attentions = []


def take_decode_attention(model, page_size: int) -> tuple[DecodeAttention | None, str | None]:
    """exlnb's decode attention on the model's plain attentions where triton is installed and not opted out of
    (`EXLNB_TRITON_DECODE=0`), and where it agrees with exllamav3's own on each of their shapes; else None and,
    where a check failed, the status note that says why. Before the graphs, which then capture it."""
    attentions = plain_attentions(model) if torch.cuda.is_available() and decodes_on_triton() else []
    if not attentions:
        return None, None
    shapes = {(a.num_q_heads, a.num_kv_heads, a.head_dim, a.sm_scale): a for a in attentions}
    for attention in shapes.values():
        try:
            reason = check_decode_attention(attention, page_size)
        except Exception as error:  # a model the adapter misreads keeps exllamav3's kernels, and says why
            reason = one_line(error)
        if reason is not None:
            return None, f"decode attention on exllamav3's kernels: {reason}"
    return DecodeAttention(attentions), None


def plain_attentions(model) -> list:
    """The attentions whose memo is still exllamav3's own: not under tensor parallelism (its shards attend in
    worker processes), not MLA or other attention kinds, which dispatch their own way."""
    from exllamav3.modules.attn import Attention

    if model.loaded_tp:
        return []
    return [m for m in model if type(m) is Attention and type(getattr(m, "dispatch_cache", None)) is dict]


def check_decode_attention(attention, page_size: int) -> str | None:
    """exlnb's kernel against exllamav3's own decode attention on random pages shaped like `attention`'s: a
    sequence that crosses a page, on pages out of order, appending its new keys. None where the outputs agree to
    the tolerance graphs are held to and the caches end alike, else why not, in a line."""
    from exllamav3.modules.attention_fn.common import AttnArgs
    from exllamav3.modules.attention_fn.triton_paged import fn_triton_paged_attn_decode

    heads, kv_heads, dim = attention.num_q_heads, attention.num_kv_heads, attention.head_dim
    device = torch.device(attention.device)
    shapes = ((1, 1, heads, dim), (1, 1, kv_heads, dim), (1, 1, kv_heads, dim), *[(3, page_size, kv_heads, dim)] * 2)
    q, k, v, k_cache, v_cache = (
        random_probe(*shape, dtype=torch.half, device=device, seed=seed) for seed, shape in enumerate(shapes)
    )
    table = torch.tensor([[2, 0]], dtype=torch.int32, device=device)
    lengths = torch.tensor([page_size + 37], dtype=torch.int32, device=device)
    outcomes = []
    for attend in (fn_triton_paged_attn_decode, exlnb_decode):
        caches = (k_cache.clone(), v_cache.clone())
        args = AttnArgs(
            bsz=1, q_len=1, num_q_heads=heads, dim=dim, kv_len=1, num_kv_heads=kv_heads, q=q, k=k, v=v,
            k_cache=caches[0], v_cache=caches[1], causal=True, sm_scale=attention.sm_scale, cu_seqlens=None,
            max_seqlen=None, window_size=None, softcap=0.0, block_table=table, cache_seqlens=lengths,
        )  # fmt: skip
        out = attend(args)
        if out is None:
            return "exlnb's decode attention declined the check's call"
        outcomes.append((out.float(), caches))
    (theirs, their_caches), (ours, our_caches) = outcomes
    error = relative_difference(ours, theirs)
    if beyond_tolerance(error):
        return f"exlnb's decode attention differs from exllamav3's by {error:.3g} of its largest output"
    if not all(torch.equal(a, b) for a, b in zip(our_caches, their_caches, strict=True)):
        return "exlnb's decode attention wrote the new keys elsewhere than exllamav3's"
    return None
