"""The ExLlamaV2 engine's fp16 attention at one row with RoPE in one launch and the residual in o's product
(on unless `EXLNB_ATTENTION_TAIL=0`).

exllamav2 0.3.2 runs an unquantized paged attention through `ExLlamaV2Attention.forward_paged`: the norm, the q, k
and v products, `ext_c.rope_` on q and again on k, the attention (which writes the new key and value into their
page), the o product, and `hidden_states += residual` as a kernel of its own. On an H200 a 7B step's graph
launches 455 kernels, and each launch costs its kernel's time plus about 0.88 us
(benchmarks/results/speed-nvidia-h200-2026-11-29-b). Here, for a single row, the attention runs as the library's
does but at two places: o's product adds the residual as it writes (`gemv.row_times_matrix_plus`), and where q and
k come out of one fused product side by side, as a 7B Llama's do, one `rope_` call covers both: 64 launches fewer a
7B step (32 adds, 32 RoPE launches). The RoPE is exllamav2's own kernel, so its bits are the library's: at one row
every head of q and of k is at the same position (rope.cu reads position `past_len + row / num_heads`, and row <
num_heads), with the same sin and cos. Under grouped-query attention q has a product of its own, lies apart from
k, and keeps its own `rope_` call.

By default as well (`EXLNB_NORM_IN_PRODUCT=attention` or `1`; `0` or `mlp` leave it out), where q, k and v are one
fused group after an RMS norm, the norm runs inside their product (`folded_norm.py`), and where the RoPE is NEOX
over whole heads with no head norm before it (a Llama's), RoPE too, as the product writes q and k (rope.cu's fp16
arithmetic, the position read on the device): 64 launches fewer again, its outputs the library's to the tolerance
of every load check rather than to the bit.

Any other call (a prompt, a batch, LoRAs, alternative or offset RoPE, a cache other than fp16's) takes the library's own
`forward_paged`. A tail is one more of the products `FusedProducts` installs, and a load checks each against the
library's attention on a random row over a scratch page, its output and the key and value it writes (`check_tails`,
to the tolerance of every load check; the same bits give 0), refusing them where they differ.
`EXLNB_FUSED_PRODUCTS=0` turns it off with the products.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import torch

from exlnb.engines.cuda_graphs import relative_difference
from exlnb.engines.exllamav2.folded_norm import FoldedNorm, folded_norm
from exlnb.engines.fused_products import ProductGroup, TailKind, random_probe

ATTENTION_TAILS = TailKind(
    "attention tails with the residual in o", "an attention's tail differs from the library's attention"
)
FOLDED_ATTENTION_TAILS = TailKind(
    "attention tails with the norm in q, k and v and the residual in o",
    "an attention's tail with its norm in q, k and v differs from the library's attention",
)
ROPED_ATTENTION_TAILS = TailKind(
    "attention tails with the norm and RoPE in q, k and v and the residual in o",
    "an attention's tail with its norm and RoPE in q, k and v differs from the library's attention",
)

# What `AttentionTail.forward_paged` mirrors of exllamav2 0.3.2's, and where: `attention_tails` checks these first.
_PINS = {
    "forward": ("forward_paged",),
    "forward_paged": (
        "get_kv_state",
        "get_alt_rope_embed",
        "get_rope_offsets",
        "rope_",
        "is_sequential",
        "get_cache_seqlens_after",
        "flash_attn_with_kvcache",
        "has_flash_attn_with_window",
        "has_flash_attn_with_softcap",
        "post_layernorm",
        "has_residual",
    ),
}


def attention_tail_on() -> bool:
    """Whether the ExLlamaV2 engine runs its single-row attentions with RoPE in one launch and the residual in o
    (on unless `EXLNB_ATTENTION_TAIL=0`, read at each load): timed with the MLP's tail, as `mlp_tail_on` says."""
    return os.environ.get("EXLNB_ATTENTION_TAIL", "1") != "0"


def side_by_side(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor | None:
    """Two one-row tensors of heads as one (1, heads, head_dim) view where one begins where the other ends in a single
    allocation (a fused group's outputs, `ProductGroup`), else None."""
    low, high = sorted((first, second), key=torch.Tensor.data_ptr)
    dim = low.shape[-1]
    adjacent = (
        low.is_contiguous()
        and high.is_contiguous()
        and low.dtype == high.dtype
        and high.shape[-1] == dim
        and low.untyped_storage().data_ptr() == high.untyped_storage().data_ptr()
        and low.data_ptr() + low.numel() * low.element_size() == high.data_ptr()
    )
    if not adjacent:
        return None
    heads = (low.numel() + high.numel()) // dim
    return low.as_strided((1, heads, dim), (heads * dim, dim, 1))


class _ScratchPage:
    """One page of fp16 keys and values in the shape of an `ExLlamaV2Cache` layer, for a check: what `forward_paged`
    reads of the cache (its block size and dtype, the layer's tensors), so that a check never touches the engine's
    pages."""

    q_block = 0
    dtype = torch.half

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values

    def get_kv_state(self, *args) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values

    def store_kv_state(self, *args) -> None:
        pass

    def clone(self) -> _ScratchPage:
        return _ScratchPage(self.keys.clone(), self.values.clone())


class AttentionTail:
    """One attention's `forward_paged` with RoPE in one launch and the residual in o for single rows (an instance
    attribute, found before the class's method), the library's own for every other call. `library` is the module
    the library's attention reads its kernels and flags from at call time (`exllamav2.attn`)."""

    def __init__(self, attention, library, folded: FoldedNorm | None = None) -> None:
        self.attention, self.library, self.folded = attention, library, folded
        self.o_weight = attention.o_proj.linear.weight.data  # (out, in), as it lies
        self.hidden = self.o_weight.shape[0]
        self.rope_in_product = folded is not None and self._neox_over_whole_heads()
        kinds = {None: ATTENTION_TAILS, False: FOLDED_ATTENTION_TAILS, True: ROPED_ATTENTION_TAILS}
        self.kind = kinds[None if folded is None else self.rope_in_product]

    def _neox_over_whole_heads(self) -> bool:
        """Whether the attention's RoPE can run as its folded product writes q and k: NEOX over whole heads (the
        halves a head's first and second), with no head norm between the products and RoPE."""
        attention = self.attention
        neox = attention.archparams.rope_style == self.library.RopeStyle.NEOX and attention.q_norm is None
        return neox and all(table.shape[-1] == attention.head_dim for table in self._sin_cos())

    def install(self) -> None:
        self.attention.forward_paged = self.forward_paged

    def uninstall(self) -> None:
        self.attention.__dict__.pop("forward_paged", None)

    def forward_paged(self, hidden_states, cache=None, attn_params=None, loras=None, **kwargs):
        if not self._takes(hidden_states, cache, attn_params, loras):
            own = type(self.attention).forward_paged
            return own(self.attention, hidden_states, cache, attn_params, loras=loras, **kwargs)
        return self._single_row(hidden_states, cache, attn_params)  # the library's branch reads no other kwargs

    def _takes(self, hidden_states, cache, attn_params, loras) -> bool:
        """A single fp16 row with no LoRA, on an fp16 cache, at the positions the cache lengths give."""
        return (
            hidden_states.numel() == self.hidden
            and hidden_states.dtype == torch.half
            and not loras
            and cache is not None
            and cache.q_block == 0
            and cache.dtype == torch.half
            and not attn_params.alt_rope_embed
            and attn_params.rope_offsets is None
        )

    def _single_row(self, hidden_states, cache, attn_params) -> torch.Tensor:
        """exllamav2 0.3.2's unquantized `forward_paged` at one row (exllamav2/attn.py), but for its RoPE and its
        residual add."""
        from exlnb.engines.gemv import row_times_matrix_plus  # imports triton: only where a GPU engine loads

        attention = self.attention
        heads, kv_heads, dim = attention.num_attention_heads, attention.num_key_value_heads, attention.head_dim
        page_size = attn_params.page_size
        cache_seqlens = attn_params.get_cache_seqlens(attention.device_idx)
        block_table = attn_params.get_block_index(attention.device_idx)
        k_cache_f, v_cache_f = cache.get_kv_state(attention.layer_idx, 1, 0, 0, page_size, cache_seqlens, block_table)
        k_cache = k_cache_f.view(k_cache_f.shape[1] // page_size, page_size, *k_cache_f.shape[2:])
        v_cache = v_cache_f.view(v_cache_f.shape[1] // page_size, page_size, *v_cache_f.shape[2:])

        if self.rope_in_product:
            q, k, v = self.folded.roped(hidden_states, *self._sin_cos(), cache_seqlens)
        elif self.folded is not None:
            q, k, v = self.folded.products(hidden_states)
        else:
            x = attention.pre_layernorm.forward(hidden_states) if attention.has_norm else hidden_states
            q, k, v = (
                projection.forward(x, loras=None)
                for projection in (attention.q_proj, attention.k_proj, attention.v_proj)
            )
        q, k, v = q.view(1, 1, heads, dim), k.view(1, 1, kv_heads, dim), v.view(1, 1, kv_heads, dim)
        if attention.q_norm is not None:
            q, k = attention.q_norm.forward(q), attention.k_norm.forward(k)
        if not self.rope_in_product:
            self._rope(q, k, cache_seqlens)

        seqlens = cache_seqlens
        if attn_params.is_sequential:  # eager batch-1 steps: the library copies the new key and value in itself
            slot = slice(attn_params.first_index, attn_params.first_index + 1)
            k_cache_f[:, slot].copy_(k)
            v_cache_f[:, slot].copy_(v)
            k = v = None
            seqlens = attn_params.get_cache_seqlens_after(attention.device_idx)
        out = self.library.flash_attn_with_kvcache(
            q=q,
            k=k,
            v=v,
            k_cache=k_cache,
            v_cache=v_cache,
            cache_seqlens=seqlens,
            block_table=block_table,
            causal=True,
            softmax_scale=attention.scaling,
            **self._flash_options(),
        )  # an fp16 cache's `store_kv_state` does nothing: not called
        return row_times_matrix_plus(out.view(1, 1, heads * dim), self.o_weight, hidden_states)

    def _rope(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> None:
        """The library's `rope_` on q and on k, in place; one call over both where they lie side by side."""
        attention, library = self.attention, self.library
        style = attention.archparams.rope_style
        if style == library.RopeStyle.NONE:
            return
        sin, cos = self._sin_cos()
        both = side_by_side(q, k)
        dim = attention.head_dim
        for heads in (q, k) if both is None else (both,):  # one row: its head count is its number of rows
            library.ext_c.rope_(
                heads, sin, cos, 0, heads.numel() // dim, dim, positions, style == library.RopeStyle.NEOX
            )

    def _sin_cos(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's sin and cos tables, as the library reads them at call time."""
        attention = self.attention
        constants = attention.model.get_device_context(attention.device_idx, scratch=False)
        return constants.sin[attention.rope_index], constants.cos[attention.rope_index]

    def _flash_options(self) -> dict:
        """The window and softcap the library passes, read from its flags at call time as it reads them."""
        attention, options = self.attention, {}
        window, softcap = attention.sliding_window, attention.model.config.attn_logit_softcapping
        if window and self.library.has_flash_attn_with_window:
            options["window_size"] = (window, window)
        if softcap and self.library.has_flash_attn_with_softcap:
            options["softcap"] = softcap
        return options

    def differs(self) -> float:
        """The tail's largest difference from the library's own `forward_paged` on a random row at a random position
        of a scratch page of random keys and values, over its output and over the page each writes, in both ways a
        step writes its key (eager batch-1 steps copy it to its slot; graph replays let the attention write it). 0:
        the same bits, as it should be, but for a folded norm, whose sums run in another order."""
        from exllamav2.generator.dynamic import PAGED_PAGE_SIZE

        attention, device = self.attention, self.o_weight.device
        shape = (1, PAGED_PAGE_SIZE, attention.num_key_value_heads, attention.head_dim)
        page = _ScratchPage(*(random_probe(*shape, dtype=torch.half, device=device, seed=seed) for seed in (1, 2)))
        position = int(torch.randint(0, PAGED_PAGE_SIZE, (), generator=torch.Generator().manual_seed(0)))
        x = random_probe(1, 1, self.hidden, dtype=torch.half, device=device)
        worst = 0.0
        for sequential in (True, False):
            own_page, tail_page = page.clone(), page.clone()
            own = type(attention).forward_paged(attention, x.clone(), own_page, _first_page(position, sequential))
            mine = self._single_row(x.clone(), tail_page, _first_page(position, sequential))
            worst = max(
                worst,
                relative_difference(mine.float(), own.float()),
                relative_difference(tail_page.keys.float(), own_page.keys.float()),
                relative_difference(tail_page.values.float(), own_page.values.float()),
            )
        return worst


def _first_page(position: int, sequential: bool):
    """Paged parameters for one sequence of `position` tokens on page 0, its new key written by the attention or,
    `sequential`, copied to its slot first (the library's choice for a batch of one; graph replays turn it off)."""
    from exllamav2.attn_params import PagedParams
    from exllamav2.generator.dynamic import PAGED_PAGE_SIZE

    seqlens = torch.tensor([position], dtype=torch.int32)
    params = PagedParams(1, torch.zeros((1, 1), dtype=torch.int32), seqlens, position + 1, PAGED_PAGE_SIZE, q_len=1)
    params.is_sequential = sequential
    return params


def has_a_plain_tail(attention, o_is_plain: Callable[[object], bool]) -> bool:
    """Whether an exllamav2 attention's `forward_paged` ends in nothing but its o product and the residual add (no
    tensor parallelism, quantized matrices, post-norm or fp32 residual stream), its o a plain fp16 product
    (`o_is_plain`: the check the GEMV's own single-row products pass)."""
    return (
        not getattr(attention, "is_tp", False)
        and attention.q_handle is None
        and attention.post_layernorm is None
        and attention.has_residual
        and not attention.archparams.residual_stream_fp32
        and o_is_plain(attention.o_proj)
        and attention.o_proj.linear.weight.dtype == torch.half
    )


def attention_tails(
    model, o_is_plain: Callable[[object], bool], groups: list[ProductGroup | None]
) -> Iterator[AttentionTail]:
    """Each unquantized attention of the model that `has_a_plain_tail`, once the library's attention is the one
    the tail mirrors; where the attention's fold is on (`folded_tails`), its norm folded into its q, k and v where
    they are one of `groups` (the model's fused groups)."""
    import exllamav2
    from exllamav2 import attn

    from exlnb.engines.exllamav2.paged_attention import VERIFIED_EXLLAMAV2

    if exllamav2.__version__ != VERIFIED_EXLLAMAV2:
        raise RuntimeError(
            f"the attention tail mirrors exllamav2 {VERIFIED_EXLLAMAV2}'s forward_paged, found "
            f"{exllamav2.__version__}: set EXLNB_ATTENTION_TAIL=0"
        )
    for name, names in _PINS.items():
        missing = set(names) - set(getattr(attn.ExLlamaV2Attention, name).__code__.co_names)
        if missing:
            raise RuntimeError(
                f"exllamav2's ExLlamaV2Attention.{name} no longer reads {sorted(missing)}: set EXLNB_ATTENTION_TAIL=0"
            )
    for module in model.modules:
        if type(module) is attn.ExLlamaV2Attention and has_a_plain_tail(module, o_is_plain):
            qkv = [module.q_proj, module.k_proj, module.v_proj]
            folded = folded_norm(module.pre_layernorm, groups, qkv) if module.has_norm else None
            yield AttentionTail(module, attn, folded)
