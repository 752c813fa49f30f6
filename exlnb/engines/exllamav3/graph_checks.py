"""Whether an ExLlamaV3 model's decode steps can run from CUDA graphs, and the check a load runs before they do;
the modules a step runs on the host and the parameters exllamav3 1.6.5's generator passes a step, which the graph
decoder (graph_decode.py) shares."""

from __future__ import annotations

import torch

from exlnb.engines.cuda_graphs import replay_differs

CHECK_PROMPT_TOKENS = 24
TABLE_STEP = 16  # exllamav3 1.6.5 pads a step's block table to a multiple of 16 pages (Generator.iterate_gen)


def cannot_graph(engine) -> str | None:
    """Why an ExLlamaV3 engine's decode cannot run from graphs, in a line; None where it can try."""
    model = engine.model
    if model.loaded_tp:
        return "tensor parallel: exllamav3 runs the other cards' shards in worker processes"
    if model.get_recurrent_layers():
        return "the model has recurrent layers, whose per-job state lives outside the paged cache"
    if "mrope" in model.caps:
        return "the model takes per-job RoPE positions"
    if getattr(model.config, "moe_cpu_hosts", None):
        return "experts run on the CPU"
    modules = model.fwd_modules
    start = host_prologue(modules)
    if start == len(modules) or any(takes_host_input(module) for module, _, _ in modules[start:]):
        return "a module after the first GPU layer runs on the CPU"
    return None


def self_check(decoder, token_ids: list[int]) -> str | None:
    """A graph decoder's step decoded eagerly and by replay, at batch 1 and at batch 3, over the cache's first pages
    (the generator holds nothing yet); None where they agree, else why not, in a line."""
    pages = decoder.cache.max_num_tokens // 256
    sequences = min(3, pages, decoder.max_batch_size)
    prompt = (token_ids * CHECK_PROMPT_TOKENS)[:CHECK_PROMPT_TOKENS]
    for row in range(sequences):  # a different prompt per page: row r drops its first r tokens
        decoder._eager(torch.tensor([prompt[row:]]), decode_params(decoder.cache, [[row]], [0]))
    for batch in sorted({1, sequences}):
        lengths = [CHECK_PROMPT_TOKENS - row for row in range(batch)]
        next_ids = torch.tensor([[prompt[-1]]] * batch)

        def step(run):
            table = [[row] + [0] * (TABLE_STEP - 1) for row in range(batch)]
            return run(next_ids, decode_params(decoder.cache, table, lengths)).float().cpu()

        eager = step(decoder._eager)
        replayed = step(decoder.forward)
        if reason := decoder.gave_up or replay_differs(batch, eager, replayed):
            return reason
    return None


# the parameters exllamav3's generator passes every pass of the model (Job.prefill, Generator.iterate_gen)
PASS_PARAMETERS = frozenset(
    {"attn_mode", "block_table", "cache", "cache_seqlens", "recurrent_states", "indexed_embeddings"}
)


def decode_params(cache, block_table, lengths) -> dict:
    """A decode or prefill step's parameters as exllamav3's generator passes them; the tables as lists, or as int32
    tensors, which are used as they are."""
    return {
        "attn_mode": "flash_attn",
        "block_table": torch.as_tensor(block_table, dtype=torch.int32),
        "cache": cache,
        "cache_seqlens": torch.as_tensor(lengths, dtype=torch.int32),
        "recurrent_states": None,
        "indexed_embeddings": [],
        "positions": None,
        "recurrent_history": False,
    }


def takes_host_input(module) -> bool:
    """A module that runs before the graph: on the CPU, or reading its input there (a quantized embedding table)."""
    return module.device is None or module.device.type == "cpu" or bool(module.caps.get("x_cpu"))


def host_prologue(modules: list) -> int:
    """How many leading modules run on the host, before the first card's graph."""
    return next((i for i, (module, _, _) in enumerate(modules) if not takes_host_input(module)), len(modules))
