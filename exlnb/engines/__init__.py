"""Engines and how to pick one. The ExLlamaV2 engine is imported only when chosen: exllamav2 JIT-builds
its CUDA extension on import (about 150 s the first time)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from exlnb.engines.base import Engine

ENGINE_NAMES = ("auto", "exllamav2", "cpu")
CACHE_DTYPES = ("fp16", "q4", "q6", "q8")


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
        if engine == "auto":
            engine = "exllamav2" if cuda_available() else "cpu"
        if engine == "cpu" and cache_dtype != "fp16":
            raise ValueError(f"the CPU engine keeps its cache in full precision; --cache {cache_dtype} needs exllamav2")
        if cache_tokens is not None and cache_tokens < 256:
            raise ValueError(f"cache_tokens={cache_tokens} is too small: give at least 256 (one page)")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
        return cls(
            engine=engine,
            model_dir=Path(model_dir).resolve(),
            cache_tokens=cache_tokens or 8192,
            cache_dtype=cache_dtype,
            max_batch_size=max_batch_size or 16,
            gpu_split=tuple(gpu_split) if gpu_split else None,
            paged=paged,
        )


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def create_engine(options: EngineOptions, *, progress: bool = True) -> Engine:
    if options.engine == "cpu":
        from exlnb.engines.cpu import CpuEngine

        return CpuEngine(options, progress=progress)
    from exlnb.engines.exllamav2 import ExLlamaV2Engine

    return ExLlamaV2Engine(options, progress=progress)
