"""The ExLlamaV2 engine's prompts that arrive together, prefilled in one pass (`../prefill_together.py` says why).

exllamav2's `ExLlamaV2DynamicJob.prefill` runs a job's prompt through `model.forward_chunk` (one row,
`preprocess_only`, paged parameters) and may first copy a cached page's first keys and values into the prompt's
first page with `cache.copy_states`; while the generator iterates, `PrefillTogether` stands in front of both.
"""

from __future__ import annotations

import torch

from exlnb.engines.prefill_together import HeldPass, HeldPasses

PREFILL_ARGUMENTS = {"preprocess_only", "loras", "indexed_embeddings"}  # what exllamav2 prefills with, by name


class PrefillTogether(HeldPasses):
    """On a paged generator: its `iterate` runs with prompt passes held and run together."""

    PASS, COPY = "forward_chunk", "copy_states"
    ON_BY_DEFAULT = True  # its GPU suite passed with it on; faster at batch 8, level at batch 1 (on an H200)

    def __init__(self, generator) -> None:
        super().__init__(generator, generator.page_size)

    def copy(self, target, from_column: int, from_columns: int, to_column: int, to_columns: int, *rows):
        self.copying(((from_column, from_columns), (to_column, to_columns)))
        return self._copy(target, from_column, from_columns, to_column, to_columns, *rows)

    def forward_chunk(self, input_ids: torch.Tensor, cache=None, *args, attn_params=None, **kwargs):
        if not args and self._holds(input_ids, cache, attn_params, kwargs):
            start = int(attn_params.cache_seqlens[0])
            self.hold(HeldPass(input_ids, attn_params.block_index, start, {"params": attn_params, "kwargs": kwargs}))
            return None  # the generator reads nothing a prompt pass returns
        self.run_held()
        return self._inner(input_ids, cache, *args, attn_params=attn_params, **kwargs)

    def _holds(self, input_ids: torch.Tensor, cache, attn_params, kwargs: dict) -> bool:
        """A prompt pass of one row over the generator's cache, with nothing of its own that a batch cannot carry."""
        return (
            kwargs.get("preprocess_only") is True
            and set(kwargs) <= PREFILL_ARGUMENTS
            and not kwargs.get("loras")
            and not kwargs.get("indexed_embeddings")
            and cache is self.generator.cache
            and input_ids.dim() == 2
            and input_ids.shape[0] == 1
            and getattr(attn_params, "paged", False)
            and attn_params.block_index.shape[0] == 1
            and not attn_params.alt_rope_embed
            and attn_params.rope_offsets is None
        )

    def run_one(self, held: HeldPass) -> None:
        self._inner(held.ids, self.generator.cache, attn_params=held.call["params"], **held.call["kwargs"])

    def run_batch(self, batch: list[HeldPass], ids: torch.Tensor, table: torch.Tensor, starts: torch.Tensor) -> None:
        params = self.generator.get_paged_params(len(batch), table, starts, ids.shape[1])
        self._inner(ids, self.generator.cache, attn_params=params, **batch[0].call["kwargs"])
