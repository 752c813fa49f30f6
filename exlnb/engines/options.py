"""What can be loaded and shown, and how: the one list of each choice, used by the API, magics and scripts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from exlnb.engines.formats import check_engine_can_load, engine_for, model_format

ENGINE_NAMES = ("auto", "exllamav2", "exllamav3", "cpu")
CACHE_DTYPES = ("fp16", "q4", "q6", "q8")
DISPLAY_MODES = ("auto", "widget", "text")
DISPLAY_HELP = "auto: a widget where the front end renders widgets, plain text otherwise (papermill, terminal)"

DEFAULT_CACHE_TOKENS = 8192
DEFAULT_MAX_BATCH_SIZE = 16
PAGE_TOKENS = 256  # exllamav2's page size; the CPU engine uses the same, so grids and counts read alike


def check_display(display: str) -> str:
    if display not in DISPLAY_MODES:
        raise ValueError(f"display={display!r}: choose one of {', '.join(DISPLAY_MODES)}")
    return display


@dataclass(frozen=True)
class EngineOptions:
    """Everything that decides what gets loaded; equal options mean `load()` has nothing to do."""

    engine: str
    model_dir: Path
    cache_tokens: int
    cache_dtype: str
    max_batch_size: int
    gpu_split: tuple[float, ...] | None
    paged: str | bool

    @classmethod
    def resolve(
        cls,
        *,
        engine: str,
        model_dir: Path,
        cache_tokens: int | None,
        cache_dtype: str,
        max_batch_size: int | None,
        gpu_split: Sequence[float] | None,
        paged: str | bool,
    ) -> EngineOptions:
        if engine not in ENGINE_NAMES:
            raise ValueError(f"unknown engine {engine!r}: choose one of {', '.join(ENGINE_NAMES)}")
        if cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"unknown cache type {cache_dtype!r}: choose one of {', '.join(CACHE_DTYPES)}")
        fmt = model_format(model_dir)
        if engine == "auto":
            engine = engine_for(fmt, cuda=cuda_available())
        check_engine_can_load(engine, fmt, model_dir)
        if engine == "cpu" and cache_dtype != "fp16":
            raise ValueError(
                f"the CPU engine keeps its cache in full precision; --cache {cache_dtype} needs exllamav2 or exllamav3"
            )
        if cache_tokens is not None and cache_tokens < PAGE_TOKENS:
            raise ValueError(f"cache_tokens={cache_tokens} is too small: give at least {PAGE_TOKENS} (one page)")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
        if paged not in ("auto", True, False):
            raise ValueError(f'paged={paged!r} is not one of "auto", True, False')
        return cls(
            engine=engine,
            model_dir=Path(model_dir).resolve(),
            cache_tokens=cache_tokens or DEFAULT_CACHE_TOKENS,
            cache_dtype=cache_dtype,
            max_batch_size=max_batch_size or DEFAULT_MAX_BATCH_SIZE,
            gpu_split=tuple(gpu_split) if gpu_split else None,
            paged=paged,
        )


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
