"""What exlnb's paged attention costs a decode step as the context grows, on each of its paths; JSON out.

    python -m benchmarks decode-attention [--out benchmarks/results]

With CUDA graphs the host no longer sets the decode speed, and on the H100 the time per token then grew with
the context (the bundled model 3.1 ms at 128 tokens, 17.6 ms at 4096). This times the attention alone, a
whole token's worth of layers replayed from one CUDA graph (as decode runs), for the bundled model's and the
7B-shaped model's heads, per context length and batch size, `paged_attention.flash_attn_with_kvcache` called
as exllamav2 calls it, three ways:
- `pytorch`: its PyTorch path (`TRITON_DECODE` off): a gather of the pages, then PyTorch's memory-efficient
  attention kernel, which spreads one query's work over heads only;
- `matmul`: the same gather, then scores, softmax and weighted sum as batched matrix products;
- `triton`: triton_decode's kernels, which read the pages in place, split over the keys (where triton is
  installed; the engine's default there, `EXLNB_TRITON_DECODE=0` opts out).
For each: ms per token, its difference from the PyTorch path's output, and whether a sequence's output is the
same, to the bit, alone and in a batch of 8 (a greedy answer that changes with its batch mates is field report 2).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.harness import device_slug, environment, gpu_ms_per_call
from exlnb.engines.exllamav2 import paged_attention
from exlnb.random_model import LLAMA_7B

PAGE = 256
SHAPES = {  # heads, key/value heads, head size, layers
    "bundled": (9, 3, 64, 30),
    "7b-shaped": (
        LLAMA_7B["num_attention_heads"],
        LLAMA_7B["num_key_value_heads"],
        LLAMA_7B["hidden_size"] // LLAMA_7B["num_attention_heads"],
        LLAMA_7B["num_hidden_layers"],
    ),
}
CONTEXTS = (128, 256, 1024, 2048, 4096)
BATCHES = (1, 8)
FORMS = ("pytorch", "matmul", "triton")


def matmul_attention(q, keys, values, bias, scale, softcap):
    """softmax(q k^T * scale + bias) v by batched matrix products, float32 scores."""
    scores = torch.matmul(q, keys.transpose(2, 3)).float() * scale + bias
    return torch.matmul(scores.softmax(-1).to(q.dtype), values)


def decode_inputs(heads: int, kv_heads: int, dim: int, context: int, batch: int) -> dict:
    """One decode step's arguments: each sequence `context` tokens long in pages of its own, its numbers drawn
    from a generator seeded by its index, so sequence 0 is the same whatever the batch."""
    pages = -(-(context + 1) // PAGE)
    parts = {"k_cache": [], "v_cache": [], "q": [], "k": [], "v": []}
    for sequence in range(batch):
        generator = torch.Generator(device="cuda").manual_seed(sequence)
        for name, shape in (
            ("k_cache", (pages, PAGE, kv_heads, dim)),
            ("v_cache", (pages, PAGE, kv_heads, dim)),
            ("q", (1, 1, heads, dim)),
            ("k", (1, 1, kv_heads, dim)),
            ("v", (1, 1, kv_heads, dim)),
        ):
            parts[name].append(torch.randn(*shape, generator=generator, device="cuda", dtype=torch.float16))
    block_table = torch.arange(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages)
    seqlens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    return {name: torch.cat(tensors) for name, tensors in parts.items()} | dict(
        cache_seqlens=seqlens, block_table=block_table
    )


def one_token(inputs: dict, layers: int) -> torch.Tensor:
    """A token's attention calls, one per layer, as exllamav2 makes them (the layout built once per pass)."""
    out = None
    for _ in range(layers):
        out = paged_attention.flash_attn_with_kvcache(
            inputs["q"],
            inputs["k_cache"],
            inputs["v_cache"],
            inputs["k"],
            inputs["v"],
            cache_seqlens=inputs["cache_seqlens"],
            block_table=inputs["block_table"],
            causal=True,
        )
    return out


def graph_ms(inputs: dict, layers: int, replays: int = 50) -> tuple[float, torch.Tensor]:
    """ms of GPU time per token, one CUDA graph of all layers' calls replayed; and the output."""
    paged_attention.forget_layout()
    one_token(inputs, layers)  # warm-up outside the graph: kernel choice, allocator
    torch.cuda.synchronize()
    paged_attention.forget_layout()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = one_token(inputs, layers)
    graph.replay()
    return gpu_ms_per_call(graph.replay, replays), out.clone()


def measure(shape: str, context: int, batch: int, form: str) -> dict:
    heads, kv_heads, dim, layers = SHAPES[shape]
    original, switch = paged_attention._attend_block, paged_attention.TRITON_DECODE
    paged_attention.TRITON_DECODE = form == "triton"
    if form == "matmul":
        paged_attention._attend_block = matmul_attention
    try:
        ms, out = graph_ms(decode_inputs(heads, kv_heads, dim, context, batch), layers)
        alone = graph_ms(decode_inputs(heads, kv_heads, dim, context, 1), layers)[1] if batch > 1 else out
    finally:
        paged_attention._attend_block, paged_attention.TRITON_DECODE = original, switch
    return {
        "model": shape,
        "context": context,
        "batch": batch,
        "form": form,
        "ms_per_token": ms,
        "sequence_0_same_alone_and_in_batch": bool(torch.equal(out[:1], alone)),
        "_out": out,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks decode-attention", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("python -m benchmarks decode-attention times CUDA kernels: this machine has no CUDA")
    forms = FORMS if paged_attention.triton_installed() else FORMS[:-1]
    if "triton" not in forms:
        print("triton is not installed: no `triton` rows", flush=True)
    rows = []
    with torch.inference_mode():
        for shape in SHAPES:
            for context in CONTEXTS:
                for batch in BATCHES:
                    measured = [measure(shape, context, batch, form) for form in forms]
                    pytorch_out = measured[0]["_out"]
                    for row in measured:
                        row["max_abs_difference_from_pytorch"] = float((row.pop("_out") - pytorch_out).abs().max())
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    env = environment()
    result = {"benchmark": "decode_attention", "environment": env, "page_tokens": PAGE, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"decode-attention-{device_slug(env)}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
