"""The ExLlamaV2 engine against the GPU itself: a 7B-shaped model's decode time against the memory floor.

Batch-1 decode reads every weight once per token, so weights / memory bandwidth is the fastest a token can
be. The model is `exlnb.random_model`'s: Llama-2-7B-shaped with random fp16 weights, made on the GPU machine.
"""

from __future__ import annotations

import torch

from benchmarks.harness import gpu_ms_per_call


def copy_bandwidth(gib: float = 2.0, repeats: int = 20) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read and written (as docs/gpu.md reports it)."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds = gpu_ms_per_call(lambda: dst.copy_(src), repeats) / 1000
    return 2 * n / seconds
