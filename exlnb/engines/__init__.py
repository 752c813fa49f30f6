"""Engines and how to pick one. An engine backed by a CUDA library is imported only when chosen: exllamav2
JIT-builds its CUDA extension on import (about 150 s the first time), exllamav3 its own (about 7 minutes)."""

from __future__ import annotations

from exlnb.engines.base import Engine
from exlnb.engines.options import EngineOptions


def create_engine(options: EngineOptions, *, progress: bool = True) -> Engine:
    if options.engine == "cpu":
        from exlnb.engines.cpu import CpuEngine

        return CpuEngine(options, progress=progress)
    if options.engine == "exllamav3":
        from exlnb.engines.exllamav3 import ExLlamaV3Engine

        return ExLlamaV3Engine(options, progress=progress)
    from exlnb.engines.exllamav2 import ExLlamaV2Engine

    return ExLlamaV2Engine(options, progress=progress)
