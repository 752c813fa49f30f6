"""Prompts that arrive together, prefilled in one forward pass instead of one pass each.

exllamav2's dynamic generator ingests each new job's prompt with a `forward_chunk` of its own, one job after the
other, in the same `iterate()`: 8 jobs submitted together make 8 eager passes before the first decode step. On an
H200 the slowest of 8 jobs with 128-token prompts waited 186 ms for its first token, about 23 ms a pass, where
transformers, prefilling the batch at once, waited 55; an eager pass of the 7B shape is bound by the host issuing
its kernels (docs/gpu.md), whatever its length. That ramp is most of what batch 8 loses
(benchmarks/results/speed-nvidia-h200-2026-11-29).

`PrefillTogether` stands in front of the model's `forward_chunk` while the generator iterates. A prompt pass (paged,
one row, `preprocess_only`, no LoRA, embeddings or RoPE of its own) is held back; the held passes run before any
other pass, before exllamav2 copies keys and values out of or into a held pass's page (a new prompt that begins as a
page does takes that page's first keys and values), before a prompt pass that reads or writes a held pass's pages (a
prompt that shares whole pages with one being ingested), and at the end of the iteration. The generator's
bookkeeping reads nothing a prompt pass returns, so the cache ends as it would have, up to rounding: rows that share
one product instead of each having its own.

Held passes of one length run as one batch (a batch is rectangular). A pass of a length no other held pass has runs
exactly as it came: cutting passes into common stretches takes as many passes as there are lengths, so it would gain
nothing where each pass costs the host the same.

Off unless `EXLNB_PREFILL_TOGETHER=1` until a GPU has timed it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

NOTE = "prompts that arrive together prefilled in one forward pass (EXLNB_PREFILL_TOGETHER=1)"


def prefill_together_on() -> bool:
    """Whether the ExLlamaV2 engine prefills prompts that arrive together in one pass (off unless
    `EXLNB_PREFILL_TOGETHER=1`, read at each load, until it is timed on a GPU)."""
    return os.environ.get("EXLNB_PREFILL_TOGETHER", "0") == "1"


@dataclass(frozen=True)
class HeldPass:
    """One prompt pass held back: its tokens, its parameters (its row of the block table, where it starts), its
    other arguments."""

    ids: torch.Tensor  # (1, tokens)
    params: object  # exllamav2's PagedParams, one row; its block table and lengths on the host
    kwargs: dict

    @property
    def table(self) -> torch.Tensor:
        return self.params.block_index

    @property
    def start(self) -> int:
        return int(self.params.cache_seqlens[0])

    def pages(self, page_size: int) -> set[int]:
        """The pages the pass writes and reads: its own tokens', and every page before them that it attends to
        (pages it may share with another prompt that begins the same)."""
        return set(self.table[0, pages(0, self.start + self.ids.shape[1], page_size)].tolist())


def pages(start: int, tokens: int, page_size: int) -> range:
    """The pages (of a sequence's own, or of the whole cache) that `tokens` tokens from position `start` lie in."""
    return range(start // page_size, -(-(start + tokens) // page_size))


def batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """The passes of each length, in the order each length first came, cut so that no batch holds more than
    `max_tokens` tokens (a pass longer than that alone)."""
    groups: dict[int, list[int]] = {}
    for i, length in enumerate(lengths):
        groups.setdefault(length, []).append(i)
    out = []
    for length, group in groups.items():
        rows = max(1, max_tokens // length)
        out += [group[at : at + rows] for at in range(0, len(group), rows)]
    return out


@contextmanager
def standing_in(owner, name: str, replacement) -> Iterator[None]:
    """`owner.name` is `replacement` (an instance attribute) for the block's length, then what it was."""
    had = owner.__dict__.get(name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        if had is None:
            delattr(owner, name)
        else:
            setattr(owner, name, had)


class PrefillTogether:
    """Installed on a paged generator: its `iterate` runs with prompt passes held and run together."""

    def __init__(self, generator) -> None:
        self.generator = generator
        self.model = generator.model
        self.page_size = generator.page_size
        self.max_tokens = generator.max_chunk_size  # a pass of more tokens would overrun the model's buffers
        self.held: list[HeldPass] = []
        self.held_pages: set[int] = set()
        self.passes_held = self.passes_run = 0  # prompt passes held back, and the forward passes that ran them
        self._inner: Callable | None = None  # the forward_chunk and copy_states this one's stand in front of
        self._copy: Callable | None = None
        self._iterate = generator.iterate
        generator.iterate = self.iterate  # an instance attribute, found before the class's method

    @classmethod
    def start(cls, generator, notes: list[str]) -> PrefillTogether | None:
        if not (prefill_together_on() and generator.paged and generator.draft_model is None):
            return None
        notes.append(NOTE)
        return cls(generator)

    def iterate(self) -> list[dict]:
        """The generator's `iterate()`, with the model's `forward_chunk` (exlnb's graph decoder's, where it is
        installed) and the cache's `copy_states` behind this one's for its length."""
        cache = self.generator.cache
        self._inner, self._copy = self.model.forward_chunk, cache.copy_states
        with standing_in(self.model, "forward_chunk", self.forward_chunk), standing_in(cache, "copy_states", self.copy):
            try:
                try:
                    results = self._iterate()
                except BaseException:
                    self.run_held()  # the generator counts the held passes as done: they fill the cache first
                    raise
                self.run_held()
                return results
            finally:
                self.held, self.held_pages = [], set()  # a pass that failed is not run again

    def copy(self, target, from_column: int, from_columns: int, to_column: int, to_columns: int, *rows):
        """The cache's `copy_states`: exllamav2 copies the keys and values of a page that begins like a new prompt
        into the prompt's first page; where either page is a held pass's, the held passes run first."""
        size = self.page_size
        touched = {p for at, n in ((from_column, from_columns), (to_column, to_columns)) for p in pages(at, n, size)}
        if touched & self.held_pages:
            self.run_held()
        return self._copy(target, from_column, from_columns, to_column, to_columns, *rows)

    def forward_chunk(self, input_ids: torch.Tensor, cache=None, *args, attn_params=None, **kwargs):
        if not args and self._holds(input_ids, cache, attn_params, kwargs):
            held = HeldPass(input_ids, attn_params, kwargs)
            pages = held.pages(self.page_size)
            if pages & self.held_pages:
                self.run_held()
            self.held.append(held)
            self.held_pages |= pages
            self.passes_held += 1
            return None  # the generator reads nothing a prompt pass returns
        self.run_held()
        return self._inner(input_ids, cache, *args, attn_params=attn_params, **kwargs)

    def _holds(self, input_ids: torch.Tensor, cache, attn_params, kwargs: dict) -> bool:
        """A prompt pass of one row over the generator's cache, with nothing of its own that a batch cannot carry."""
        return (
            kwargs.get("preprocess_only") is True
            and cache is self.generator.cache
            and input_ids.dim() == 2
            and input_ids.shape[0] == 1
            and getattr(attn_params, "paged", False)
            and attn_params.block_index.shape[0] == 1
            and not attn_params.alt_rope_embed
            and attn_params.rope_offsets is None
            and not kwargs.get("loras")
            and not kwargs.get("indexed_embeddings")
            and set(kwargs) <= {"preprocess_only", "loras", "indexed_embeddings"}
        )

    def run_held(self) -> None:
        """Run the held passes: those of one length as one batch, a pass alone as it came."""
        held, self.held, self.held_pages = self.held, [], set()
        for indices in batches([h.ids.shape[1] for h in held], self.max_tokens):
            batch = [held[i] for i in indices]
            if len(batch) == 1:
                self._run(batch[0].ids, batch[0].params, batch[0].kwargs)
                continue
            width = max(h.table.shape[1] for h in batch)
            table = torch.zeros((len(batch), width), dtype=torch.int32)  # past a row's own pages: never read
            for row, h in enumerate(batch):
                table[row, : h.table.shape[1]] = h.table[0]
            starts = torch.tensor([h.start for h in batch], dtype=torch.int32)
            params = self.generator.get_paged_params(len(batch), table, starts, batch[0].ids.shape[1])
            self._run(torch.cat([h.ids for h in batch]), params, batch[0].kwargs)

    def _run(self, ids: torch.Tensor, params, kwargs: dict) -> None:
        with torch.inference_mode():
            self._inner(ids, self.generator.cache, attn_params=params, **kwargs)
        self.passes_run += 1
