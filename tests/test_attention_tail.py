"""The ExLlamaV2 engine's attention tail (engines/exllamav2/attention_tail.py, `EXLNB_ATTENTION_TAIL=1`). On the
CPU, over stand-ins for exllamav2's attention, its RoPE kernel and exlnb's GEMV (which need CUDA and triton), with
exlnb's paged attention on its PyTorch path: which calls take the tail and which the library's own `forward_paged`,
that the tail's output and written cache are the library's, that q and k side by side take one RoPE call, and which
attentions qualify. On the GPU: each tail against the library's `forward_paged` bit for bit, with its RoPE calls
counted, on Llama-2-7B's widths (q, k and v one fused product) and under grouped-query attention (q apart); and the
same greedy tokens with the tails as without."""

from __future__ import annotations

import sys
from enum import IntEnum
from types import SimpleNamespace

import pytest
import torch

from benchmarks.paged_acceptance import QUESTIONS
from exlnb.engines.exllamav2 import paged_attention
from exlnb.engines.exllamav2.attention_tail import (
    ATTENTION_TAILS,
    AttentionTail,
    attention_tail_on,
    has_a_plain_tail,
    side_by_side,
)
from exlnb.engines.exllamav2.folded_norm import FoldedNorm, folded_tails, norm_in_product_on
from exlnb.engines.fused_products import FusedProducts, ProductGroup, check_tails
from exlnb.random_model import LLAMA_7B, random_llama
from exlnb.templates import chatml
from tests.test_fused_products import WIDE, StandInTail, load, wide_folder  # noqa: F401 (a fixture)

PAGE = 16  # tokens a page of the stand-in cache
HEADS, DIM = 4, 8


class _RopeStyle(IntEnum):  # exllamav2.architecture.RopeStyle
    NONE = 0
    GPTJ = 1
    NEOX = 2


class _Library:
    """A stand-in for `exllamav2.attn` on the CPU: `rope_` as rope.cu indexes it, NEOX style, exlnb's paged attention
    (its PyTorch path), and the flags `forward_paged` reads. It records the head count each RoPE call was given."""

    RopeStyle = _RopeStyle
    has_flash_attn_with_window = True
    has_flash_attn_with_softcap = True
    flash_attn_with_kvcache = staticmethod(paged_attention.flash_attn_with_kvcache)

    def __init__(self) -> None:
        self.rope_heads: list[int] = []
        self.ext_c = SimpleNamespace(rope_=self._rope_)

    def _rope_(self, x, sin, cos, past_len, num_heads, head_dim, offsets, neox) -> None:
        """In place over x read as rope.cu reads it (contiguous rows of head_dim); row r of sequence b at position
        `past_len + offsets[b] + r // num_heads`."""
        assert x.is_contiguous() and neox
        self.rope_heads.append(num_heads)
        rows = x.view(x.shape[0], -1, head_dim)
        positions = (past_len + offsets.long()[:, None] + torch.arange(rows.shape[1]) // num_heads).clamp_min(0)
        half = sin.shape[-1] // 2
        s, c = sin[positions, :half].float(), cos[positions, :half].float()
        left, right = rows[..., :half].float(), rows[..., half : 2 * half].float()
        rows[..., :half] = (left * c - right * s).half()
        rows[..., half : 2 * half] = (right * c + left * s).half()


def _tables(positions: int = 64, dim: int = DIM, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """sin and cos tables as exllamav2 keeps them: (positions, dim), each frequency twice."""
    angles = torch.arange(positions)[:, None] * base ** (-torch.arange(0, dim, 2) / dim)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.sin().half(), angles.cos().half()


class _Projection:
    """A stand-in for an fp16 `ExLlamaV2Linear`: weight (in, out), its `nn.Linear`'s (out, in), its forward the
    product."""

    def __init__(self, inputs: int, outputs: int) -> None:
        self.weight = (torch.randn(inputs, outputs) * inputs**-0.5).half()
        self.linear = SimpleNamespace(weight=SimpleNamespace(data=self.weight.t().contiguous(), dtype=torch.half))

    def forward(self, x: torch.Tensor, loras=None) -> torch.Tensor:
        return x @ self.weight


class _Attention:
    """A stand-in for exllamav2 0.3.2's unquantized `ExLlamaV2Attention`, its q, k and v in one fused group (k and
    v alone where there are fewer key heads, as exlnb groups them): `forward` sends paged calls to
    `self.forward_paged`, and `forward_paged` is the library's unquantized branch, step for step."""

    def __init__(self, library: _Library, kv_heads: int = HEADS, rope_style: _RopeStyle = _RopeStyle.NEOX) -> None:
        torch.manual_seed(0)
        self.library, self.own_calls = library, 0
        self.num_attention_heads, self.num_key_value_heads, self.head_dim = HEADS, kv_heads, DIM
        self.hidden = HEADS * DIM
        self.layer_idx, self.device_idx, self.rope_index = 0, 0, 0
        self.has_norm, self.pre_layernorm = True, SimpleNamespace(forward=lambda x: x * 0.5)
        self.q_norm = self.k_norm = self.post_layernorm = self.q_handle = None
        self.has_residual, self.is_tp, self.sliding_window, self.scaling = True, False, 0, DIM**-0.5
        self.archparams = SimpleNamespace(rope_style=rope_style, residual_stream_fp32=False)
        sin, cos = _tables()
        self.model = SimpleNamespace(
            config=SimpleNamespace(attn_logit_softcapping=0.0),
            get_device_context=lambda index, scratch=True: SimpleNamespace(sin=[sin], cos=[cos]),
        )
        self.q_proj = _Projection(self.hidden, HEADS * DIM)
        self.k_proj, self.v_proj = (_Projection(self.hidden, kv_heads * DIM) for _ in range(2))
        self.o_proj = _Projection(HEADS * DIM, self.hidden)
        grouped = [self.q_proj, self.k_proj, self.v_proj] if kv_heads == HEADS else [self.k_proj, self.v_proj]
        stacked = torch.stack([p.weight for p in grouped])
        self.group = ProductGroup(grouped, stacked, torch.half, lambda args, kwargs: not kwargs.get("loras"))

    def forward(self, hidden_states, cache=None, attn_params=None, past_len=None, intermediates=False, loras=None):
        return self.forward_paged(hidden_states, cache, attn_params, loras=loras)

    def forward_paged(self, hidden_states, cache=None, attn_params=None, loras=None, **kwargs):
        self.own_calls += 1
        library, heads, kv_heads, dim = self.library, HEADS, self.num_key_value_heads, DIM
        page_size = attn_params.page_size
        batch, q_len, _ = hidden_states.shape
        seqlens, table = attn_params.get_cache_seqlens(0), attn_params.get_block_index(0)
        k_cache_f, v_cache_f = cache.get_kv_state(0, batch, 0, 0, page_size, seqlens, table)
        k_cache = k_cache_f.view(-1, page_size, kv_heads, dim)
        v_cache = v_cache_f.view(-1, page_size, kv_heads, dim)
        constants = self.model.get_device_context(0, scratch=False)
        sin, cos = attn_params.get_alt_rope_embed(0) or (constants.sin[0], constants.cos[0])
        offsets = attn_params.get_rope_offsets(0)
        rope_positions = seqlens if offsets is None else seqlens + offsets
        residual = hidden_states
        x = self.pre_layernorm.forward(hidden_states)
        q = self.q_proj.forward(x, loras=loras).view(batch, q_len, heads, dim)
        k = self.k_proj.forward(x, loras=loras).view(batch, q_len, kv_heads, dim)
        v = self.v_proj.forward(x, loras=loras).view(batch, q_len, kv_heads, dim)
        if self.archparams.rope_style != _RopeStyle.NONE:
            for t, count in ((q, heads), (k, kv_heads)):
                library.ext_c.rope_(t, sin, cos, 0, count, dim, rope_positions, True)
        seqlens_after = seqlens
        if attn_params.is_sequential:
            k_cache_f[:, attn_params.first_index : attn_params.first_index + q_len].copy_(k)
            v_cache_f[:, attn_params.first_index : attn_params.first_index + q_len].copy_(v)
            k = v = None
            seqlens_after = attn_params.get_cache_seqlens_after(0)
        out = library.flash_attn_with_kvcache(
            q=q,
            k=k,
            v=v,
            k_cache=k_cache,
            v_cache=v_cache,
            cache_seqlens=seqlens_after,
            block_table=table,
            causal=True,
            softmax_scale=self.scaling,
        )
        hidden_states = self.o_proj.forward(out.view(batch, q_len, heads * dim), loras=loras)
        hidden_states += residual
        return hidden_states


class _Params:
    """A stand-in for exllamav2's `PagedParams`: sequence b holds `seqlens[b]` tokens in pages `table[b]`."""

    def __init__(self, seqlens, table, q_len=1, sequential=False, alt_rope_embed=None, rope_offsets=None):
        self.page_size, self.is_sequential = PAGE, sequential
        self.cache_seqlens = torch.tensor(seqlens, dtype=torch.int32)
        self.block_index = torch.tensor(table, dtype=torch.int32)
        self.first_index = table[0][seqlens[0] // PAGE] * PAGE + seqlens[0] % PAGE
        self.cache_seqlens_after = self.cache_seqlens + q_len
        self.alt_rope_embed, self.rope_offsets = alt_rope_embed or {}, rope_offsets

    def get_cache_seqlens(self, device):
        return self.cache_seqlens

    def get_block_index(self, device):
        return self.block_index

    def get_cache_seqlens_after(self, device):
        return self.cache_seqlens_after

    def get_alt_rope_embed(self, device):
        return self.alt_rope_embed.get("cpu")

    def get_rope_offsets(self, device):
        return self.rope_offsets


class _Cache:
    """A stand-in for an `ExLlamaV2Cache` layer of two pages of random keys and values."""

    def __init__(self, kv_heads: int, q_block: int = 0, dtype: torch.dtype = torch.half) -> None:
        self.q_block, self.dtype = q_block, dtype
        self.keys, self.values = (torch.randn(1, 2 * PAGE, kv_heads, DIM).half() for _ in range(2))

    def get_kv_state(self, *args):
        return self.keys, self.values

    def store_kv_state(self, *args) -> None:
        pass

    def clone(self) -> _Cache:
        twin = _Cache(self.keys.shape[2], self.q_block, self.dtype)
        twin.keys, twin.values = self.keys.clone(), self.values.clone()
        return twin


@pytest.fixture
def gemv_rows(monkeypatch) -> list[torch.Size]:
    """exlnb's GEMV with the residual (which needs triton) as a stand-in: o's product, then the add, as torch
    does them in the stand-in library's `forward_paged`. Lists the rows it took."""
    rows = []

    def row_times_matrix_plus(x, weight, residual):
        rows.append(x.shape)
        return x @ weight.t() + residual

    monkeypatch.setitem(sys.modules, "exlnb.engines.gemv", SimpleNamespace(row_times_matrix_plus=row_times_matrix_plus))
    return rows


def _tailed(kv_heads: int = HEADS, rope_style: _RopeStyle = _RopeStyle.NEOX):
    library = _Library()
    attention = _Attention(library, kv_heads, rope_style)
    fused = FusedProducts([attention.group], tails=iter([AttentionTail(attention, library)]))
    return library, attention, fused


@pytest.mark.parametrize("sequential", [False, True], ids=["attention-writes", "copied-first"])
@pytest.mark.parametrize(
    "kv_heads, rope_style, rope_heads",
    [(HEADS, _RopeStyle.NEOX, [2 * HEADS]), (2, _RopeStyle.NEOX, [HEADS, 2]), (HEADS, _RopeStyle.NONE, [])],
    ids=["q-k-side-by-side", "grouped-query", "no-rope"],
)
def test_a_single_row_takes_the_tail_and_gives_the_library_s_output_and_cache(
    gemv_rows, kv_heads, rope_style, rope_heads, sequential
):
    """q and k out of one fused product take one RoPE call over both; q apart from k (grouped-query attention), a
    call each, as the library makes them; the residual is added in o's product. Output and pages as the library's."""
    library, attention, _ = _tailed(kv_heads, rope_style)
    torch.manual_seed(1)
    for position in (5, PAGE + 3):  # on the sequence's second page, which is the cache's first
        ours = _Cache(kv_heads)
        theirs = ours.clone()
        x = torch.randn(1, 1, attention.hidden).half()
        expected = type(attention).forward_paged(
            attention, x, theirs, _Params([position], [[1, 0]], sequential=sequential)
        )
        library.rope_heads.clear()
        attention.own_calls = 0

        out = attention.forward(x, cache=ours, attn_params=_Params([position], [[1, 0]], sequential=sequential))
        assert library.rope_heads == rope_heads and attention.own_calls == 0
        assert torch.equal(out, expected)
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
        assert not torch.equal(out, x)  # the row went through the layer
    assert len(gemv_rows) == 2


@pytest.mark.parametrize(
    "rope_style, status",
    [
        (_RopeStyle.NEOX, "attention tails with the norm and RoPE in q, k and v and the residual in o"),
        (_RopeStyle.NONE, "attention tails with the norm in q, k and v and the residual in o"),
    ],
    ids=["neox-rope-in-the-product", "no-rope"],
)
def test_a_folded_norm_runs_inside_q_k_and_v_and_gives_the_library_s_output(gemv_rows, monkeypatch, rope_style, status):
    """`EXLNB_NORM_IN_PRODUCT=1`: the row goes to the fused group's stack with its norm, and with NEOX RoPE on q and k
    at the step's position, in one launch (here stand-ins for normed_gemv's kernels, which need triton, computing
    the stand-in norm, the group's product and the stand-in library's RoPE as they compute them); neither the norm's
    own forward nor the library's `rope_` is called; the output and the pages are the library's; the status names
    the fold."""
    library, attention, _ = _tailed(rope_style=rope_style)
    stacks = []

    def normed_row_times_stack(x, weight, eps, stack):
        stacks.append(stack)
        rows = (x.reshape(1, 1, -1) * 0.5).expand(stack.shape[0], -1, -1)  # the stand-in norm, as _Attention's
        return torch.bmm(rows, stack).view(stack.shape[0], -1)

    def normed_roped_rows(x, weight, eps, stack, rotated, sin, cos, positions):
        rows = normed_row_times_stack(x, weight, eps, stack)
        for slot in rotated:
            _Library()._rope_(rows[slot].view(1, -1), sin, cos, 0, HEADS, DIM, positions, True)
        return rows

    monkeypatch.setitem(
        sys.modules,
        "exlnb.engines.normed_gemv",
        SimpleNamespace(normed_row_times_stack=normed_row_times_stack, normed_roped_rows=normed_roped_rows),
    )
    folded = FoldedNorm(attention.group.stacked, (0, 1, 2), torch.ones(attention.hidden).half(), 1e-5)
    tail = AttentionTail(attention, library, folded)
    fused = FusedProducts([attention.group], tails=iter([tail]))
    norms = []
    norm = attention.pre_layernorm.forward
    attention.pre_layernorm = SimpleNamespace(forward=lambda x: norms.append(x.shape) or norm(x))
    x, ours = torch.randn(1, 1, attention.hidden).half(), _Cache(HEADS)
    theirs = ours.clone()
    expected = type(attention).forward_paged(attention, x, theirs, _Params([5], [[1, 0]]))
    norms.clear()
    library.rope_heads.clear()

    out = attention.forward(x, cache=ours, attn_params=_Params([5], [[1, 0]]))

    assert norms == [] and library.rope_heads == [] and len(stacks) == 1 and stacks[0] is attention.group.stacked
    assert torch.equal(out, expected)
    assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    assert fused.describe() == f"1 fp16 projection groups fused, 1 {status}"
    attention.forward(
        torch.randn(2, 1, attention.hidden).half(), cache=_Cache(HEADS), attn_params=_Params([5, 2], [[1, 0], [0, 1]])
    )
    assert len(norms) == 1 and len(stacks) == 1  # a batch takes the library's norm and products


def test_every_other_call_takes_the_library_s_forward_paged(gemv_rows):
    """Batches, several positions, LoRAs, alternative or offset RoPE and caches other than fp16's take the library's
    own `forward_paged`, as does a single row once the tails are uninstalled."""
    library, attention, fused = _tailed()
    one = torch.randn(1, 1, attention.hidden).half()
    sin, cos = _tables(base=500.0)
    calls = [
        (torch.randn(3, 1, attention.hidden).half(), _Cache(HEADS), _Params([5, 2, 9], [[1, 0], [0, 1], [1, 0]]), {}),
        (torch.randn(1, 2, attention.hidden).half(), _Cache(HEADS), _Params([5], [[1, 0]], q_len=2), {}),
        (one, _Cache(HEADS), _Params([5], [[1, 0]]), {"loras": ["a LoRA"]}),
        (one, _Cache(HEADS), _Params([5], [[1, 0]], alt_rope_embed={"cpu": (sin, cos)}), {}),
        (one, _Cache(HEADS), _Params([5], [[1, 0]], rope_offsets=torch.tensor([3], dtype=torch.int32)), {}),
        (one, _Cache(HEADS, dtype=torch.uint8), _Params([5], [[1, 0]]), {}),
        (one, _Cache(HEADS, q_block=1), _Params([5], [[1, 0]]), {}),
    ]
    for count, (x, cache, params, options) in enumerate(calls, start=1):
        attention.forward(x, cache=cache, attn_params=params, **options)
        assert attention.own_calls == count
    assert gemv_rows == [] and set(library.rope_heads) == {HEADS}  # q and k a call each, as the library makes them
    assert fused.describe() == "1 fp16 projection groups fused, 1 attention tails with the residual in o"
    fused.uninstall()
    assert "forward_paged" not in vars(attention)
    attention.forward(one, cache=_Cache(HEADS), attn_params=_Params([5], [[1, 0]]))
    assert attention.own_calls == len(calls) + 1 and gemv_rows == []


def test_heads_side_by_side_in_one_allocation_are_one_view_and_any_others_none():
    products = torch.randn(3, 1, HEADS * DIM).half()  # a fused group's outputs, as `ProductGroup` hands them over
    q, k, v = (y.view(1, 1, HEADS, DIM) for y in products.unbind(0))
    both = side_by_side(q, k)
    assert both.shape == (1, 2 * HEADS, DIM) and both.data_ptr() == q.data_ptr()
    assert torch.equal(both[0, :HEADS], q[0, 0]) and torch.equal(both[0, HEADS:], k[0, 0])
    assert side_by_side(k, q).data_ptr() == q.data_ptr()  # either order: every head is at the one row's position
    both[0, HEADS] = 0.0
    assert float(k[0, 0, 0].abs().sum()) == 0.0  # a view: RoPE in place reaches k
    assert side_by_side(q, v) is None  # k lies between them
    assert side_by_side(q, torch.randn(1, 1, HEADS, DIM).half()) is None  # another allocation
    wider = torch.randn(2, 1, HEADS * 2 * DIM).half()
    assert side_by_side(wider[0].view(1, 1, HEADS, 2 * DIM), wider[1].view(1, 1, 2 * HEADS, DIM)) is None


@pytest.mark.parametrize(
    "change",
    [
        lambda a: setattr(a, "is_tp", True),
        lambda a: setattr(a, "q_handle", object()),
        lambda a: setattr(a, "post_layernorm", SimpleNamespace(forward=lambda x: x)),
        lambda a: setattr(a, "has_residual", False),
        lambda a: setattr(a.archparams, "residual_stream_fp32", True),
        lambda a: setattr(a.o_proj.linear.weight, "dtype", torch.float32),
    ],
    ids=["tensor-parallel", "quantized", "post-norm", "no-residual", "fp32-residual-stream", "fp32-o"],
)
def test_an_attention_that_does_more_after_o_or_runs_otherwise_has_no_tail(change):
    attention = _Attention(_Library())
    assert has_a_plain_tail(attention, lambda o: True)
    assert not has_a_plain_tail(attention, lambda o: o is not attention.o_proj)  # o not a plain fp16 product
    change(attention)
    assert not has_a_plain_tail(attention, lambda o: True)


def test_each_kind_of_tail_is_counted_apart_and_refused_in_its_own_words():
    fused = FusedProducts(
        tails=iter([StandInTail(0.0), StandInTail(0.0, ATTENTION_TAILS), StandInTail(0.0, ATTENTION_TAILS)])
    )
    assert fused.describe() == "1 MLP tails in two kernels, 2 attention tails with the residual in o"
    assert check_tails(fused) is None
    reason = check_tails(FusedProducts(tails=iter([StandInTail(0.0), StandInTail(0.5, ATTENTION_TAILS)])))
    assert reason is not None and "an attention's tail differs" in reason and "0.5" in reason and "\n" not in reason


@pytest.mark.parametrize(
    "value, folded",
    [(None, ("attention",)), ("0", ()), ("1", ("attention", "mlp")), ("attention", ("attention",)), ("mlp", ("mlp",))],
)
def test_the_norm_folds_into_the_tails_the_switch_names(monkeypatch, value, folded):
    if value is None:
        monkeypatch.delenv("EXLNB_NORM_IN_PRODUCT", raising=False)
    else:
        monkeypatch.setenv("EXLNB_NORM_IN_PRODUCT", value)
    assert folded_tails() == folded and norm_in_product_on() is bool(folded)


def test_a_fold_the_engine_does_not_know_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("EXLNB_NORM_IN_PRODUCT", "qkv")
    with pytest.raises(ValueError, match=r"^EXLNB_NORM_IN_PRODUCT='qkv': one of 0, 1, attention, mlp$"):
        folded_tails()


def test_the_switch_is_on_unless_set_to_0(monkeypatch):
    monkeypatch.delenv("EXLNB_ATTENTION_TAIL", raising=False)
    assert attention_tail_on()
    monkeypatch.setenv("EXLNB_ATTENTION_TAIL", "1")
    assert attention_tail_on()
    monkeypatch.setenv("EXLNB_ATTENTION_TAIL", "0")
    assert not attention_tail_on()


# -- on the GPU ------------------------------------------------------------------------------------------------

GROUPED = dict(
    LLAMA_7B, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)  # k and v one fused product, q a product of its own: apart from k


@pytest.fixture(scope="module")
def grouped_folder():
    if not torch.cuda.is_available():
        pytest.skip("the attention tail runs on CUDA")
    with random_llama(GROUPED) as (path, _):
        yield path


def _against_the_library(engine) -> list[tuple]:
    """Each tail's single row and the library's `forward_paged` on twin caches of random keys and values, in both
    ways a step writes its key, with the rows of each `rope_` call each made, and the tail's load check."""
    from exllamav2 import attn
    from exllamav2.attn_params import PagedParams
    from exllamav2.cache import ExLlamaV2Cache

    real, rope_rows = attn.ext_c, []

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def rope_(self, x, *args):
            rope_rows.append(x.numel() // x.shape[-1])
            return real.rope_(x, *args)

    def params(position: int, sequential: bool) -> PagedParams:
        seqlens = torch.tensor([position], dtype=torch.int32)
        made = PagedParams(1, torch.zeros((1, 1), dtype=torch.int32), seqlens, position + 1, engine.page_size, q_len=1)
        made.is_sequential = sequential
        return made

    results = []
    attn.ext_c = Counting()
    try:
        with torch.inference_mode():
            ours = ExLlamaV2Cache(engine.model, max_seq_len=engine.page_size)
            for layer in ours.key_states + ours.value_states:
                layer.normal_()
            for tail in engine.fused.tails:
                for sequential in (True, False):
                    theirs = ours.clone()
                    position = int(torch.randint(1, engine.page_size, ()))
                    x = torch.randn((1, 1, tail.hidden), dtype=torch.half, device=tail.o_weight.device)
                    rope_rows.clear()
                    mine = tail.attention.forward(x.clone(), cache=ours, attn_params=params(position, sequential))
                    mine_rows = list(rope_rows)
                    rope_rows.clear()
                    own = type(tail.attention).forward_paged(tail.attention, x, theirs, params(position, sequential))
                    pages = zip(ours.key_states + ours.value_states, theirs.key_states + theirs.value_states)
                    same_pages = all(torch.equal(a, b) for a, b in pages)
                    results.append((mine, own, same_pages, mine_rows, list(rope_rows), tail.differs()))
    finally:
        attn.ext_c = real
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("model, shape", [("wide_folder", WIDE), ("grouped_folder", GROUPED)], ids=["wide", "grouped"])
def test_each_tail_gives_the_library_s_bits_and_ropes_q_and_k_in_one_call_where_they_lie_side_by_side(
    model, shape, monkeypatch, request
):
    folder = request.getfixturevalue(model)
    monkeypatch.setenv("EXLNB_ATTENTION_TAIL", "1")
    monkeypatch.setenv("EXLNB_MLP_TAIL", "0")  # this test's tails alone, whatever the suite sets
    monkeypatch.setenv("EXLNB_NORM_IN_PRODUCT", "0")  # the library's bits: no norm folded in
    session = load(folder, "exllamav2")
    try:
        layers, heads, kv_heads = (
            shape[key] for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads")
        )
        assert f"{layers} attention tails with the residual in o" in session.status().decode
        assert not any("not fused" in note for note in session.status().notes)
        results = session.run_on_engine(_against_the_library)
        assert len(results) == 2 * layers
        for mine, own, same_pages, mine_rows, own_rows, differs in results:
            assert torch.equal(mine, own) and same_pages and differs == 0.0
            assert own_rows == [heads, kv_heads]
            assert mine_rows == ([heads + kv_heads] if heads == kv_heads else [heads, kv_heads])
    finally:
        session.unload()


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "wide_folder"])
def test_greedy_tokens_with_the_attention_tail_are_those_without(model, monkeypatch, request):
    """CUDA graphs on (a load holds each replay to the eager step, both with the tails): the same greedy tokens with
    the tails as without, on the bundled model (grouped-query: q apart from k) and on Llama-2-7B's widths."""
    from exlnb.engines.job_options import JobOptions
    from exlnb.engines.sampling import SamplerSettings

    if not torch.cuda.is_available():
        pytest.skip("the ExLlamaV2 engine needs CUDA")
    folder = request.getfixturevalue(model) if model.endswith("_folder") else model
    options = JobOptions(max_new_tokens=32, sampler=SamplerSettings.greedy(), stop_at_eos=False)
    tokens = {}
    monkeypatch.setenv("EXLNB_MLP_TAIL", "0")  # this test's tails alone, whatever the suite sets
    monkeypatch.setenv("EXLNB_NORM_IN_PRODUCT", "0")  # the library's bits: no norm folded in
    for switch in ("0", "1"):
        monkeypatch.setenv("EXLNB_ATTENTION_TAIL", switch)
        session = load(folder, "exllamav2")
        try:
            tails = session.run_on_engine(lambda engine: len(engine.fused.tails))
            assert (tails > 0) == (switch == "1")
            assert session.status().decode.startswith("CUDA graphs"), session.status().notes
            streams = [session.submit(session.spec_for(chatml(q), options)) for q in QUESTIONS[:3]]
            tokens[switch] = [stream.result().token_ids for stream in streams]
        finally:
            session.unload()
    assert tokens["1"] == tokens["0"]


@pytest.mark.gpu
def test_a_tail_that_differs_is_dropped_at_load_and_the_products_kept(monkeypatch, request):
    """A load that finds a tail unlike the library's step keeps its fused products and single-row GEMVs, runs the
    library's own attention, and says why in a line."""
    monkeypatch.setenv("EXLNB_ATTENTION_TAIL", "1")
    monkeypatch.setenv("EXLNB_MLP_TAIL", "0")
    monkeypatch.setenv("EXLNB_NORM_IN_PRODUCT", "0")
    monkeypatch.setattr(AttentionTail, "differs", lambda self: 0.5)
    session = load(request.getfixturevalue("wide_folder"), "exllamav2")
    try:
        tails, rows, groups = session.run_on_engine(
            lambda engine: (len(engine.fused.tails), len(engine.fused.rows), len(engine.fused.groups))
        )
        assert tails == 0 and rows > 0 and groups > 0
        notes = [note for note in session.status().notes if note.startswith("step tails not used: ")]
        assert len(notes) == 1 and "an attention's tail differs" in notes[0] and "\n" not in notes[0]
        assert "attention tails" not in session.status().decode
    finally:
        session.unload()


@pytest.mark.gpu
def test_a_norm_folded_into_q_k_and_v_agrees_with_the_library_s_attention_to_the_load_s_tolerance(monkeypatch, request):
    """`EXLNB_NORM_IN_PRODUCT=1` on Llama-2-7B's widths (q, k and v one fused group after an RMS norm, NEOX RoPE over
    whole heads): the tail folds the norm and RoPE in, says so, and its load check, against the library's own
    attention at a random position (the new key and value it writes included), keeps it."""
    from exlnb.engines.cuda_graphs import beyond_tolerance

    for variable, value in (("EXLNB_ATTENTION_TAIL", "1"), ("EXLNB_NORM_IN_PRODUCT", "1"), ("EXLNB_MLP_TAIL", "0")):
        monkeypatch.setenv(variable, value)
    session = load(request.getfixturevalue("wide_folder"), "exllamav2")
    try:
        assert "1 attention tails with the norm and RoPE in q, k and v and the residual in o" in session.status().decode
        assert not any(note.startswith("step tails not used") for note in session.status().notes)
        errors = session.run_on_engine(lambda engine: [tail.differs() for tail in engine.fused.tails])
        assert len(errors) == 1 and not beyond_tolerance(errors[0])
        assert session.generate("The capital of France is", max_new_tokens=4).result().new_tokens > 0
    finally:
        session.unload()
