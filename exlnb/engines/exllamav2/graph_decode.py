"""Decode steps of an ExLlamaV2 model replayed from CUDA graphs, where exllamav2 0.3.2 launches every kernel
from Python.

A 7B decode step is about 858 kernel launches; on a host whose launch path is slow, the launches and not the
GPU set the speed (benchmarks/README.md: the GPU's own time is 1.6x the weights-over-bandwidth floor, the step
3.3x). A CUDA graph replays the whole step with one call. A probe (benchmarks/README.md) found what can be captured:
the GPU modules (decoder layers, final norm, head) chained by hand as `forward_chunk` runs them; not
`model.forward`/`forward_chunk` itself, which copies pageable memory and synchronises inside.

How the dynamic generator's decode steps become replays: `install()` puts `GraphDecoder.forward_chunk` in
front of the model's own. A step qualifies when it is paged (exlnb's paged attention), one token per
sequence, an fp16 cache, no LoRA, no indexed embeddings, no per-job RoPE offsets, all GPU modules on one
device; anything else (prefill, the streaming generator's unpaged passes, a q4 cache) runs the model's own
method unchanged. The step's inputs are copied into static buffers (hidden states after the CPU-side
embedding, cache lengths, block table); a graph is captured on first use per batch size and per block-table
width bucket (1, 2, 4, ... pages; a column past a sequence's length is masked out, so padding the width
changes no value). The batch is not padded: on the GPU a GEMM of 8 rows rounds differently from one of 5, and
padded batches flipped greedy tokens against eager decode on a 7B-shaped model (near-ties are common with
random weights), where a graph per exact batch size gives the same tokens as eager.

Measured on an H100 (benchmarks/README.md): the bundled model decodes 4.2x to 7.8x as fast at batch 1; the
7B-shaped model's replayed step takes 7.3 ms of GPU time, 1.66x the floor, so there the kernels now set the speed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from exlnb.engines.cuda_graphs import CaptureFailed, StepGraphs, bucket_for, buckets, replay_differs
from exlnb.engines.device_sampling import DeviceDraws, Row
from exlnb.engines.exllamav2 import paged_attention

CHECK_PROMPT_TOKENS = 24


class GraphDecoder:
    """Replays the decode steps of one ExLlamaV2 model and cache from CUDA graphs (see the module docstring)."""

    def __init__(self, model, cache, *, page_size: int, max_batch_size: int, max_pages: int) -> None:
        self.model, self.cache, self.page_size = model, cache, page_size
        self._eager = model.forward_chunk  # the model's own bound method
        first_gpu = next(i for i, m in enumerate(model.modules) if _on_gpu(m))
        self._host_modules, self._device_modules = model.modules[:first_gpu], model.modules[first_gpu:]
        self.device = torch.device("cuda", self._device_modules[0].device_idx)
        self.max_batch_size, self.page_buckets = max_batch_size, buckets(max_pages)
        rows, width = max_batch_size, self.page_buckets[-1]
        self._hidden: torch.Tensor | None = None  # (rows, 1, hidden) in the embedding's dtype, made at first use
        self._seqlens = torch.zeros((rows,), dtype=torch.int32, device=self.device)
        self._block_table = torch.zeros((rows, width), dtype=torch.int32, device=self.device)
        self._graphs = StepGraphs(self.device)
        self.installed = False
        self.gave_up = ""  # why decode went back to eager after a capture failed mid-generation, if it did
        self.draws: DeviceDraws | None = None  # where the engine samples on the device: the graph draws too
        self.step_rows: Callable[[], list[tuple[object, Row | None]]] = list  # the engine's rows of a step

    @property
    def replays(self) -> int:
        return self._graphs.replays

    # -- in front of the model's own forward_chunk ---------------------------------------------------------

    def install(self) -> None:
        self.model.forward_chunk = self.forward_chunk  # an instance attribute: model.forward finds it too
        self.installed = True

    def uninstall(self) -> None:
        if self.installed:
            del self.model.forward_chunk
            self.installed = False
        self._graphs.clear()

    def forward_chunk(self, input_ids: torch.Tensor, cache=None, *args, attn_params=None, **kwargs):
        """The model's `forward_chunk`: a replay where the step qualifies, the model's own method otherwise."""
        key = None if args or self.gave_up else self._key(input_ids, cache, attn_params, kwargs)
        if key is not None:
            try:
                return {"logits": self._replay(key, input_ids, attn_params, kwargs)}
            except CaptureFailed as failure:  # this step and every later one run eagerly; the status says why
                self.gave_up = str(failure)
        if self.draws is not None:
            self.draws.forget_step()  # the jobs draw alone from the eager logits
        return self._eager(input_ids, cache, *args, attn_params=attn_params, **kwargs)

    def _key(self, input_ids: torch.Tensor, cache, attn_params, kwargs: dict) -> tuple[int, int] | None:
        """The (batch size, pages bucket) of a step that qualifies for a graph; None for one that does not."""
        from exllamav2.attn import ExLlamaV2Attention

        if cache is not self.cache or not isinstance(attn_params, ExLlamaV2Attention.PagedParams):
            return None
        if input_ids.dim() != 2 or input_ids.shape[1] != 1 or any(kwargs.get(k) for k in _EAGER_ONLY_ARGUMENTS):
            return None
        if set(kwargs) - _ALLOWED_ARGUMENTS or attn_params.alt_rope_embed or attn_params.rope_offsets is not None:
            return None
        batch = input_ids.shape[0]
        pages = bucket_for(attn_params.block_index.shape[1], self.page_buckets)
        return None if batch > self.max_batch_size or pages is None else (batch, pages)

    def _replay(self, key: tuple[int, int], input_ids: torch.Tensor, attn_params, kwargs: dict) -> torch.Tensor:
        from exllamav2.device import set_device_streams

        x = input_ids
        for module in self._host_modules:  # the embedding, on the CPU in exllamav2 by default
            x = module.forward(x, cache=self.cache, attn_params=attn_params, past_len=0, loras=kwargs.get("loras"),
                               indexed_embeddings=kwargs.get("indexed_embeddings"))
        set_device_streams()  # as forward_chunk does: the generator reads the logits on exllamav2's stream
        self._stage(key, x, attn_params.cache_seqlens, attn_params.block_index)
        drawn = self.draws is not None and self.draws.stage(self.step_rows(), key[0])
        # the graph must record the attention layout's kernels, not reuse the warm-up's
        out = self._graphs.replay((*key, drawn), lambda: self._step(*key, drawn),
                                  shape=f"batch {key[0]} over {key[1]} pages", around_capture=paged_attention.forget_layout)
        self.cache.current_seq_len += 1
        if drawn:
            out, tokens = out
            self.draws.remember(tokens)
        return out[: input_ids.shape[0]]

    # -- what a graph replays -------------------------------------------------------------------------

    def _step(self, rows: int, width: int, draws: bool):
        """The GPU modules at one shape, over the static buffers; with `draws`, the device sampler's draws too."""
        params = self._static_params(rows, width)

        def run():
            logits = self._run_device_modules(rows, params)
            return (logits, self.draws.batch.sample(logits)) if draws else logits

        return run

    def _static_params(self, rows: int, width: int):
        """Paged parameters over the static buffers. exllamav2 builds them on the CPU and copies them per
        layer call; here they already live on the device, so nothing is copied inside the graph."""
        from exllamav2.attn import ExLlamaV2Attention

        params = ExLlamaV2Attention.PagedParams(
            batch_size=rows,
            block_index=torch.zeros((rows, width), dtype=torch.int32),
            cache_seqlens=torch.zeros((rows,), dtype=torch.int32),
            max_cache_seqlen=0,
            page_size=self.page_size,
            q_len=1,
        )
        # batch 1 would write through a host-side offset (`first_index`) baked in at capture; the general path
        # reads the positions from the device
        params.is_sequential = False
        params.block_index = self._block_table[:rows, :width]
        params.cache_seqlens = self._seqlens[:rows]
        return params

    def _run_device_modules(self, rows: int, params) -> torch.Tensor:
        """The GPU half of `forward_chunk` at q_len 1: the modules, then its logit softcap and head padding."""
        x = self._hidden[:rows].clone()  # modules add into their input in place: keep the staged input as it was
        for module in self._device_modules:
            x = module.forward(x, cache=self.cache, attn_params=params, past_len=0)
        config = self.model.config
        if config.final_logit_softcapping:
            from exllamav2.ext import exllamav2_ext as ext_c

            ext_c.softcap_(x, config.final_logit_softcapping)
        padding = self._device_modules[-1].padding
        if padding > 0:
            x[:, :, -padding:] = -65504.0
        return x

    # -- the check a load runs before graphs are used --------------------------------------------------------

    def self_check(self, token_ids: list[int]) -> str | None:
        """Decode one step eagerly and by replay, at batch 1 and at batch 3, over the cache's first
        pages (the generator holds nothing yet); None where they agree, else why not, in a line."""
        from exllamav2.attn import ExLlamaV2Attention

        pages = self.cache.max_seq_len // self.page_size
        sequences = min(3, pages, self.max_batch_size)
        prompt = (token_ids * CHECK_PROMPT_TOKENS)[:CHECK_PROMPT_TOKENS]
        for row in range(sequences):  # a different prompt per page: row r drops its first r tokens
            ids = torch.tensor([prompt[row:]], dtype=torch.long)
            params = ExLlamaV2Attention.PagedParams(1, torch.tensor([[row]], dtype=torch.int32),
                                                    torch.zeros((1,), dtype=torch.int32), 0, self.page_size, q_len=ids.shape[1])
            self._eager(ids, self.cache, attn_params=params, preprocess_only=True)
        for batch in sorted({1, sequences}):
            lengths = [CHECK_PROMPT_TOKENS - row for row in range(batch)]
            next_ids = torch.tensor([[prompt[-1]] for _ in range(batch)], dtype=torch.long)
            block_index = torch.arange(batch, dtype=torch.int32)[:, None]

            def step(run):
                params = ExLlamaV2Attention.PagedParams(batch, block_index.clone(), torch.tensor(lengths, dtype=torch.int32),
                                                        max(lengths), self.page_size, q_len=1)
                return run(next_ids, self.cache, attn_params=params, loras=None, indexed_embeddings=[])["logits"].float().cpu()

            eager = step(self._eager)
            replayed = step(self.forward_chunk)
            if reason := self.gave_up or replay_differs(batch, eager, replayed):
                return reason
        return None

    def describe(self) -> str:
        if self.gave_up:
            return f"eager since {self.gave_up}"
        drawn = ", sampling on the GPU" if self.draws is not None else ""
        return f"CUDA graphs, {self._graphs.describe()}{drawn}"


# forward_chunk's arguments a replay can take (the dynamic generator passes these), and those that need eager
_ALLOWED_ARGUMENTS = {"loras", "indexed_embeddings", "abort_event"}
_EAGER_ONLY_ARGUMENTS = ("loras", "indexed_embeddings")


def _on_gpu(module) -> bool:
    return module.device_idx is not None and module.device_idx >= 0


def cannot_graph(engine) -> str | None:
    """Why an ExLlamaV2 engine's decode cannot run from graphs, in a line; None where it can try."""
    if not engine.paged:
        return "unpaged: the dynamic generator's unpaged passes stay eager"
    if not paged_attention.installed():
        return f"attention is {engine.attention}: graphs are verified over exlnb's paged attention only"
    if engine.options.cache_dtype != "fp16":
        return f"a {engine.options.cache_dtype} cache is dequantised per step to a length read on the host"
    devices = {m.device_idx for m in engine.model.modules if _on_gpu(m)}
    if len(devices) != 1 or engine.model.tp_context is not None:
        return "the model spans several GPUs"
    return None
