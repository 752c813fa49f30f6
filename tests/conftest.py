"""Shared fixtures: the real bundled model on the real CPU engine, loaded once per test process.

`make test` runs the suite on two processes (pytest-xdist), each loading its own copy of the 135M model. It
hands out whole files (`pytest_xdist_make_scheduler` below), so a module-scoped fixture (a JupyterLab, a
notebook run, a kernel) is built once, and all the files that take the real servers to one process, so each
server starts once. Any other session-scoped fixture is built once per process that uses it. (xdist 3.8's
`--dist loadgroup` would group by marks, but it marks a group by rewriting node ids, which pytest 9.2 no longer
lets it do: its groups are silently ignored.)
"""

from __future__ import annotations

import functools
import gc
import os
import signal
from collections import Counter
from pathlib import Path

import pytest

from exlnb import SamplerSettings, get_session
from exlnb.engines.options import EngineOptions
from exlnb.session import Session
from tests.helpers import skip_without_library


def pytest_runtest_logreport(report) -> None:
    """With EXLNB_FAILURE_LOG set, each failure's traceback goes there as it happens, so a run cut off before
    pytest's own summary (a GPU machine handed back mid-run) still says why each test failed."""
    path = os.environ.get("EXLNB_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as log:
            log.write(f"==== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n\n")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    """The tests marked `slow` first, those of the file with the most of them first (the notebook run): `make
    test` hands out whole files in this order, so the longest work starts at once and short files fill in."""
    slow_in_file = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow_in_file[item.path] if item.get_closest_marker("slow") else 1)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without xdist, nothing asks for it
def pytest_xdist_make_scheduler(config, log):
    """Whole files to a worker, as `--dist loadfile`, and every file that takes tests/servers.py's servers
    (`pytest_plugins = ["tests.servers"]`) to the same one, so that each server starts once."""
    from xdist.scheduler import LoadFileScheduling

    class FilesAndServers(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return "servers" if _takes_the_servers(config.rootpath / file) else file

    return FilesAndServers(config, log)


@functools.cache
def _takes_the_servers(path: Path) -> bool:
    return path.is_file() and "tests.servers" in path.read_text(encoding="utf-8")


def pytest_configure(config) -> None:
    """On N worker processes, each one's torch gets its share of the cores, and so do the kernels, servers and
    scripts they start (OMP_NUM_THREADS, inherited): two processes of two threads each on two cores wait on each
    other, and OpenMP's waiting threads spin on cores the other worker needs."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        share = max(1, cores // workers)
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


BUNDLED_ON_CPU: EngineOptions | None = None  # what cpu_session loaded, once it has


@pytest.fixture(scope="session")
def cpu_session() -> Session:
    """The kernel-style singleton session with SmolLM2-135M-Instruct on the CPU engine."""
    global BUNDLED_ON_CPU
    session = get_session()
    session.load("smollm2-135m-instruct", engine="cpu", progress=False)
    BUNDLED_ON_CPU = session.options
    # the imports and this model outlive every test: keep them out of the full collections that the
    # abandoned-stream tests make by the dozen (0.23 s each over them, microseconds once frozen); what a test
    # makes afterwards is collected as before
    gc.collect()
    gc.freeze()
    return session


@pytest.fixture(autouse=True)
def kernel_session_put_back(request):
    """A test that loads something else into the kernel's session (another cache size, the toy engine) or
    unloads it leaves the bundled model on the CPU engine as it found it: the next test, whichever it is and on
    whichever worker, gets what `cpu_session` promises. A test on a GPU engine (`engine_name`) leaves that
    engine loaded, as the next test on it needs it."""
    session = get_session()
    before = session.options
    yield
    callspec = getattr(request.node, "callspec", None)
    on_gpu = callspec is not None and callspec.params.get("engine_name", "cpu") != "cpu"
    if before is not None and before == BUNDLED_ON_CPU and session.options != before and not on_gpu:
        session.cancel_all()
        session.load("smollm2-135m-instruct", engine="cpu", progress=False, reload=True)


@pytest.fixture(
    scope="session",
    params=["cpu", pytest.param("exllamav2", marks=pytest.mark.gpu), pytest.param("exllamav3", marks=pytest.mark.gpu)],
)
def engine_name(request) -> str:
    """Engine-level acceptance runs on every engine: the CPU one in CI, ExLlamaV2 and ExLlamaV3 with `pytest -m gpu`."""
    if request.param != "cpu":
        skip_without_library(request.param)
    return request.param


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
