"""Real OpenAI-compatible servers for the remote engine's tests, started here on 127.0.0.1 and a free port.

One of each per test session (session-scoped fixtures, shared through `pytest_plugins = ["tests.servers"]`):
`transformers serve` on the bundled model's converted folder (and, for the disconnect investigation, a second
one with `--continuous-batching`) and llama-cpp-python's server on the bundled GGUF, each started as
`benchmarks/local_servers.py` starts it for a recorded run (the `..._process` fixtures give its PID and mode,
the others its URL); and `FakeServer`, a small stand-in for the failures a real server will not produce on
demand (malformed events, a stalled stream, 401, 429, 503, a server that dies mid-answer). Every wait is bounded.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import pytest

from benchmarks import local_servers
from benchmarks.local_servers import LocalServer, free_port
from tests.fake_llm_server import StandInHandler


@pytest.fixture(scope="session")
def transformers_server_process(tmp_path_factory) -> Iterator[LocalServer]:
    """`transformers serve` on the bundled model's folder, on the CPU, one `generate()` at a time."""
    with local_servers.transformers_serve(tmp_path_factory.mktemp("transformers")) as server:
        yield server


@pytest.fixture(scope="session")
def transformers_server(transformers_server_process) -> str:
    return transformers_server_process.url


@pytest.fixture(scope="session")
def transformers_batching_server_process(tmp_path_factory) -> Iterator[LocalServer]:
    """`transformers serve --continuous-batching`: the same model through its paged continuous-batching generator."""
    with local_servers.transformers_serve(tmp_path_factory.mktemp("transformers-cb"), continuous_batching=True) as server:
        yield server


@pytest.fixture(scope="session")
def llama_cpp_server_process(tmp_path_factory) -> Iterator[LocalServer]:
    """llama-cpp-python's server on the bundled GGUF. It gets the worker's share of the cores, as torch has it
    (conftest.py): two threads beside a busy worker on two cores wait for each other at every step
    (test_remote_engine.py beside another busy core took 44 s, 16 s of them the server's CPU, with two threads;
    25 s and 4 s with one)."""
    import torch

    with local_servers.llama_cpp_server(tmp_path_factory.mktemp("llama_cpp"), threads=torch.get_num_threads()) as server:
        yield server


@pytest.fixture(scope="session")
def llama_cpp_server(llama_cpp_server_process) -> str:
    return llama_cpp_server_process.url


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


class FakeHandler(StandInHandler):
    """Answers as vLLM would; the user's message picks the failure: "malformed", "stall", "die", "429", "503", or
    "slow" (ticks until the client leaves, noted in `client_left`).
    Any other message streams it back word by word. Every request needs the key FAKE_KEY."""

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
        self._start_events()
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
