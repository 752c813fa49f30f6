"""Real OpenAI-compatible servers for the remote engine's tests, started here on 127.0.0.1 and a free port.

One of each per test session (session-scoped fixtures, shared through `pytest_plugins = ["tests.servers"]`):
`transformers serve` on the bundled model's converted folder, llama-cpp-python's server on the bundled GGUF,
and `FakeServer`, a small stand-in for the failures a real server will not produce on demand (malformed
events, a stalled stream, 401, 429, 503, a server that dies mid-answer). Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from exlnb.models import BUNDLED_MODEL, bundled_gguf, resolve_model

START_TIMEOUT_S = 180  # transformers serve starts in under half a minute on two cores; llama.cpp in seconds


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server_process(argv: list[str], port: int, log: Path) -> Iterator[str]:
    """Run a server until its /v1/models answers; yield its API base; stop it (and say why if it never came up)."""
    url = f"http://127.0.0.1:{port}/v1"
    with log.open("w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
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
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


@pytest.fixture(scope="session")
def transformers_server(tmp_path_factory) -> Iterator[str]:
    """`transformers serve`, pinned to the bundled model's folder, on the CPU; it serves the model by that path."""
    folder = resolve_model(BUNDLED_MODEL, progress=False)
    port = free_port()
    cli = Path(sys.executable).with_name("transformers")
    argv = [str(cli), "serve", str(folder), "--device", "cpu", "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32"]
    with server_process(argv, port, tmp_path_factory.mktemp("transformers") / "server.log") as url:
        yield url


@pytest.fixture(scope="session")
def llama_cpp_server(tmp_path_factory) -> Iterator[str]:
    """llama-cpp-python's server on the bundled GGUF as published. It runs one generation at a time, and by
    default a new request aborts the one running: `interrupt_requests False` queues it instead, as load tests need.
    It gets the worker's share of the cores, as torch has it (conftest.py): llama.cpp reads no OMP_NUM_THREADS, and
    two threads beside a busy worker on two cores wait for each other at every step (test_remote_engine.py beside
    another busy core took 44 s, 16 s of them the server's CPU, with two threads; 25 s and 4 s with one)."""
    import torch

    port = free_port()
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(bundled_gguf()), "--model_alias", BUNDLED_MODEL,
            "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048", "--n_threads", str(torch.get_num_threads()),
            "--n_threads_batch", str(torch.get_num_threads()), "--interrupt_requests", "False", "--verbose", "False"]
    with server_process(argv, port, tmp_path_factory.mktemp("llama_cpp") / "server.log") as url:
        yield url


# -- the stand-in for failures ------------------------------------------------------------------------------

FAKE_MODEL = "fake-model"
FAKE_KEY = "exlnb-test-key"
FAKE_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="fake-model"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="fake-model"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="fake-model"} 0.25
"""
STALL_S = 20  # how long a stalled stream holds its connection at most (the client's read timeout is shorter)


class FakeHandler(BaseHTTPRequestHandler):
    """Answers as vLLM would; the user's message picks the failure: "malformed", "stall", "die", "429", "503", or
    "slow" (ticks until the client leaves, noted in `client_left`).
    Any other message streams it back word by word. Every request needs the key FAKE_KEY."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/metrics":
            return self._send(200, FAKE_METRICS, "text/plain")
        if not self._authorised():
            return None
        if self.path == "/v1/models":
            return self._send(200, json.dumps({"object": "list", "data": [
                {"id": FAKE_MODEL, "object": "model", "owned_by": "vllm", "max_model_len": 2048}]}))
        return self._send(404, json.dumps({"detail": "Not Found"}))

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not self._authorised():
            return None
        content = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
        if body.get("model") != FAKE_MODEL:
            return self._send(404, json.dumps({"error": {"message": f"The model `{body.get('model')}` does not exist."}}))
        if content in ("429", "503"):
            words = {"429": "Too many requests: rate limit of 2 per second", "503": "Server overloaded, retry later"}
            return self._send(int(content), json.dumps({"error": {"message": words[content], "code": int(content)}}))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if content == "malformed":
            return self._chunk("data: {not json\n\n")
        self._chunk(_sse_chunk("Hello"))
        if content == "die":
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)  # mid-answer, no end of the chunked body
            return None
        if content == "slow":  # a tick every 0.1 s until the client leaves, which the server notes
            for _ in range(STALL_S * 10):
                time.sleep(0.1)
                try:
                    self._chunk(_sse_chunk(" tick"))
                except OSError:
                    self.server.client_left.set()
                    return None
            return None
        if content == "stall":
            for _ in range(STALL_S * 10):
                time.sleep(0.1)
                if self.server.stopping.is_set():
                    break
            return None
        for word in content.split():
            time.sleep(0.01)
            self._chunk(_sse_chunk(" " + word))
        self._chunk(_sse_chunk("", finish="stop"))
        self._chunk("data: [DONE]\n\n")
        self._chunk("")

    def _authorised(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {FAKE_KEY}":
            return True
        self._send(401, json.dumps({"error": {"message": "Incorrect API key provided", "type": "invalid_request_error"}}))
        return False

    def _chunk(self, text: str) -> None:
        data = text.encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _send(self, status: int, text: str, content_type: str = "application/json") -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _sse_chunk(text: str, finish: str | None = None) -> str:
    chunk = {"object": "chat.completion.chunk", "model": FAKE_MODEL,
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    return f"data: {json.dumps(chunk)}\n\n"


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    model = FAKE_MODEL
    key = FAKE_KEY

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", free_port()), FakeHandler)
        self.stopping = threading.Event()
        self.client_left = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


@pytest.fixture
def refusing_url() -> str:
    """An API base on a free port where nothing listens: every connection is refused."""
    return f"http://127.0.0.1:{free_port()}/v1"


@pytest.fixture(scope="session")
def fake_server() -> Iterator[FakeServer]:
    server = FakeServer()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stopping.set()
        server.shutdown()
        server.server_close()
