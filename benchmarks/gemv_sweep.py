"""The decode products cuBLAS splits over their inputs, and the Triton decode attention, each way of launching them.

    python -m benchmarks gemv-sweep [--only products,attention,batched] [--out DIR]

The 2026-11-28 H200 profiles had a 7B step's o and down products (a split-K kernel and a reduce kernel each, 64
of each a step) at 75 % of copy bandwidth, and the ExLlamaV2 engine's attention at 4,096 tokens well below it.
This replays 32 layers of distinct o and down weights (4096 -> 4096 and 11008 -> 4096) from one CUDA graph, at 1
and 8 rows: through cuBLAS (torch.mm input-major, with float32 outputs as exllamav3 asks, F.linear output-major as
exllamav2 holds them, and a zero-copy batched product over 2, 4 or 8 slices of the outputs, of input-major and of
output-major weights), through exlnb's own single-row call (engines/gemv.py), and through its Triton kernel over
output-major weights in 26 configurations. Then 32 layers of triton_decode's attention (batch 1, 32 query heads of
128, 32 or 8 key/value heads, a 4,608-token cache) at 256, 1,024 and 4,096 tokens, under each of
ATTENTION_OPTIONS (split and tile sizes, warps, stages, and the call's new keys read in tiles of their own), over
the table both engines' graphs read (cut to the bucket of the pages the sequence needs: one page at 256 tokens, 16
at 4,096). Last, a batch of 8 as the ExLlamaV3 engine attends it (its block table padded to
16 pages, as exllamav3 pads it): exllamav3's own decode kernel, and exlnb's with 256, 1,024 and 4,096 keys a split,
and on a table cut to the pages the batch needs. Median of 20 replays each; the weights' or keys' bytes over that
time. CUDA only.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.gemv import copy_bytes_per_s, graphed
from benchmarks.harness import device_slug, environment, new_result_path, write_json
from exlnb.engines.cuda_graphs import buckets, cut_width

TRITON = importlib.util.find_spec("triton") is not None
if TRITON:
    import triton
    import triton.language as tl

LAYERS = 32
HIDDEN, INTERMEDIATE = 4096, 11008
HEADS, HEAD_DIM, PAGE, CACHE_TOKENS = 32, 128, 256, 4608
ROW_CONFIGS = [  # (outputs a program, inputs a tile, warps, stages) at one row
    *((n, k, w, s) for n in (8, 16, 32) for k in (256, 512) for w in (4, 8) for s in (2, 4)),
    (4, 1024, 4, 2),
    (16, 1024, 8, 3),
]
BATCH_CONFIGS = [(n, k, 4, s) for n in (16, 32, 64) for k in (128, 256) for s in (3, 4)]  # tl.dot, 16 rows
ATTENTION_OPTIONS = [  # (keys a split, keys a tile, warps, stages or None for triton's default, the call's keys apart)
    (256, 64, 4, None, False),
    (256, 64, 8, None, False),
    (256, 64, 4, 2, False),
    (256, 64, 4, 4, False),
    (256, 64, 8, 4, False),
    (128, 64, 4, None, False),
    (512, 64, 4, None, False),
    (256, 32, 4, None, False),
    (256, 32, 8, None, False),
    (512, 32, 4, None, False),
    (256, 128, 4, None, False),
    (256, 128, 8, 3, False),
    # the call's new keys in tiles of their own (triton_decode.fresh_tile_apart): less shared memory a program
    (256, 64, 4, None, True),
    (512, 64, 4, None, True),
    (256, 64, 8, None, True),
    (256, 64, 4, 4, True),
    (256, 32, 4, None, True),
    (256, 128, 4, None, True),
    (512, 128, 4, None, True),
    (512, 128, 8, None, True),
]


if TRITON:

    @triton.jit
    def rows_times_matrix(
        x, w, out, M, N, K, x_stride, out_stride, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
    ):
        """x (M, K) @ w.T for an output-major w (N, K): one row as engines/gemv.py's kernel does it (ROWS 1), up to
        16 rows through tl.dot."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        real_n = n < N
        if ROWS == 1:
            acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                real_k = k < K
                tile = tl.load(w + n[:, None].to(tl.int64) * K + k[None, :], mask=real_n[:, None] & real_k[None, :])
                acc += tile.to(tl.float32) * tl.load(x + k, mask=real_k, other=0.0).to(tl.float32)[None, :]
            tl.store(out + n, tl.sum(acc, 1).to(out.dtype.element_ty), mask=real_n)
        else:
            m = tl.arange(0, ROWS)
            real_m = m < M
            acc = tl.zeros((ROWS, BLOCK_N), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                real_k = k < K
                xt = tl.load(x + m[:, None] * x_stride + k[None, :], mask=real_m[:, None] & real_k[None, :], other=0.0)
                tile = tl.load(w + n[:, None].to(tl.int64) * K + k[None, :], mask=real_n[:, None] & real_k[None, :])
                acc = tl.dot(xt, tl.trans(tile), acc)
            out_at = out + m[:, None] * out_stride + n[None, :]
            tl.store(out_at, acc.to(out.dtype.element_ty), mask=real_m[:, None] & real_n[None, :])


def graph_ms(fn: Callable[[], object], replays: int = 20) -> tuple[float, float]:
    """Median and best ms of `fn` replayed from one CUDA graph (captured as the gemv suite captures a layer, after
    warm-up calls, where Triton compiles)."""
    replay, _ = graphed(fn)
    for _ in range(3):
        replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), min(times)


def timed(results: dict, name: str, fn: Callable[[], object], read_bytes: int) -> None:
    try:
        median, best = graph_ms(fn)
        results[name] = {"ms": median, "best_ms": best, "tb_per_s": read_bytes / (median / 1e3) / 1e12}
    except Exception as error:  # a configuration triton or cuBLAS refuses is recorded, not fatal
        results[name] = {"error": repr(error)[:300]}
    print(name, results[name], flush=True)


def products(record: dict) -> None:
    from exlnb.engines.gemv import row_times_matrix

    torch.manual_seed(0)

    def weight(inputs: int) -> torch.Tensor:
        return torch.randn(inputs, HIDDEN, device="cuda").half() * 0.02

    input_major = [(weight(HIDDEN), weight(INTERMEDIATE)) for _ in range(LAYERS)]
    output_major = [(o.t().contiguous(), d.t().contiguous()) for o, d in input_major]
    weight_bytes = LAYERS * (HIDDEN * HIDDEN + INTERMEDIATE * HIDDEN) * 2
    results = record.setdefault("products", {"weight_bytes": weight_bytes, "results": {}})["results"]
    for rows in (1, 8):
        xo, xd = torch.randn(rows, HIDDEN, device="cuda").half(), torch.randn(rows, INTERMEDIATE, device="cuda").half()

        def sliced(slices: int) -> list[torch.Tensor]:
            outs = []
            for o, d in input_major:
                for x, w in ((xo, o), (xd, d)):
                    k, n = w.shape
                    view = w.as_strided((slices, k, n // slices), (n // slices, n, 1))
                    outs.append(torch.bmm(x.unsqueeze(0).expand(slices, -1, -1), view))
            return outs

        def sliced_output_major(slices: int) -> list[torch.Tensor]:
            """Each (out, in) weight as `slices` stacked blocks of outputs, times the rows' transpose: the product
            (slices, out / slices, rows) is the (rows, out) result transposed, a view with no copy."""
            outs = []
            for o, d in output_major:
                for x, w in ((xo, o), (xd, d)):
                    n, k = w.shape
                    product = torch.bmm(w.view(slices, n // slices, k), x.t().unsqueeze(0).expand(slices, -1, -1))
                    outs.append(product.view(n, -1).t())
            return outs

        ways = {
            "cublas_mm_kn_fp16": lambda: [(torch.mm(xo, o), torch.mm(xd, d)) for o, d in input_major],
            "cublas_mm_kn_fp32out": lambda: [
                (torch.mm(xo, o, out_dtype=torch.float32), torch.mm(xd, d, out_dtype=torch.float32))
                for o, d in input_major
            ],
            "cublas_linear_nk_fp16": lambda: [
                (torch.nn.functional.linear(xo, o), torch.nn.functional.linear(xd, d)) for o, d in output_major
            ],
            **{f"cublas_bmm_nsplit{s}_fp16": (lambda s=s: sliced(s)) for s in (2, 4, 8)},
            # the same slices over output-major weights, as both engines now hold o and down
            **{f"cublas_bmm_nk_nsplit{s}_fp16": (lambda s=s: sliced_output_major(s)) for s in (2, 4, 8)},
        }
        if rows == 1:  # the engines' own call, wrapper included, beside the configurations below
            ways["exlnb_row_times_matrix_fp32out"] = lambda: [
                (row_times_matrix(xo, o, torch.float32), row_times_matrix(xd, d, torch.float32))
                for o, d in output_major
            ]
        for name, fn in ways.items():
            timed(results, f"{name}@rows{rows}", fn, weight_bytes)
        yo = torch.empty(rows, HIDDEN, device="cuda", dtype=torch.float32)
        yd = torch.empty(rows, HIDDEN, device="cuda", dtype=torch.float32)
        configs = ROW_CONFIGS if rows == 1 else BATCH_CONFIGS

        def launch(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, config: tuple) -> None:
            bn, bk, warps, stages = config
            rows_times_matrix[(triton.cdiv(HIDDEN, bn),)](
                x, w, y, rows, HIDDEN, w.shape[1], x.stride(0), y.stride(0),
                ROWS=1 if rows == 1 else 16, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
            )  # fmt: skip

        for config in configs:

            def triton_way(config=config) -> None:
                for o, d in output_major:
                    launch(xo, o, yo, config)
                    launch(xd, d, yd, config)

            name = "triton_nk_fp32_bn{}_bk{}_w{}_s{}@rows{}".format(*config, rows)
            timed(results, name, triton_way, weight_bytes)
        reference = torch.mm(xd, input_major[0][1], out_dtype=torch.float32)
        launch(xd, output_major[0][1], yd, configs[0])
        results[f"max_rel_err@rows{rows}"] = float((yd - reference).abs().max() / reference.abs().max())


def exlnb_layers(caches: list, q, fresh, lengths, table) -> Callable[[], None]:
    """Every layer's decode attention through triton_decode as the engines call it, the new keys appended."""
    from exlnb.engines import triton_decode

    def layers() -> None:
        for k, v in caches:
            triton_decode.paged_decode_attention(
                q, k, v, lengths, table, new_keys=fresh, new_values=fresh, scale=HEAD_DIM**-0.5, causal=True,
                window_size=(-1, -1), softcap=0.0,
            )  # fmt: skip

    return layers


ATTENTION_SHAPES = {"": HEADS, "kv8_": 8}  # name prefix: key/value heads (32 query heads): Llama-2-7B's, and grouped
ATTENTION_TOKENS = (256, 1024, 4096)


def attention(record: dict) -> None:
    """32 layers of one sequence's decode attention under each launch option, for each key/value head count and
    context, over the table the engines' graphs read: a split size or tile is kept only where it wins on every
    shape, since it must not follow the table's width (a sequence's bits would change with its batch mates)."""
    from exlnb.engines import triton_decode

    kernel = triton_decode._attention_split_kernel
    constants = (triton_decode.SPLIT_KEYS, triton_decode.BLOCK_KEYS, triton_decode.FRESH_APART)
    pages = CACHE_TOKENS // PAGE
    whole = torch.arange(pages, device="cuda", dtype=torch.int32)[None]
    results = record.setdefault("attention", {"results": {}})["results"]

    class Launched:  # the kernel launched with these options, wherever triton_decode launches it
        def __init__(self, **options) -> None:
            self.options = options

        def __getitem__(self, grid):
            launch = kernel[grid]
            return lambda *args, **kwargs: launch(*args, **{**kwargs, **self.options})  # over the module's own

    try:
        for shape, kv_heads in ATTENTION_SHAPES.items():
            caches = [
                tuple(torch.randn(pages, PAGE, kv_heads, HEAD_DIM, device="cuda").half() for _ in range(2))
                for _ in range(LAYERS)
            ]
            q = torch.randn(1, 1, HEADS, HEAD_DIM, device="cuda").half()
            fresh = torch.randn(1, 1, kv_heads, HEAD_DIM, device="cuda").half()
            for tokens in ATTENTION_TOKENS:
                lengths = torch.tensor([tokens - 1], device="cuda", dtype=torch.int32)
                table = whole[:, : cut_width(pages, tokens - 1, PAGE, buckets(pages))].contiguous()
                key_bytes = LAYERS * tokens * kv_heads * HEAD_DIM * 2 * 2
                for split, block, warps, stages, apart in ATTENTION_OPTIONS:
                    triton_decode.SPLIT_KEYS, triton_decode.BLOCK_KEYS, triton_decode.FRESH_APART = split, block, apart
                    staged = {"num_stages": stages} if stages else {}
                    triton_decode._attention_split_kernel = Launched(num_warps=warps, **staged)
                    layers = exlnb_layers(caches, q, fresh, lengths, table)
                    name = f"{shape}split{split}_block{block}_w{warps}_s{stages}{'_apart' * apart}@ctx{tokens}"
                    timed(results, name, layers, key_bytes)
            del caches
    finally:
        triton_decode._attention_split_kernel = kernel
        triton_decode.SPLIT_KEYS, triton_decode.BLOCK_KEYS, triton_decode.FRESH_APART = constants


BATCH, PADDED_PAGES = 8, 16  # exllamav3 1.6.5 pads a step's block table to a multiple of 16 pages


def batched_attention(record: dict) -> None:
    """32 layers of a batch of 8 sequences' decode attention, each sequence on pages of its own, at 256 and 1,024
    tokens: exllamav3's kernel against exlnb's under split sizes, on the padded table and on one cut to the need.
    exlnb's kernel splits by the table's width; at batch 8 its splits past each sequence's end cost 0.7 ms a step
    in the ExLlamaV3 engine's profile (benchmarks/results/speed-nvidia-h200-2026-11-28-attention/)."""
    from exlnb.engines import triton_decode

    results = record.setdefault("batched_attention", {"batch": BATCH, "results": {}})["results"]
    split_keys = triton_decode.SPLIT_KEYS
    try:
        for tokens in (256, 1024):
            pages = -(-(tokens + 1) // PAGE)  # each sequence's pages, its new key included
            caches = [
                tuple(torch.randn(BATCH * pages, PAGE, HEADS, HEAD_DIM, device="cuda").half() for _ in range(2))
                for _ in range(LAYERS)
            ]
            own = torch.arange(BATCH * pages, device="cuda", dtype=torch.int32).view(BATCH, pages)
            padded = torch.cat([own, own[:, :1].expand(BATCH, PADDED_PAGES - pages)], 1).contiguous()
            q, fresh = (torch.randn(BATCH, 1, HEADS, HEAD_DIM, device="cuda").half() for _ in range(2))
            lengths = torch.full((BATCH,), tokens, device="cuda", dtype=torch.int32)
            key_bytes = LAYERS * BATCH * tokens * HEADS * HEAD_DIM * 2 * 2

            def exlnb(table: torch.Tensor) -> Callable[[], None]:
                return exlnb_layers(caches, q, fresh, lengths, table)

            for split in (256, 1024, 4096):
                triton_decode.SPLIT_KEYS = split
                timed(results, f"exlnb_split{split}_padded{PADDED_PAGES}@ctx{tokens}", exlnb(padded), key_bytes)
            triton_decode.SPLIT_KEYS = split_keys
            timed(results, f"exlnb_split{split_keys}_cut{pages}@ctx{tokens}", exlnb(own.contiguous()), key_bytes)
            if importlib.util.find_spec("exllamav3") is not None:
                from exllamav3.modules.attention_fn.triton_paged import paged_attn_triton_decode

                def library() -> None:
                    for k, v in caches:
                        paged_attn_triton_decode(q, fresh, fresh, k, v, padded, lengths, causal=True)

                timed(results, f"exllamav3_padded{PADDED_PAGES}@ctx{tokens}", library, key_bytes)
    finally:
        triton_decode.SPLIT_KEYS = split_keys


SWEEPS = {"products": products, "attention": attention, "batched": batched_attention}
SET_BY_THE_SWEEP = ("EXLNB_DECODE_SPLIT_KEYS", "EXLNB_DECODE_FRESH_APART", "EXLNB_DECODE_SPLIT_WARPS")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks gemv-sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--only", default=",".join(SWEEPS), help=f"the sweeps to run, comma-separated (default: {', '.join(SWEEPS)})"
    )
    args = parser.parse_args(argv)
    chosen = args.only.split(",")
    if not set(chosen) <= set(SWEEPS):
        parser.error(f"--only {args.only}: each must be one of {', '.join(SWEEPS)}")
    if not torch.cuda.is_available() or not TRITON:
        parser.exit(2, "python -m benchmarks gemv-sweep needs a CUDA GPU and triton\n")
    for variable in SET_BY_THE_SWEEP:  # each would stand in for every value the sweep sets
        if variable in os.environ:
            parser.exit(2, f"python -m benchmarks gemv-sweep sets its own decode options: unset {variable}\n")
    record = {"environment": environment(), "copy_bandwidth_bytes_per_s": copy_bytes_per_s(cuda=True)}
    path = new_result_path(args.out, f"gemv-sweep-{device_slug(record['environment'])}")
    for name in chosen:
        SWEEPS[name](record)
        write_json(path, record, indent=1)
    print(f"wrote {path}")
    return record
