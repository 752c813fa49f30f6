"""A decode step's weight products alone, each way of doing them, against copy bandwidth; JSON out.

    python -m benchmarks gemv [--batches 1,8] [--samples 7] [--repeats 200] [--shape 7b|tiny] [--out DIR]

The 2026-11-28 H100 profile of the ExLlamaV2 engine had its fp16 GEMVs, seven cuBLAS products a layer, at 80% of
copy bandwidth; the decode goal needs about 90%. This times one Llama-2-7B-shaped layer's seven products, eager
and replayed from one CUDA graph (as the engines decode), separate, fused (QKV and gate/up), in a split-K Triton
kernel, and through cuBLASLt, each checked against the separate products.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.harness import device_slug, environment, gpu_ms_per_call, new_result_path, summarise, write_json

TRITON = importlib.util.find_spec("triton") is not None
if TRITON:
    import triton
    import triton.language as tl

SHAPES = {"7b": (4096, 11008), "tiny": (256, 704)}  # hidden, intermediate (Llama-2-7B: 32 heads, no GQA)
SEPARATE = ("q", "k", "v", "o", "gate", "up", "down")  # the order every variant's outputs are compared in
FUSED = {"qkv": ("q", "k", "v"), "o": ("o",), "gateup": ("gate", "up"), "down": ("down",)}
MAX_ERROR = 1e-2  # largest difference from `separate`, relative to its largest output, that still counts
GOAL = 0.9  # of copy bandwidth, what decode needs of its products

Products = Callable[[], list[torch.Tensor]]  # one layer's products, outputs in the order of SEPARATE


# -- the split-K Triton kernel ----------------------------------------------------------------------------------

if TRITON:

    @triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": s}, num_warps=w, num_stages=st)
            for n, k, s, w, st in (
                (16, 256, 4, 4, 3),
                (32, 128, 4, 4, 3),
                (32, 256, 2, 4, 3),
                (64, 128, 2, 4, 3),
                (64, 64, 4, 4, 4),
                (128, 64, 1, 8, 4),
                (32, 128, 8, 4, 4),
                (16, 128, 8, 2, 4),
            )
        ],
        key=["M", "N", "K"],
        reset_to_zero=["out_ptr"],  # the partial sums are added into it: each trial starts from zeros
    )
    @triton.jit
    def _splitk_gemv_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_om,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
    ):
        """out[m, n] += sum over this program's slice of K of x[m, k] * w[n, k], in float32: a block of output
        rows, every batch row at once, so each weight is read once whatever the batch."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        batch = tl.arange(0, BLOCK_M)
        per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        start = tl.program_id(1) * per_split
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(start, start + per_split, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(
                w_ptr + rows[:, None] * stride_wn + cols[None, :],
                mask=(rows[:, None] < N) & (cols[None, :] < K),
                other=0.0,
                eviction_policy="evict_first",
            ).to(tl.float32)
            for m in tl.static_range(BLOCK_M):
                xm = tl.load(
                    x_ptr + m * stride_xm + cols, mask=(cols < K) & (tl.full((BLOCK_K,), m, tl.int32) < M), other=0.0
                ).to(tl.float32)
                part = tl.sum(w * xm[None, :], axis=1)
                acc += tl.where(batch[:, None] == m, part[None, :], 0.0)
        tl.atomic_add(
            out_ptr + batch[:, None] * stride_om + rows[None, :],
            acc,
            mask=(batch[:, None] < M) & (rows[None, :] < N),
        )


def splitk_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.t() for fp16 x (batch, K) and w (N, K): fp32 partial sums over K added atomically, fp16 out."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.zeros((m, n), device=x.device, dtype=torch.float32)
    _splitk_gemv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), BLOCK_M=triton.next_power_of_2(m)
    )
    return out.to(x.dtype)


# -- the layer and its variants ---------------------------------------------------------------------------------


def layer_weights(hidden: int, intermediate: int, device: str) -> dict[str, torch.Tensor]:
    """The seven fp16 weights (out, in) of one layer, scaled so that outputs stay near 1."""
    generator = torch.Generator(device=device).manual_seed(0)
    shapes = {name: (hidden, hidden) for name in ("q", "k", "v", "o")}
    shapes |= {"gate": (intermediate, hidden), "up": (intermediate, hidden), "down": (hidden, intermediate)}
    return {
        name: (torch.randn(shape, generator=generator, device=device) / shape[1] ** 0.5).half()
        for name, shape in shapes.items()
    }


def fused_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """QKV and gate/up concatenated along their outputs; o and down as they are."""
    return {name: torch.cat([weights[part] for part in parts]) for name, parts in FUSED.items()}


def layer_inputs(batch: int, hidden: int, intermediate: int, device: str) -> dict[str, torch.Tensor]:
    """What each product reads: the hidden state, and for down the intermediate one."""
    generator = torch.Generator(device=device).manual_seed(1)
    return {
        size: torch.randn((batch, width), generator=generator, device=device).half()
        for size, width in (("hidden", hidden), ("intermediate", intermediate))
    }


def input_of(name: str) -> str:
    return "intermediate" if name == "down" else "hidden"


@dataclass(frozen=True)
class Variant:
    """One way of doing a layer's products: the call, the bytes of weights it reads, how many products."""

    layer: Products
    bytes: int
    products: int


def variant(weights: dict[str, torch.Tensor], x: dict[str, torch.Tensor], product) -> Variant:
    """One layer as `product(input, weight)` for each weight, in order."""
    pairs = [(x[input_of(name)], w) for name, w in weights.items()]
    read = sum(w.numel() * w.element_size() for w in weights.values())
    return Variant(lambda: [product(a, w) for a, w in pairs], read, len(pairs))


def through_cublaslt(fused: dict[str, torch.Tensor], x: dict[str, torch.Tensor]) -> Variant:
    """`linear` with a zero bias: addmm with a 1-D bias goes to cuBLASLt's bias epilogue on CUDA (PyTorch falls
    back to cuBLAS where a dimension is 1, so at batch 1 this may be `fused`'s kernel again)."""
    triples = [(x[input_of(name)], w, w.new_zeros(w.shape[0])) for name, w in fused.items()]
    read = sum(w.numel() * w.element_size() for w in fused.values())
    return Variant(lambda: [F.linear(a, w, bias) for a, w, bias in triples], read, len(triples))


def through_stacked(weights: dict[str, torch.Tensor], x: dict[str, torch.Tensor]) -> Variant:
    """QKV and gate/up as one batched product each over their weights stacked input-major, (n, in, out): each
    output comes out contiguous, as exlnb's fused ExLlamaV3 projections need (exllamav3/fused_products.py)."""
    groups = [(x[input_of(parts[0])], torch.stack([weights[part].t() for part in parts])) for parts in FUSED.values()]

    def layer() -> list[torch.Tensor]:
        outputs: list[torch.Tensor] = []
        for a, stacked in groups:
            outputs += torch.bmm(a.expand(stacked.shape[0], -1, -1), stacked).unbind(0)
        return outputs

    read = sum(w.numel() * w.element_size() for w in weights.values())
    return Variant(layer, read, len(groups))


def variants(weights: dict, fused: dict, x: dict, cuda: bool) -> dict[str, Variant | str]:
    """Each way of doing the layer's products; or, for one left out, why."""
    transposed = {name: w.t().contiguous() for name, w in fused.items()}  # (in, out): cuBLAS runs NN, not TN
    found: dict[str, Variant | str] = {
        "separate": variant(weights, x, lambda a, w: torch.matmul(a, w.t())),
        "fused": variant(fused, x, lambda a, w: torch.matmul(a, w.t())),
        "fused_transposed": variant(transposed, x, torch.matmul),
        "stacked": through_stacked(weights, x),
        "cublaslt": through_cublaslt(fused, x) if cuda else "no CUDA here: cuBLASLt is CUDA's",
    }
    for name, chosen in (("triton_splitk_fused", fused), ("triton_splitk_separate", weights)):
        if not cuda:
            found[name] = "no CUDA here: the split-K Triton kernel runs on CUDA only"
        elif not TRITON:
            found[name] = "triton is not installed"
        else:
            found[name] = variant(chosen, x, splitk_gemv)
    return found


def in_order(outputs: list[torch.Tensor]) -> torch.Tensor:
    """A variant's outputs as one float32 row per batch row, in SEPARATE's order (fused outputs are already)."""
    return torch.cat([out.float() for out in outputs], dim=-1)


def relative_error(outputs: list[torch.Tensor], reference: torch.Tensor) -> float:
    return float((in_order(outputs) - reference).abs().max() / reference.abs().max())


# -- timing -----------------------------------------------------------------------------------------------------


def ms_per_call(fn: Callable[[], object], repeats: int, cuda: bool) -> float:
    """Mean ms of `repeats` back-to-back calls: CUDA events around them on CUDA, the clock on the CPU."""
    if cuda:
        return gpu_ms_per_call(fn, repeats)
    began = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - began) * 1000 / repeats


def graphed(layer: Products) -> tuple[Callable[[], None], list[torch.Tensor]]:
    """One CUDA graph of the layer's products (warmed on a side stream, captured once): its replay and outputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            layer()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = layer()
    graph.replay()
    torch.cuda.synchronize()
    return graph.replay, outputs


def round_robin(timed: dict[str, Callable[[], object]], samples: int, repeats: int, cuda: bool) -> dict:
    """`samples` ms-per-call samples of each, the callables taken in turn (the first one rotating) so that clock
    and temperature drift reach every one alike; a warm-up of each first."""
    for fn in timed.values():
        ms_per_call(fn, max(3, repeats // 10), cuda)
    names = list(timed)
    found: dict[str, list[float]] = {name: [] for name in names}
    for sample in range(samples):
        for name in names[sample % len(names) :] + names[: sample % len(names)]:
            found[name].append(ms_per_call(timed[name], repeats, cuda))
    return found


def row(samples_ms: list[float], weight_read: int, copy: float, error: float) -> dict:
    summary = summarise(samples_ms)
    bandwidth = weight_read / (summary["median"] / 1000)
    return {
        "ms_per_layer": summary["median"],
        "iqr_ms": summary["iqr"],
        "samples_ms": samples_ms,
        "bytes": weight_read,
        "bandwidth_bytes_per_s": bandwidth,
        "of_copy_bandwidth": bandwidth / copy,
        "max_error": error,
        "correct": error < MAX_ERROR,
    }


def measure_batch(batch: int, hidden: int, intermediate: int, args, copy: float, cuda: bool) -> dict:
    """Every variant at one batch size, eager and (on CUDA) graphed, timed together round-robin."""
    device = "cuda" if cuda else "cpu"
    weights = layer_weights(hidden, intermediate, device)
    x = layer_inputs(batch, hidden, intermediate, device)
    found = variants(weights, fused_weights(weights), x, cuda)
    ready = {name: v for name, v in found.items() if isinstance(v, Variant)}
    reference = in_order(ready["separate"].layer())
    timed, errors = {}, {}
    for name, v in ready.items():
        timed[(name, "eager")] = v.layer
        errors[(name, "eager")] = relative_error(v.layer(), reference)
        if cuda:
            replay, outputs = graphed(v.layer)
            timed[(name, "graphed")] = replay
            errors[(name, "graphed")] = relative_error(outputs, reference)
    samples = round_robin(timed, args.samples, args.repeats, cuda)
    result = {}
    for name, v in found.items():
        if isinstance(v, str):
            result[name] = {"why": v}
            continue
        result[name] = {"products": v.products} | {
            mode: row(samples[(name, mode)], v.bytes, copy, errors[(name, mode)])
            if (name, mode) in samples
            else {"why": "no CUDA here: no CUDA graphs"}
            for mode in ("eager", "graphed")
        }
    return result


def best_of(rows: dict) -> dict:
    """Per mode, the fastest variant whose outputs match `separate`, and its fraction of copy bandwidth."""
    best = {}
    for mode in ("eager", "graphed"):
        correct = {
            name: r[mode] for name, r in rows.items() if "ms_per_layer" in r.get(mode, {}) and r[mode]["correct"]
        }
        if correct:
            name = min(correct, key=lambda n: correct[n]["ms_per_layer"])
            best[mode] = {
                "variant": name,
                "ms_per_layer": correct[name]["ms_per_layer"],
                "of_copy_bandwidth": correct[name]["of_copy_bandwidth"],
                "meets_goal": correct[name]["of_copy_bandwidth"] >= GOAL,
            }
    return best


def copy_bytes_per_s(cuda: bool) -> float:
    """The device's copy rate (read and written counted), the median of three on CUDA; one on the CPU, slow there."""
    from benchmarks.speed_setups import copy_bandwidth

    return statistics.median(copy_bandwidth() for _ in range(3 if cuda else 1))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks gemv", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--batches", default="1,8", help="batch sizes (rows of the products), comma-separated")
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=200, help="layers timed back to back per sample")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="7b")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and args.shape != "tiny":
        raise SystemExit("python -m benchmarks gemv: without CUDA only --shape tiny runs (on the CPU)")
    hidden, intermediate = SHAPES[args.shape]
    batches = [int(b) for b in args.batches.split(",")]
    copy = copy_bytes_per_s(cuda)
    env = environment()
    rows = {}
    with torch.inference_mode():
        for batch in batches:
            rows[str(batch)] = measure_batch(batch, hidden, intermediate, args, copy, cuda)
            print(json.dumps({"batch": batch, "best": best_of(rows[str(batch)])}), flush=True)
    result = {
        "benchmark": "gemv",
        "device": env["device"],
        "environment": env,
        "shape": {"name": args.shape, "hidden": hidden, "intermediate": intermediate},
        "samples": args.samples,
        "repeats": args.repeats,
        "copy_bandwidth_bytes_per_s": copy,
        "bytes_counted": "a layer's weights, each read once; copy bandwidth counts the bytes read and written",
        "goal_of_copy_bandwidth": GOAL,
        "max_error_allowed": MAX_ERROR,
        "batches": rows,
        "best": {batch: best_of(r) for batch, r in rows.items()},
    }
    path = new_result_path(args.out, f"gemv-{args.shape}-{device_slug(env)}-{env['date'][:10]}")
    write_json(path, result, indent=2)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
