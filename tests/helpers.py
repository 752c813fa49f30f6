"""What several test files need besides fixtures, imported from here (pytest's conftest.py is for fixtures)."""

from __future__ import annotations

import importlib
import sys
import time
import types
from contextlib import contextmanager

import pytest

from exlnb.session import Session


def wait_until_idle(session: Session, timeout: float = 10.0) -> None:
    """Cancels requested from finalisers and interrupts are queued; give the engine thread a moment to run them."""
    deadline = time.monotonic() + timeout
    while session.jobs() and time.monotonic() < deadline:
        time.sleep(0.01)


def skip_without_library(library: str) -> None:
    """Skip where CUDA or the engine's library is missing, so `pytest -m gpu` runs what the machine has."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        pytest.skip(f"the {library} engine needs CUDA")
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed")


@contextmanager
def imported_over_stand_ins(monkeypatch, module_name: str, library_module: str, **names):
    """Import exlnb's `module_name` where the library it builds on is not installed: `library_module` (and its
    parent packages) stand in, holding `names`. The stand-ins leave with the test, and so does the module."""
    parts = library_module.split(".")
    for depth in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:depth]), types.ModuleType(".".join(parts[:depth])))
    for name, value in names.items():
        setattr(sys.modules[library_module], name, value)
    monkeypatch.delitem(sys.modules, module_name, raising=False)
    try:
        yield importlib.import_module(module_name)
    finally:
        sys.modules.pop(module_name, None)  # a later import meets the real library again
