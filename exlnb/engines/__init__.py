"""Engines and how to pick one. Each engine is declared in registry.py and its class imported only when chosen:
exllamav2 JIT-builds its CUDA extension on import (about 150 s the first time), exllamav3 its own (about 7 minutes)."""

from __future__ import annotations

import importlib

from exlnb.engines.base import Engine
from exlnb.engines.options import EngineOptions
from exlnb.engines.registry import engine_spec


def create_engine(options: EngineOptions, *, progress: bool = True) -> Engine:
    """The engine `options.engine` names, built over `options`; its module is imported here, on first use."""
    module, _, name = engine_spec(options.engine).engine_class.partition(":")
    return getattr(importlib.import_module(module), name)(options, progress=progress)
