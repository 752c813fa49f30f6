"""What an engine shows of itself: its cache's pages and its one-line status, read by the inspector, the job table,
`%exl_load` and every summary."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PageInfo:
    """One page of a paged KV cache, as the inspector draws it."""

    index: int
    owners: tuple[int, ...]  # job ids referencing the page
    ref_count: int
    tokens_filled: int
    shared: bool  # referenced by more than one job (a shared prompt prefix)
    cached: bool = False  # unreferenced, but its contents are kept for prefix reuse


def memory_per_gpu_text(per_gpu: tuple[int, ...]) -> str:
    """ "cuda:0 16.50 GiB + cuda:1 8.19 GiB": each GPU's share, as the status line, the inspector and the job table
    show it where a model spans several GPUs."""
    return " + ".join(f"cuda:{i} {b / 2**30:.2f} GiB" for i, b in enumerate(per_gpu))


@dataclass(frozen=True)
class CacheView:
    """A read-only snapshot of an engine's KV cache."""

    paged: bool
    page_size: int
    pages: tuple[PageInfo, ...]
    max_tokens: int
    defrag_count: int | None = None  # None where the engine never defragments
    device_memory_per_gpu: tuple[int, ...] = ()  # bytes each GPU holds for the model, on a GPU engine

    @property
    def total_pages(self) -> int:
        return len(self.pages)

    @property
    def free_pages(self) -> int:
        return sum(1 for p in self.pages if p.ref_count == 0)

    @property
    def shared_pages(self) -> int:
        return sum(1 for p in self.pages if p.shared)

    @property
    def used_tokens(self) -> int:
        return sum(p.tokens_filled for p in self.pages if p.ref_count > 0)


@dataclass(frozen=True)
class EngineStatus:
    """The one-line story of what is loaded: shown by `%exl_load` and written into every summary."""

    engine: str
    model: str
    device: str
    paged: bool
    attention: str  # which attention implementation serves the engine
    cache_tokens: int
    cache_dtype: str
    max_batch_size: int
    device_memory_bytes: int | None = None  # on every GPU together
    device_memory_per_gpu: tuple[int, ...] = ()  # where the model spans several GPUs: each one's share
    notes: tuple[str, ...] = ()  # things the user should know once (e.g. SDPA turned off)
    library: str = ""  # the inference library and its version, e.g. "exllamav3 1.6.5"
    decode: str = ""  # how decode steps run where an engine has a choice: "eager", or "CUDA graphs, ..."

    def line(self) -> str:
        mem = f", {self.device_memory_bytes / 2**30:.2f} GiB on device" if self.device_memory_bytes else ""
        if len(self.device_memory_per_gpu) > 1:
            mem = ", " + memory_per_gpu_text(self.device_memory_per_gpu)
        mode = "paged" if self.paged else "unpaged"
        library = f" ({self.library})" if self.library else ""
        decode = f" | decode: {self.decode}" if self.decode else ""
        return (
            f"{self.engine} engine{library} | {self.model} | {self.device} | {mode} ({self.attention}) | "
            f"cache {self.cache_tokens} tokens {self.cache_dtype} | batch {self.max_batch_size}{mem}{decode}"
        )
