"""Shared fixtures: the real bundled model on the real CPU engine, loaded once per test run."""

from __future__ import annotations

import importlib
import os
import signal
import sys
import types
from contextlib import contextmanager

import pytest

from exlnb import SamplerSettings, get_session
from exlnb.session import Session

from exlnb.templates import chatml  # noqa: F401 - re-exported for the tests


def pytest_runtest_logreport(report) -> None:
    """With EXLNB_FAILURE_LOG set, each failure's traceback goes there as it happens, so a run cut off before
    pytest's own summary (a GPU machine handed back mid-run) still says why each test failed."""
    path = os.environ.get("EXLNB_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as log:
            log.write(f"==== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n\n")


@pytest.fixture(scope="session")
def cpu_session() -> Session:
    """The kernel-style singleton session with SmolLM2-135M-Instruct on the CPU engine."""
    session = get_session()
    session.load("smollm2-135m-instruct", engine="cpu", progress=False)
    return session


@pytest.fixture(
    scope="session",
    params=["cpu", pytest.param("exllamav2", marks=pytest.mark.gpu), pytest.param("exllamav3", marks=pytest.mark.gpu)],
)
def engine_name(request) -> str:
    """Engine-level acceptance runs on every engine: the CPU one in CI, ExLlamaV2 and ExLlamaV3 with `pytest -m gpu`."""
    if request.param != "cpu":
        skip_without_library(request.param)
    return request.param


def skip_without_library(library: str) -> None:
    """Skip where CUDA or the engine's library is missing, so `pytest -m gpu` runs what the machine has."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        pytest.skip(f"the {library} engine needs CUDA")
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed")


@pytest.fixture
def engine_session(engine_name: str) -> Session:
    """The shared session with the bundled model on `engine_name`, checked before every test: a test that loads
    another engine into the singleton (the magics' shell loads the CPU one) cannot leave the next test on it.
    A load with the same arguments as the loaded model does nothing, so this costs nothing in a steady run."""
    session = get_session()
    session.load("smollm2-135m-instruct", engine=engine_name, progress=False)
    return session


@pytest.fixture(scope="module")
def shell(cpu_session):
    """An IPython shell with exlnb's magics, over the CPU session."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "exlnb")
    return shell


@pytest.fixture
def greedy() -> SamplerSettings:
    return SamplerSettings.greedy()


@pytest.fixture
def ctrl_c():
    """Python's own Ctrl-C handler, as in a kernel or a terminal: a process started in the background (as CI
    may start the suite) inherits SIGINT ignored, and then `_thread.interrupt_main()` does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def idle_session(engine_session: Session):
    """The shared session, checked to be idle before the test; no job outlives a test."""
    assert engine_session.jobs() == []
    yield engine_session
    engine_session.cancel_all()


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
