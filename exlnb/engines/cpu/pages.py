"""The paged KV cache's bookkeeping: a pool of fixed-size pages, ref counts, and prefix reuse.

Like exllamav2's dynamic generator (and nano-vllm's block manager): a job reserves every page it can ever
need when it is admitted, so a running job never stalls for memory. A full page of prompt tokens is
identified by a hash chained over every token before it; a later job whose prompt starts the same way
references that page instead of recomputing it, even while the page is still being computed (jobs admitted
together, such as `--n` samples, share from the start): one job, the page's writer, computes it and the
others wait for it. Pages whose ref count drops to zero go back to the free list but keep their contents
and hash until they are reused (least recently freed first), so a prompt repeated after its first job
ended is still found.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Page:
    index: int
    ref_count: int = 0
    tokens_filled: int = 0
    prefix_hash: int | None = None  # set for a page of prompt tokens that other jobs may share
    owners: set[int] = field(default_factory=set)
    writer: int | None = None  # the job computing this shared page; None once it is full


@dataclass(frozen=True)
class Reservation:
    """What a job got: its page table, whose first `shared_pages` pages it found by prefix hash."""

    page_table: tuple[int, ...]
    shared_pages: int


def prefix_hashes(token_ids: Sequence[int], page_size: int) -> list[int]:
    """Chained hashes of each full page: page i's hash covers tokens [0, (i + 1) * page_size)."""
    hashes, previous = [], 0
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        previous = hash((previous, tuple(token_ids[start : start + page_size])))
        hashes.append(previous)
    return hashes


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.pages = [Page(i) for i in range(num_pages)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_pages))
        self._by_hash: dict[int, int] = {}

    @property
    def free_count(self) -> int:
        return len(self._free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def reserve(self, job_id: int, prompt_ids: Sequence[int], total_tokens: int) -> Reservation | None:
        """Reserve pages for `total_tokens`, reusing cached prompt pages; None if too few pages are free.

        At least the last prompt token is always recomputed: its logits start the generation.
        """
        hashes = prefix_hashes(prompt_ids[: len(prompt_ids) - 1], self.page_size)
        reused: list[int] = []
        for h in hashes:
            index = self._by_hash.get(h)
            if index is None:
                break
            reused.append(index)
        needed = self.pages_for(total_tokens) - len(reused)
        free_after_reuse = self.free_count - sum(1 for i in reused if i in self._free)
        if needed > free_after_reuse:
            return None
        for index in reused:
            self._take(index, job_id)
        fresh = []
        for _ in range(needed):
            index = next(i for i in self._free)  # least recently freed first
            self._forget(index)
            self._take(index, job_id)
            fresh.append(index)
        page_table = tuple(reused + fresh)
        # exllamav2 0.3.2 (dynamic.py, allocate_pages) registers a prompt page's hash when it allocates the page,
        # not when it is filled, so jobs started together find each other's pages
        for n, h in enumerate(prefix_hashes(prompt_ids, self.page_size)[len(reused) :], len(reused)):
            if self._by_hash.get(h) is None:
                self._by_hash[h] = page_table[n]
                self.pages[page_table[n]].prefix_hash = h
                self.pages[page_table[n]].writer = job_id
        return Reservation(page_table=page_table, shared_pages=len(reused))

    def prefill_span(self, job_id: int, reservation: Reservation, computed: int) -> tuple[int, int | None]:
        """Where a prefilling job's next chunk starts, and where it must stop (None: no limit).

        Like exllamav2's prefill, which skips pages another job has filled: shared pages that are full are
        skipped, and a job never runs into a shared page another job is still writing (start == stop: wait).
        """
        table, shared = reservation.page_table, reservation.shared_pages
        n = computed // self.page_size
        while n < shared and self.pages[table[n]].writer is None:
            n += 1
        start = max(computed, n * self.page_size)
        while n < shared and self.pages[table[n]].writer == job_id:
            n += 1
        return start, (n * self.page_size if n < shared else None)

    def mark_filled(self, page_table: Sequence[int], tokens: int) -> None:
        """Record that the first `tokens` positions of a job's sequence now hold keys and values."""
        for n, index in enumerate(page_table):
            filled = min(self.page_size, max(0, tokens - n * self.page_size))
            page = self.pages[index]
            page.tokens_filled = max(page.tokens_filled, filled)
            if page.tokens_filled == self.page_size:
                page.writer = None

    def release(self, job_id: int, page_table: Sequence[int]) -> None:
        """Drop a job's references; a shared page it was still writing passes to another owner, or is forgotten."""
        for index in page_table:
            page = self.pages[index]
            page.ref_count -= 1
            page.owners.discard(job_id)
            if page.writer == job_id:
                page.writer = min(page.owners, default=None)
                if page.writer is None:
                    self._forget(index)
            if page.ref_count == 0:
                if page.prefix_hash is None:
                    page.tokens_filled = 0
                self._free[index] = None

    def forget_contents(self) -> None:
        """Forget what every free page holds, after something other than this pool wrote into the cache."""
        for index in self._free:
            self._forget(index)

    def _take(self, index: int, job_id: int) -> None:
        page = self.pages[index]
        page.ref_count += 1
        page.owners.add(job_id)
        self._free.pop(index, None)

    def _forget(self, index: int) -> None:
        page = self.pages[index]
        if page.prefix_hash is not None and self._by_hash.get(page.prefix_hash) == index:
            del self._by_hash[page.prefix_hash]
        page.prefix_hash = None
        page.writer = None
        page.tokens_filled = 0
