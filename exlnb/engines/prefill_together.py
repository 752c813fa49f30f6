"""Prompts that arrive together, prefilled in one forward pass instead of one pass each: what both GPU engines share.

exllamav2's and exllamav3's generators ingest each new job's prompt with a forward pass of its own, one job after
the other, in the same `iterate()`: 8 jobs submitted together make 8 eager passes before the first decode step. On
an H200 the slowest of 8 jobs with 128-token prompts waited 186 ms (ExLlamaV2 engine) and 199 ms (ExLlamaV3 engine)
for its first token, about 23 ms a pass, where transformers, prefilling the batch at once, waited 55; an eager pass
of the 7B shape is bound by the host issuing its kernels (docs/gpu.md), whatever its length. That ramp is most of
what batch 8 loses (benchmarks/results/speed-nvidia-h200-2026-11-29).

Each engine's `PrefillTogether` stands in front of its model's prompt pass and its cache's page copy while the
generator iterates. A prompt pass of one row with nothing of its own that a batch cannot carry is held back; the
held passes run before any other pass, before the library copies keys and values out of or into a held pass's
page (a new prompt that begins as a cached page does takes that page's first keys and values), before a prompt
pass that reads or writes a held pass's pages (a prompt that shares whole pages with one being ingested), and at
the end of the iteration. The generator's bookkeeping reads nothing a prompt pass returns, so the cache ends as it
would have, up to rounding: rows that share one product instead of each having its own.

What else reads the cache within an `iterate()` runs through those doors in both libraries as exlnb loads them;
exllamav3's copy of pages to a disk tier (`write_behind`, with a `cpu_cache_size`, which exlnb does not pass) would
not, and would need one of its own.

A held pass that fails raises out of the `iterate()` that runs it, not out of its own job's prefill: exllamav3,
which fails only the job whose prefill raised, then fails the whole step's jobs instead.

Held passes of one length run as one batch (a batch is rectangular). A pass of a length no other held pass has runs
exactly as it came: cutting passes into common stretches takes as many passes as there are lengths, so it would gain
nothing where each pass costs the host the same.

On an H200 (benchmarks/results/speed-nvidia-h200-2026-11-29-b) it took the ExLlamaV2 engine's slowest first token
of 8 from 174 to 45 ms and batch 8 from 1,253 to 1,482 tokens/s, level at batch 1, and its GPU suite passed with it
on, so it is on there (`EXLNB_PREFILL_TOGETHER=0` turns it off). On the ExLlamaV3 engine that run found its decode
step reading a held pass's keys before the pass ran, which `READERS` now prevents; the next
(benchmarks/results/speed-nvidia-h200-2026-11-29-c) passed its suite but for one test whose unseeded draw met the end
token early (greedy since), and timed it at 1,548 against 1,290 tokens/s: it is on there too.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

NOTE = "prompts that arrive together prefilled in one forward pass"


def prefill_together_on(default: bool = False) -> bool:
    """Whether a GPU engine prefills prompts that arrive together in one pass: `EXLNB_PREFILL_TOGETHER` (1 or 0, read
    at each load) where it is set, else the engine's own default."""
    value = os.environ.get("EXLNB_PREFILL_TOGETHER")
    return default if value is None else value != "0"


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


@dataclass(frozen=True)
class HeldPass:
    """One prompt pass held back: its tokens, its row of the block table (on the host), where it starts, and the
    call as it came (replayed as it was where the pass runs alone)."""

    ids: torch.Tensor  # (1, tokens)
    table: torch.Tensor  # (1, pages) int32
    start: int
    call: dict

    def pages(self, page_size: int) -> set[int]:
        """The pages the pass writes and reads: its own tokens', and every page before them that it attends to
        (pages it may share with another prompt that begins the same)."""
        return set(self.table[0, pages(0, self.start + self.ids.shape[1], page_size)].tolist())


def stacked(batch: list[HeldPass]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch's tokens (rows, tokens), block table (rows, widest) and start positions (rows,) int32."""
    table = torch.zeros((len(batch), max(h.table.shape[1] for h in batch)), dtype=torch.int32)
    for row, held in enumerate(batch):
        table[row, : held.table.shape[1]] = held.table[0]  # past a row's own pages: never read
    starts = torch.tensor([held.start for held in batch], dtype=torch.int32)
    return torch.cat([held.ids for held in batch]), table, starts


class HeldPasses:
    """The held passes of one generator and when they run, installed as its `iterate` (an instance attribute, found
    before the class's method); an engine's `PrefillTogether` names its library's prompt pass and page copy (`PASS`,
    `COPY`: a method of the model and one of the cache, each stood in front of by this one's of the same name) and
    says how a pass is recognised and how a batch runs."""

    PASS: str
    COPY: str
    ON_BY_DEFAULT: bool  # whether the engine prefills together where EXLNB_PREFILL_TOGETHER is not set
    READERS: tuple[str, ...] = ()  # the model's other passes that read the cache (a decode step), where PASS is not

    def __init__(self, generator, page_size: int) -> None:
        self.generator, self.model = generator, generator.model
        self.page_size = page_size
        self.max_tokens = generator.max_chunk_size  # a pass of more tokens would overrun the model's buffers
        self.held: list[HeldPass] = []
        self.held_pages: set[int] = set()
        self.passes_held = self.passes_run = 0  # prompt passes held back, and the forward passes that ran them
        self._iterate = generator.iterate
        self._inner: Callable | None = None  # the model's prompt pass and the cache's page copy, while it iterates
        self._copy: Callable | None = None
        generator.iterate = self.iterate

    @classmethod
    def start(cls, generator, notes: list[str], *, batchable: bool) -> HeldPasses | None:
        """For an engine's generator, each time it makes one; None where prompts are prefilled one by one (the
        switch off, an unpaged cache, or a generator whose passes carry more than a batch can: a draft model, tensor
        parallelism, recurrent state)."""
        paged = getattr(generator, "paged", True)  # exllamav2's may be unpaged, exllamav3's always is
        if not (prefill_together_on(cls.ON_BY_DEFAULT) and batchable and paged and generator.draft_model is None):
            return None
        notes += [] if NOTE in notes else [NOTE]
        return cls(generator)

    def iterate(self) -> list[dict]:
        """One `iterate()` of the generator with passes held, the model's prompt pass (exlnb's graph decoder's, where
        it stands in front of it) and the cache's page copy behind this one's: those still held run at its end, and
        before an error leaves it, since the generator counts them as done."""
        cache = self.generator.cache
        self._inner, self._copy = getattr(self.model, self.PASS), getattr(cache, self.COPY)
        with ExitStack() as stack:
            stack.enter_context(standing_in(self.model, self.PASS, getattr(self, self.PASS)))
            stack.enter_context(standing_in(cache, self.COPY, self.copy))
            for name in self.READERS:
                stack.enter_context(standing_in(self.model, name, self._after_held(getattr(self.model, name))))
            try:
                try:
                    results = self._iterate()
                except BaseException:
                    self.run_held()
                    raise
                self.run_held()
                return results
            finally:
                self.held, self.held_pages = [], set()  # a pass that failed is not run again

    def _after_held(self, reader: Callable) -> Callable:
        """`reader` (a pass that reads the cache), once the held passes have run: a job's first decode step comes in
        the same `iterate()` as its prompt pass and reads the keys that pass writes."""

        def after_held(*args, **kwargs):
            self.run_held()
            return reader(*args, **kwargs)

        return after_held

    def copy(self, target, *spans):
        raise NotImplementedError

    def hold(self, held: HeldPass) -> None:
        claimed = held.pages(self.page_size)
        self.touch(claimed)
        self.held.append(held)
        self.held_pages |= claimed
        self.passes_held += 1

    def touch(self, claimed: set[int]) -> None:
        """Something is about to read or write these pages of the cache: the held passes that own one run first."""
        if claimed & self.held_pages:
            self.run_held()

    def copying(self, spans: tuple[tuple[int, int], ...]) -> None:
        """A copy between these spans of the whole cache, each (first position, positions), is about to run."""
        self.touch({p for at, n in spans for p in pages(at, n, self.page_size)})

    def run_held(self) -> None:
        """Run the held passes: those of one length as one batch, a pass alone as it came."""
        if not self.held:
            return
        held, self.held, self.held_pages = self.held, [], set()
        for indices in batches([h.ids.shape[1] for h in held], self.max_tokens):
            batch = [held[i] for i in indices]
            with torch.inference_mode():
                if len(batch) == 1:
                    self.run_one(batch[0])
                else:
                    self.run_batch(batch, *stacked(batch))
            self.passes_run += 1

    def run_one(self, held: HeldPass) -> None:
        raise NotImplementedError

    def run_batch(self, batch: list[HeldPass], ids: torch.Tensor, table: torch.Tensor, starts: torch.Tensor) -> None:
        raise NotImplementedError
