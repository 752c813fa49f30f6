"""The ExLlamaV3 engine's prompts that arrive together, prefilled in one pass (`../prefill_together.py` says why).

exllamav3's `Job.prefill` runs a job's prompt through `model.prefill(input_ids, params)` (one row, the paged
parameters in a dict) and may first copy a cached page's first keys and values into the prompt's first page with
`cache.copy_page`; while the generator iterates, `PrefillTogether` stands in front of both.
"""

from __future__ import annotations

import torch

from exlnb.engines.exllamav3.graph_checks import PASS_PARAMETERS
from exlnb.engines.options import PAGE_TOKENS
from exlnb.engines.prefill_together import HeldPass, HeldPasses

PREFILL_PARAMETERS = PASS_PARAMETERS | {"inv_freq", "mm_span_prefix"}  # what exllamav3's Job.prefill passes


class PrefillTogether(HeldPasses):
    """On a generator: its `iterate` runs with prompt passes held and run together."""

    PASS, COPY = "prefill", "copy_page"
    READERS = ("forward",)  # the decode step, which exllamav3 runs after the prompt passes in the same iterate()
    # its GPU suite passed with it on since READERS, but for one test whose unseeded draw met the end token early
    # (since greedy, past it); 1,548 against 1,290 tokens/s at batch 8, level at batch 1 (H200, 2026-11-29-c)
    ON_BY_DEFAULT = True

    def __init__(self, generator) -> None:
        super().__init__(generator, PAGE_TOKENS)

    def copy(self, target, from_page: int, to_page: int, num_tokens: int):
        self.touch({from_page, to_page})
        return self._copy(target, from_page, to_page, num_tokens)

    def prefill(self, input_ids: torch.Tensor, params: dict | None = None):
        if self._holds(input_ids, params):
            start = int(params["cache_seqlens"][0])
            self.hold(HeldPass(input_ids, params["block_table"], start, {"params": params}))
            return None  # the generator reads nothing a prompt pass returns
        self.run_held()
        return self._inner(input_ids=input_ids, params=params)

    def _holds(self, input_ids: torch.Tensor, params: dict | None) -> bool:
        """A prompt pass of one row over the generator's cache, with nothing of its own that a batch cannot carry."""
        if not params or set(params) - PREFILL_PARAMETERS:
            return False
        table, lengths = params.get("block_table"), params.get("cache_seqlens")
        return (
            params.get("attn_mode") == "flash_attn"
            and params.get("cache") is self.generator.cache
            and not params.get("recurrent_states")
            and not params.get("indexed_embeddings")
            and params.get("inv_freq") is None
            and not params.get("mm_span_prefix")
            and input_ids.dim() == 2
            and input_ids.shape[0] == 1
            and isinstance(table, torch.Tensor)
            and table.device.type == "cpu"
            and table.shape[0] == 1
            and isinstance(lengths, torch.Tensor)
            and lengths.device.type == "cpu"
        )

    def run_one(self, held: HeldPass) -> None:
        self._inner(input_ids=held.ids, params=held.call["params"])

    def run_batch(self, batch: list[HeldPass], ids: torch.Tensor, table: torch.Tensor, starts: torch.Tensor) -> None:
        params = dict(batch[0].call["params"], block_table=table, cache_seqlens=starts)
        self._inner(input_ids=ids, params=params)
