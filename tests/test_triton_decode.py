"""triton_decode's kernels against paged_attention's PyTorch path, on the calls exllamav2's decode steps make.

On CUDA (`-m gpu`) the dispatch sends them to the compiled kernels, eagerly and inside a CUDA graph. Without CUDA
the same comparisons run on CPU tensors in Triton's interpreter, which must be on before the kernels are defined:
this module sets TRITON_INTERPRET at its top where there is no CUDA. Skipped where triton is not installed.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass, replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from exlnb.engines.exllamav2 import paged_attention
from exlnb.engines.exllamav2.paged_attention import flash_attn_with_kvcache

PAGE = 256  # exllamav2's page size
LENGTHS = (1, 255, 256, 257, 4000)  # around a page's end, and a long context
FP16 = {"atol": 2e-3, "rtol": 2e-3}


@dataclass(frozen=True)
class Call:
    lengths: tuple[int, ...]  # tokens already in each sequence's cache
    group: int = 1  # query heads per key/value head
    dim: int = 128
    kv_heads: int = 2
    q_len: int = 1
    appends: bool = True  # the new keys come with the call; else they are in the cache already
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    extra_columns: int = 0  # block-table columns past the longest sequence, as the graph decoder pads them


def ragged(batch: int) -> tuple[int, ...]:
    """`batch` lengths from LENGTHS, starting at a different one for each batch size."""
    return tuple(LENGTHS[(batch + i) % len(LENGTHS)] for i in range(batch))


def inputs(call: Call, device: str, seed: int = 0) -> dict:
    """flash_attn_with_kvcache's arguments: each sequence on shuffled pages, page 0 in no sequence and full of NaN
    (block tables are padded with 0, as exllamav2 pads them), so reading past a sequence shows."""
    g = torch.Generator().manual_seed(seed)
    totals = [n + call.q_len if call.appends else n for n in call.lengths]
    needed = [math.ceil(t / PAGE) for t in totals]
    order = (torch.randperm(sum(needed), generator=g) + 1).tolist()
    table = torch.zeros(len(totals), max(needed) + call.extra_columns, dtype=torch.int32)
    for b, pages in enumerate(needed):
        table[b, :pages] = torch.tensor([order.pop() for _ in range(pages)], dtype=torch.int32)
    heads = call.kv_heads * call.group

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(torch.float16).to(device)

    k_cache, v_cache = (
        rand(sum(needed) + 1, PAGE, call.kv_heads, call.dim),
        rand(sum(needed) + 1, PAGE, call.kv_heads, call.dim),
    )
    k_cache[0] = v_cache[0] = math.nan
    new = (len(totals), call.q_len, call.kv_heads, call.dim)
    return {
        "q": rand(len(totals), call.q_len, heads, call.dim),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "k": rand(*new) if call.appends else None,
        "v": rand(*new) if call.appends else None,
        "cache_seqlens": torch.tensor(call.lengths if call.appends else totals, dtype=torch.int32, device=device),
        "block_table": table.to(device),
        "softmax_scale": call.dim**-0.5,
        "causal": call.causal,
        "window_size": call.window,
        "softcap": call.softcap,
    }


def copy(args: dict) -> dict:
    return {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in args.items()}


def on_pytorch_path(args: dict) -> torch.Tensor:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paged_attention, "TRITON_DECODE", False)
        return flash_attn_with_kvcache(**args)


def _triton_on_any_device(q, k_cache, v_cache) -> bool:
    from exlnb.engines import triton_decode

    return paged_attention.TRITON_DECODE and triton_decode.handles(q, k_cache, v_cache)


def _interpreter_refuses_numpy() -> bool:
    """triton 3.6's interpreter takes a loop bound with int() of a one-element array, which numpy 2.4 refuses
    (triton-lang/triton#9171, fixed after 3.6)."""
    import numpy
    import triton

    def version(module) -> tuple[int, ...]:
        return tuple(int(part) for part in module.__version__.split(".")[:2])

    return version(numpy) >= (2, 4) and version(triton) < (3, 7)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, monkeypatch) -> str:
    """Where the Triton path runs: compiled on CUDA through the dispatch, or on CPU tensors in the interpreter
    (the dispatch keeps CPU tensors on the PyTorch path, so the CPU tests step past its device check)."""
    if not paged_attention.triton_installed():
        pytest.skip("triton is not installed")
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if request.param == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CUDA is here, so the kernels compiled for it: the interpreter runs where there is none")
    if request.param == "cpu" and _interpreter_refuses_numpy():
        pytest.skip("triton's interpreter needs numpy<2.4 before triton 3.7 (triton-lang/triton#9171)")
    monkeypatch.setattr(paged_attention, "TRITON_DECODE", True)
    if request.param == "cpu":
        monkeypatch.setattr(paged_attention, "_decodes_on_triton", _triton_on_any_device)
    return request.param


def check_against_pytorch_path(call: Call, device: str) -> None:
    args = inputs(call, device)
    expected_args = copy(args)
    expected = on_pytorch_path(expected_args)
    assert paged_attention._decodes_on_triton(args["q"], args["k_cache"], args["v_cache"])

    out = flash_attn_with_kvcache(**args)

    assert out.shape == args["q"].shape and out.dtype == torch.float16
    torch.testing.assert_close(out.float(), expected.float(), **FP16)
    for cache in ("k_cache", "v_cache"):  # the new keys and values landed where the PyTorch path puts them
        torch.testing.assert_close(args[cache], expected_args[cache], atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4], ids=["mha", "gqa4"])
@pytest.mark.parametrize("batch", range(1, 9))
def test_decode_matches_the_pytorch_path_over_ragged_lengths(batch, group, dim, device):
    check_against_pytorch_path(Call(ragged(batch), group=group, dim=dim), device)


OTHER_CALLS = {
    "several queries per sequence (speculative verification)": Call((255, 300), group=4, q_len=5),
    "sixteen queries and eight heads a group: two row blocks": Call((40, 700), group=8, q_len=16, dim=64),
    "keys already in the cache": Call((1, 257, 513), group=4, appends=False),
    "sliding window across a split's edge": Call((600, 20), group=4, window=(300, 0)),
    "softcap": Call((255, 4000), group=2, softcap=30.0),
    "not causal, window to the right": Call((100, 260), q_len=4, causal=False, window=(-1, 2)),
    "a head size that is not a power of two": Call((255, 256), group=2, dim=80),
    "padded block table": Call((1, 255, 256), group=4, extra_columns=5),
}


@pytest.mark.parametrize("name", list(OTHER_CALLS))
def test_other_calls_match_the_pytorch_path(name, device):
    check_against_pytorch_path(OTHER_CALLS[name], device)


def test_a_sequence_s_output_is_the_same_alone_in_a_batch_and_in_a_wider_table(device):
    """Field report 2: a greedy answer must not change with its batch mates, nor with the graph decoder's width."""
    args = inputs(Call((257, *LENGTHS), group=4, extra_columns=3), device)
    in_batch = flash_attn_with_kvcache(**copy(args))

    # 257 + 1 keys on two pages (two splits), 1 + 1 on one (one split), 4000 + 1 on sixteen (sixteen splits)
    for sequence, pages in ((0, 2), (1, 1), (5, 16)):
        rows = slice(sequence, sequence + 1)
        alone = {
            name: value[rows] if name in ("q", "k", "v", "cache_seqlens") else value for name, value in args.items()
        }
        for columns in (pages, args["block_table"].shape[1]):  # no padding, and the batch's width
            alone["block_table"] = args["block_table"][rows, :columns]
            assert torch.equal(flash_attn_with_kvcache(**copy(alone)), in_batch[rows]), f"{sequence}, {columns}"


@pytest.mark.parametrize("keys_a_split", ["512", "1024"])
def test_longer_splits_agree_with_the_pytorch_path_and_keep_a_sequence_s_bits_in_any_batch(
    device, keys_a_split, monkeypatch
):
    """`EXLNB_DECODE_SPLIT_KEYS`: fewer, longer splits, read at each launch, still answer as the PyTorch path does,
    and a sequence's output still depends on neither its batch mates nor the table's width."""
    from exlnb.engines import triton_decode

    monkeypatch.setenv("EXLNB_DECODE_SPLIT_KEYS", keys_a_split)
    assert triton_decode.split_keys() == int(keys_a_split)
    check_against_pytorch_path(Call(ragged(3), group=4), device)
    args = inputs(Call((4000, 40), group=4, extra_columns=2), device)
    in_batch = flash_attn_with_kvcache(**copy(args))
    alone = {
        name: value[:1] if name in ("q", "k", "v", "cache_seqlens", "block_table") else value
        for name, value in args.items()
    }
    assert torch.equal(flash_attn_with_kvcache(**copy(alone)), in_batch[:1])


@pytest.mark.parametrize("name", ["ragged lengths up to sixteen splits", *OTHER_CALLS])
def test_the_call_s_keys_in_tiles_of_their_own_give_the_same_bits_and_cache(name, device, monkeypatch):
    """`EXLNB_DECODE_FRESH_APART=1`: the tiles before the call's first new key read the cache alone, the rest the
    call's keys as well, each tile's arithmetic as in one loop: the output and the pages written are the one
    loop's to the bit, on every call the engines make (new keys mid-tile, at a tile's or a page's start, several a
    sequence, keys in the cache already, windows, a padded table), at 256 keys a split and at 512."""
    from exlnb.engines import triton_decode

    call = Call(ragged(6), group=4) if name.startswith("ragged") else OTHER_CALLS[name]
    for keys_a_split in ("256", "512"):
        monkeypatch.setenv("EXLNB_DECODE_SPLIT_KEYS", keys_a_split)
        results = {}
        for apart in ("0", "1"):
            monkeypatch.setenv("EXLNB_DECODE_FRESH_APART", apart)
            assert triton_decode.fresh_tile_apart() == (apart == "1")
            args = inputs(call, device)
            results[apart] = (flash_attn_with_kvcache(**args), args["k_cache"], args["v_cache"])
        (one_loop, *one_loop_pages), (apart, *apart_pages) = results["0"], results["1"]
        assert torch.equal(apart, one_loop), keys_a_split
        for mine, theirs in zip(apart_pages, one_loop_pages, strict=True):
            assert torch.equal(mine.nan_to_num(), theirs.nan_to_num())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["ragged lengths up to sixteen splits", *OTHER_CALLS])
def test_the_kernels_launched_dependent_give_the_same_bits_and_cache(name, device, monkeypatch):
    """`EXLNB_DEPENDENT_LAUNCH=1` (and `early`) on a card of compute capability 9.0 or later: the split kernel waits
    for the kernel before it and the combine kernel for the splits, in their own programs; the output and the pages
    written are those of the kernels launched apart, on every call the engines make."""
    if device != "cuda" or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("dependent launch needs a card of compute capability 9.0")
    from exlnb.engines.dependent_launch import MODES, VARIABLE, dependent_launch

    call = Call(ragged(6), group=4) if name.startswith("ragged") else OTHER_CALLS[name]
    results = {}
    for mode in ("0", "1", "early"):
        monkeypatch.setenv(VARIABLE, mode)
        assert dependent_launch(torch.device("cuda")) == MODES[mode]
        args = inputs(call, device)
        results[mode] = (flash_attn_with_kvcache(**args), args["k_cache"], args["v_cache"])
    apart, *apart_pages = results["0"]
    for mode in ("1", "early"):
        dependent, *dependent_pages = results[mode]
        assert torch.equal(dependent, apart), mode
        for mine, theirs in zip(dependent_pages, apart_pages, strict=True):
            assert torch.equal(mine.nan_to_num(), theirs.nan_to_num()), mode


@pytest.mark.parametrize(
    "variable, read, value, wanted",
    [
        *(("EXLNB_DECODE_SPLIT_KEYS", "split_keys", value, "multiple of 64") for value in ("100", "0", "-256", "many")),
        *(("EXLNB_DECODE_SPLIT_WARPS", "split_warps", value, "1, 2, 4, 8 or 16") for value in ("3", "0", "32", "x")),
    ],
)
def test_a_split_size_or_warps_count_the_kernel_cannot_take_is_refused_in_one_line(
    variable, read, value, wanted, monkeypatch
):
    pytest.importorskip("triton")
    from exlnb.engines import triton_decode

    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=rf"^{variable}=.*{wanted}$") as error:
        getattr(triton_decode, read)()
    assert "\n" not in str(error.value)


def in_float64(args: dict) -> torch.Tensor:
    """Each sequence's one query over its cached keys and the call's new one, causal with no window, in float64."""
    heads, kv_heads = args["q"].shape[2], args["k_cache"].shape[2]
    rows = []
    for b, cached in enumerate(args["cache_seqlens"].tolist()):
        pages = args["block_table"][b]
        keys, values = (
            torch.cat([args[cache][pages].flatten(0, 1)[:cached], args[new][b]]).double()
            for cache, new in (("k_cache", "k"), ("v_cache", "v"))
        )
        keys, values = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (keys, values))
        scores = torch.einsum("qhd,khd->hqk", args["q"][b].double(), keys) * args["softmax_scale"]
        rows.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
    return torch.stack(rows)


def cut_pages(args: dict, tokens: int) -> dict:
    """The same call on the same slots, its caches cut into pages of `tokens`: page p of the call is pages
    p * PAGE / tokens onwards of the cut cache."""
    cut = dict(args)
    for cache in ("k_cache", "v_cache"):
        cut[cache] = args[cache].view(-1, tokens, *args[cache].shape[2:])
    table = args["block_table"]
    pieces = torch.arange(PAGE // tokens, device=table.device)
    cut["block_table"] = (table[:, :, None] * (PAGE // tokens) + pieces).flatten(1).to(torch.int32).contiguous()
    return cut


def test_decode_agrees_with_attention_in_float64(device):
    args = inputs(Call((1300, 40), group=4), device)
    expected = in_float64(copy(args))

    out = flash_attn_with_kvcache(**args)

    torch.testing.assert_close(out.double(), expected, **FP16)


def test_pages_of_64_tokens_are_read_as_pages_of_256(device):
    """A key tile lies within a page of any size `handles` takes, and its keys and their order do not depend on
    the pages they are on."""
    from exlnb.engines import triton_decode

    args = inputs(Call((1300, 40), group=4), device)
    small = cut_pages(args, 64)

    assert triton_decode.handles(small["q"], small["k_cache"], small["v_cache"])
    assert torch.equal(flash_attn_with_kvcache(**copy(small)), flash_attn_with_kvcache(**copy(args)))


def test_pages_that_cut_a_key_tile_stay_on_the_pytorch_path(device):
    """The kernel reads a key tile's page once, so a page must hold whole tiles; a cache of 16-token pages (as
    test_paged_attention's) is the PyTorch path's, and still answers."""
    from exlnb.engines import triton_decode

    args = inputs(Call((40, 3), group=2), device)
    small = cut_pages(args, 16)

    assert triton_decode.handles(args["q"], args["k_cache"], args["v_cache"])
    assert not triton_decode.handles(small["q"], small["k_cache"], small["v_cache"])
    torch.testing.assert_close(flash_attn_with_kvcache(**copy(small)), flash_attn_with_kvcache(**copy(args)), **FP16)


@pytest.mark.parametrize("name", ["ragged lengths up to sixteen splits", *OTHER_CALLS])
def test_a_call_made_twice_gives_the_same_bits_and_the_same_cache(name, device):
    """Field report 2 asks the same answer of the same inputs: no split reads a slot another program writes, so a
    second call, on a cache the first has written, gives the first call's output to the bit."""
    call = Call(ragged(6), group=4) if name.startswith("ragged") else OTHER_CALLS[name]
    args = inputs(call, device)
    first = flash_attn_with_kvcache(**args)
    again = copy(args)

    assert torch.equal(flash_attn_with_kvcache(**again), first)
    for cache in ("k_cache", "v_cache"):
        assert torch.equal(again[cache].nan_to_num(), args[cache].nan_to_num())


@pytest.mark.gpu
def test_a_decode_step_captured_in_a_cuda_graph_replays_new_inputs(device):
    if device != "cuda":
        pytest.skip("CUDA graphs need CUDA")
    call = Call(ragged(6), group=4)
    static = inputs(call, device)
    flash_attn_with_kvcache(**copy(static))  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    paged_attention.forget_layout()  # as the graph decoder does: the graph computes its own layout
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(**static)
    paged_attention.forget_layout()
    later = inputs(replace(call, lengths=tuple(reversed(call.lengths))), device, seed=1)
    for name, value in later.items():
        if isinstance(value, torch.Tensor):
            static[name].copy_(value)

    graph.replay()
    first = out.clone()
    graph.replay()

    torch.testing.assert_close(out.float(), on_pytorch_path(later).float(), **FP16)
    assert torch.equal(out, first)


def test_paged_attention_imports_and_runs_where_triton_is_missing():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from exlnb.engines.exllamav2.paged_attention import flash_attn_with_kvcache\n"
        "q = torch.randn(1, 1, 2, 8); cache = torch.randn(1, 16, 2, 8)\n"
        "out = flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=torch.tensor([3], dtype=torch.int32),\n"
        "                              block_table=torch.zeros(1, 1, dtype=torch.int32))\n"
        "print(tuple(out.shape))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)

    assert run.stdout.strip() == "(1, 1, 2, 8)"
