"""Tensor parallelism's reality check: how long one all-reduce of a decode step's hidden state takes across the
cards, and the speedup over one card that this predicts, beside the speedup measured.

A Llama-shaped layer split over n cards by rows and columns (Megatron's way, as exllamav2 and exllamav3 split it)
all-reduces its hidden state twice per layer and token: after attention's output projection and after the MLP's
down projection. Each card then reads 1/n of the weights, so a batch-1 token that takes T on one card takes about
T/n + 2 x layers x (one all-reduce) on n cards; where the all-reduce is not small beside T/n, tensor parallelism
loses to one card. NCCL's all-reduce is timed here in processes of its own (`nccl_allreduce_us`); exllamav3's
"native" backend, an all-reduce through shared host memory, runs inside its workers only, so its cost is read off
the measured speedup instead (`implied_allreduce_us`).
"""

from __future__ import annotations

import math
import socket
import statistics

import torch

WARMUP = 20
ITERATIONS = 200
TIMEOUT_S = 120  # one measurement's processes, spawned, joined and read back


def allreduces_per_token(layers: int) -> int:
    return 2 * layers


def predicted_speedup(one_card_ms: float, cards: int, allreduce_us: float, per_token: int) -> float:
    """One card's ms/token over what n cards should take: its work split n ways plus the all-reduces."""
    return one_card_ms / (one_card_ms / cards + per_token * allreduce_us / 1000)


def implied_allreduce_us(one_card_ms: float, split_ms: float, cards: int, per_token: int) -> float:
    """The all-reduce time a measured split implies, were everything but the all-reduces divided by n."""
    return 1000 * (split_ms - one_card_ms / cards) / per_token


def nccl_allreduce_us(cards: int, rows: int, hidden: int, dtype: torch.dtype = torch.float16) -> float:
    """The median time of one NCCL all-reduce of a (rows, hidden) tensor over the first `cards` GPUs, the
    slowest rank's, from CUDA events around each of ITERATIONS calls after WARMUP ones."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    ranks = [
        context.Process(target=_rank, args=(rank, cards, port, rows, hidden, dtype, results)) for rank in range(cards)
    ]
    for process in ranks:
        process.start()
    try:
        medians = [results.get(timeout=TIMEOUT_S) for _ in ranks]
    finally:
        for process in ranks:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
    failed = [m for m in medians if isinstance(m, str)]
    if failed:
        raise RuntimeError(f"an NCCL rank failed: {failed[0]}")
    return max(medians)


def _rank(rank: int, world: int, port: int, rows: int, hidden: int, dtype: torch.dtype, results) -> None:
    import torch.distributed as dist

    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        x = torch.randn((rows, hidden), dtype=dtype, device=f"cuda:{rank}")
        for _ in range(WARMUP):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        times = []
        for _ in range(ITERATIONS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_reduce(x)
            end.record()
            end.synchronize()
            times.append(1000 * start.elapsed_time(end))
        results.put(statistics.median(times))
        dist.destroy_process_group()
    except Exception as error:  # noqa: BLE001 - reported by the parent in one line
        results.put(f"rank {rank}: {type(error).__name__}: {error}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check(layouts: dict[str, dict], *, layers: int, cards_of: dict[str, int], nccl_us: dict[int, dict]) -> dict:
    """Per tensor-parallel layout: its measured speedup over one card at batch 1 and 8, the all-reduce time that
    implies, and, where it all-reduces with NCCL, the speedup NCCL's own timing predicts."""
    one = layouts.get("one_card", {})
    per_token = allreduces_per_token(layers)
    out = {}
    for name, row in layouts.items():
        cards = cards_of.get(name)
        if not cards or "batch1_tokens_per_s" not in row or "batch1_tokens_per_s" not in one:
            continue
        one_ms, split_ms = 1000 / one["batch1_tokens_per_s"], 1000 / row["batch1_tokens_per_s"]
        entry = {
            "cards": cards,
            "allreduces_per_token": per_token,
            "measured_speedup_batch1": row["batch1_tokens_per_s"] / one["batch1_tokens_per_s"],
            "measured_speedup_batch8": row.get("batch8_tokens_per_s", math.nan)
            / one.get("batch8_tokens_per_s", math.nan),
            "implied_allreduce_us": implied_allreduce_us(one_ms, split_ms, cards, per_token),
        }
        if name.endswith("nccl") and cards in nccl_us:
            entry["nccl_allreduce_us"] = nccl_us[cards]["batch1"]
            entry["predicted_speedup_batch1"] = predicted_speedup(one_ms, cards, nccl_us[cards]["batch1"], per_token)
        out[name] = entry
    return out
