"""The investigation notebooks and the parameters each one takes, read from its experiment's `run()`.

A parameter is defined once, as a keyword of `run()` with its default: `notebooks/build_notebooks.py` writes
each notebook's parameters cell from here, and `python -m exlnb.report` checks its presets and every `--set`
against it (as papermill refuses a parameter the notebook does not declare).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable

from exlnb.engines.options import DEFAULT_CACHE_TOKENS
from exlnb.session import Session

NOTEBOOKS = (
    "latency",
    "repetition",
    "prompt_format",
    "concurrency",
    "streaming",
    "context",
    "quantization",
    "disconnect",
    "near_ties",
)
# latency's cache is small on purpose: 4 pages of 256 tokens, one per request, so abandoned jobs fill it soon
CACHE_TOKENS = {"latency": 1024}


def check_notebook(name: str) -> str:
    if name not in NOTEBOOKS:
        raise ValueError(f"no notebook {name!r}: choose one of {', '.join(NOTEBOOKS)}")
    return name


def run_parameters(name: str) -> dict[str, object]:
    """The experiment's own parameters: the keyword-only parameters of its `run()`, with their defaults."""
    run = importlib.import_module(f"exlnb.experiments.{check_notebook(name)}").run
    return {p.name: p.default for p in inspect.signature(run).parameters.values() if p.kind is p.KEYWORD_ONLY}


def notebook_parameters(name: str) -> dict[str, object]:
    """Every parameter of the notebook with its default: the engine and cache it loads (`Session.load`'s
    keywords, with its default engine), where it saves, then its experiment's."""
    engine = inspect.signature(Session.load).parameters["engine"].default
    session = {"engine": engine, "cache_tokens": CACHE_TOKENS.get(name, DEFAULT_CACHE_TOKENS), "output_dir": "results"}
    return session | run_parameters(name)


def check_parameters(name: str, parameters: Iterable[str]) -> None:
    """Refuse a parameter the notebook does not take, naming those it does."""
    valid = notebook_parameters(name)
    unknown = [p for p in parameters if p not in valid]
    if unknown:
        raise ValueError(
            f"the {name} notebook has no parameter {', '.join(map(repr, unknown))}: "
            f"its parameters are {', '.join(valid)}"
        )
