"""Real OpenAI-compatible servers on the bundled model, started on 127.0.0.1 and a free port, stopped after.

The tests (`tests/servers.py`) and the disconnect run (`benchmarks/disconnect.py`) start them the same way:
`transformers serve` on the bundled model's converted folder, in either of its modes, and llama-cpp-python's
server on the bundled GGUF. Each is a context manager that yields a `LocalServer` once `/v1/models` answers:
its API base, its PID (for the disconnect investigation's CPU signal) and the mode it was started in.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from exlnb.models import BUNDLED_MODEL, bundled_gguf, resolve_model

START_TIMEOUT_S = 180  # transformers serve starts in under half a minute on two cores; llama.cpp in seconds
STOP_TIMEOUT_S = 15


@dataclass(frozen=True)
class LocalServer:
    url: str  # the API base, http://127.0.0.1:PORT/v1
    pid: int
    mode: str  # how it was started, as a reader would start it again: "transformers serve --continuous-batching"
    served_model: str  # the name it answers to, for `served_model=` (some servers list no model: transformers
    # serve before 5.24 lists only its Hub cache, not the folder it was started on)
    dialect: str | None = None  # its kind, for `dialect=`, where its listing may not say


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server_process(
    argv: list[str],
    port: int,
    log: Path,
    mode: str,
    served_model: str,
    env: dict[str, str] | None = None,
    dialect: str | None = None,
) -> Iterator[LocalServer]:
    """Run a server until its /v1/models answers; yield it; stop it (and say why if it never came up). `env` is
    added to this process's environment for it."""
    url = f"http://127.0.0.1:{port}/v1"
    with log.open("w") as out:
        process = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})},
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text()[-2000:]
                raise RuntimeError(f"{argv[0]} did not come up on port {port} (exit {process.poll()}):\n{tail}")
            try:
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield LocalServer(url, process.pid, mode, served_model, dialect)
    finally:
        process.terminate()
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_TIMEOUT_S)


def transformers_serve(
    log_dir: Path, *, continuous_batching: bool = False, threads: int | None = None
) -> AbstractContextManager[LocalServer]:
    """`transformers serve`, pinned to the bundled model's folder, on the CPU in fp32; it serves the model by
    that path. With `continuous_batching`, its paged continuous-batching generator instead of one `generate()`
    at a time. `threads` sets its torch threads (OMP_NUM_THREADS; None: as this process has it): on two cores
    shared with other work, two threads spin at every barrier (a two-token probe cost 1.1 s of its CPU with two
    threads beside a busy machine, 0.3 s with one, 2026-11-27)."""
    folder = resolve_model(BUNDLED_MODEL, progress=False)
    port = free_port()
    cli = Path(sys.executable).with_name("transformers")
    flags = ["--continuous-batching"] if continuous_batching else []
    argv = [
        str(cli),
        "serve",
        str(folder),
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        *flags,
    ]
    hub = log_dir / "hub"  # its /v1/models scans the Hub cache, and answers 500 on a machine that has none yet
    hub.mkdir(parents=True, exist_ok=True)
    env = {"HF_HUB_CACHE": str(hub)} | ({} if threads is None else {"OMP_NUM_THREADS": str(threads)})
    mode = " ".join(["transformers serve", *flags])
    return server_process(argv, port, log_dir / "server.log", mode, str(folder), env, dialect="transformers")


def llama_cpp_server(log_dir: Path, *, threads: int) -> AbstractContextManager[LocalServer]:
    """llama-cpp-python's server on the bundled GGUF as published. It runs one generation at a time, and by
    default a new request aborts the one running: `interrupt_requests False` queues it instead, as load tests
    need. llama.cpp reads no OMP_NUM_THREADS: `threads` sets its threads for prompt and decode alike."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(bundled_gguf()),
        "--model_alias",
        BUNDLED_MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        "2048",
        "--n_threads",
        str(threads),
        "--n_threads_batch",
        str(threads),
        "--interrupt_requests",
        "False",
        "--verbose",
        "False",
    ]
    mode = "python -m llama_cpp.server --interrupt_requests False"
    return server_process(argv, port, log_dir / "server.log", mode, BUNDLED_MODEL)
