"""Real OpenAI-compatible servers for the remote engine's tests, started here on 127.0.0.1 and a free port.

One of each per test session (session-scoped fixtures, shared through `pytest_plugins = ["tests.servers"]`):
`transformers serve` on the bundled model's converted folder (and, for the disconnect investigation, a second
one with `--continuous-batching`) and llama-cpp-python's server on the bundled GGUF, each started as
`benchmarks/local_servers.py` starts it for a recorded run (the `..._process` fixtures give its PID and mode,
the others its URL; `llama_cpp_session` is a session loaded on the llama.cpp one, per test module); and
`FakeServer`, a small stand-in for the failures a real server will not produce on demand (malformed and badly
shaped events, a stalled stream, 401, 429, 503, a server that dies mid-answer or cuts it short, one that keeps
streaming, oversized events, error bodies and answers, a redirect, a nonsensical max_model_len), with
`fake_session` loaded on it. Every wait is bounded.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import ThreadingHTTPServer

import pytest

from benchmarks import local_servers
from benchmarks.local_servers import LocalServer, free_port
from exlnb.session import Session
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
    with local_servers.transformers_serve(
        tmp_path_factory.mktemp("transformers-cb"), continuous_batching=True
    ) as server:
        yield server


@pytest.fixture(scope="session")
def llama_cpp_server_process(tmp_path_factory) -> Iterator[LocalServer]:
    """llama-cpp-python's server on the bundled GGUF. It gets the worker's share of the cores, as torch has it
    (conftest.py): two threads beside a busy worker on two cores wait for each other at every step
    (test_remote_engine.py beside another busy core took 44 s, 16 s of them the server's CPU, with two threads;
    25 s and 4 s with one)."""
    import torch

    with local_servers.llama_cpp_server(
        tmp_path_factory.mktemp("llama_cpp"), threads=torch.get_num_threads()
    ) as server:
        yield server


@pytest.fixture(scope="session")
def llama_cpp_server(llama_cpp_server_process) -> str:
    return llama_cpp_server_process.url


@pytest.fixture(scope="module")
def llama_cpp_session(llama_cpp_server) -> Iterator[Session]:
    """A session loaded on the llama.cpp server through /v1/completions, so exlnb's templates and branches reach it."""
    session = Session()
    session.load(url=llama_cpp_server, api="completions", progress=False)
    yield session
    session.unload()


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
HUGE_BYTES = 200 * 2**20  # the field report's 200 MB error body and line: poured until the client leaves
POUR_BYTES = 2**16
# the field reports' valid JSON of the wrong shape ("shape:NAME"), each sent after a good first frame
BAD_SHAPES = {
    "choices-text": {"choices": "abc"},
    "choice-number": {"choices": [5]},
    "content-number": {"choices": [{"index": 0, "delta": {"content": 42}, "finish_reason": None}]},
    "usage-words": {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": "lots"}},
    "finish-list": {"choices": [{"index": 0, "delta": {"content": " x"}, "finish_reason": ["stop"]}]},
    "logprob-text": {
        "choices": [
            {
                "index": 0,
                "delta": {"content": " x"},
                "finish_reason": None,
                "logprobs": {"content": [{"token": " x", "logprob": "abc", "top_logprobs": []}]},
            }
        ]
    },
}
PACKED_WORDS = " the cat sat on the mat and the dog sat on the rug"  # one token a word in SmolLM2's tokenizer


class FakeHandler(StandInHandler):
    """Answers as vLLM would; the user's message picks the failure (or `FakeServer.faults`, for the next request
    whatever it says): "malformed", "stall", "die", "429", "503", "slow" (ticks until the client leaves, noted in
    `client_left`), "shape:NAME" (`BAD_SHAPES`), "cut" (a close-delimited body ended mid-answer), "no-choices",
    "no-finish" ([DONE] with no finish_reason), "endless" (words with no end), "big-event" (one 2 MiB event),
    "long-line" and "big-error" (200 MB without a newline, and as a 500's body, poured until the client leaves;
    `written` counts what went), "chatter" (frames with no token, without end), "packed" (a role-only first frame,
    two words a frame, a finish frame, a usage frame). A request with `ignore_eos` (a load test's exact lengths)
    gets `max_tokens` words of one token each. Any other message streams it back word by word. Every request needs
    the key FAKE_KEY. Under /moved/v1 the models listing redirects, under /len-5/v1 it says max_model_len=-5, under
    /unlisted/v1 it lists no model (as transformers serve before 5.24 does for the folder it was started on)."""

    def do_GET(self) -> None:
        if self.path == "/metrics":
            return self._send(200, FAKE_METRICS, "text/plain")
        if not self._authorised():
            return None
        if self.path == "/moved/v1/models":  # a key in the target must not be shown
            self.send_response(307)
            port = self.server.server_address[1]
            self.send_header("Location", f"http://someone:hunter2@127.0.0.1:{port}/v1/models")
            self.send_header("Content-Length", "0")
            return self.end_headers()
        if self.path == "/unlisted/v1/models":
            return self._send(200, json.dumps({"object": "list", "data": []}))
        if self.path in ("/v1/models", "/len-5/v1/models"):
            length = -5 if self.path.startswith("/len-5") else 2048
            return self._send(
                200,
                json.dumps(
                    {
                        "object": "list",
                        "data": [{"id": FAKE_MODEL, "object": "model", "owned_by": "vllm", "max_model_len": length}],
                    }
                ),
            )
        return self._send(404, json.dumps({"detail": "Not Found"}))

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not self._authorised():
            return None
        content = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
        if body.get("model") != FAKE_MODEL:
            return self._send(
                404, json.dumps({"error": {"message": f"The model `{body.get('model')}` does not exist."}})
            )
        taken = self.server.take_fault()
        fault = taken or content
        if fault in ("429", "503"):
            words = {"429": "Too many requests: rate limit of 2 per second", "503": "Server overloaded, retry later"}
            return self._send(int(fault), json.dumps({"error": {"message": words[fault], "code": int(fault)}}))
        if fault in ("big-error", "cut"):
            return self._big_error() if fault == "big-error" else self._cut()
        self._start_events()
        answer = self._ANSWERS.get(fault.partition(":")[0], FakeHandler._echo)
        if body.get("ignore_eos") and taken is None:
            answer = FakeHandler._exact
        try:
            answer(self, fault, body)
        except OSError:  # the client left
            self.server.client_left.set()

    def _echo(self, content: str, body: dict) -> None:
        self._chunk(_sse_chunk("Hello"))
        for word in content.split():
            time.sleep(0.01)
            self._chunk(_sse_chunk(" " + word))
        self._finish()

    def _exact(self, content: str, body: dict) -> None:
        for _ in range(body["max_tokens"]):
            time.sleep(0.005)
            self._chunk(_sse_chunk(" the"))
        self._finish("length", body["max_tokens"])

    def _malformed(self, content: str, body: dict) -> None:
        self._chunk("data: {not json\n\n")

    def _die(self, content: str, body: dict) -> None:
        self._chunk(_sse_chunk("Hello"))
        self.connection.shutdown(socket.SHUT_RDWR)  # mid-answer, no end of the chunked body

    def _slow(self, content: str, body: dict) -> None:
        """A tick every 0.1 s until the client leaves (noted by do_POST), or "endless" words every 10 ms."""
        pause, word = (0.1, " tick") if content == "slow" else (0.01, " more")
        self._chunk(_sse_chunk("Hello"))
        for _ in range(int(STALL_S / pause)):
            time.sleep(pause)
            self._chunk(_sse_chunk(word))

    def _stall(self, content: str, body: dict) -> None:
        self._chunk(_sse_chunk("Hello"))
        for _ in range(STALL_S * 10):
            time.sleep(0.1)
            if self.server.stopping.is_set():
                break

    def _bad_shape(self, content: str, body: dict) -> None:
        self._chunk(_sse_chunk("Hello"))
        self._chunk(f"data: {json.dumps(BAD_SHAPES[content.partition(':')[2]])}\n\n")
        self._echo("still going", body)

    def _no_choices(self, content: str, body: dict) -> None:
        self._chunk(f"data: {json.dumps({'id': 'cmpl-1', 'object': 'chat.completion.chunk'})}\n\n")
        self._chunk("data: [DONE]\n\n")
        self._chunk("")

    def _no_finish(self, content: str, body: dict) -> None:
        self._chunk(_sse_chunk("Hello"))
        self._chunk("data: [DONE]\n\n")
        self._chunk("")

    def _big_event(self, content: str, body: dict) -> None:
        self._chunk(_sse_chunk("Hello"))
        self._chunk(_sse_chunk(" word" * (2**21 // 5)))

    def _long_line(self, content: str, body: dict) -> None:
        self._chunk(_sse_chunk("Hello") + 'data: {"choices": [{"index": 0, "delta": {"content": "')
        self._pour(lambda piece: self._chunk(piece))

    def _chatter(self, content: str, body: dict) -> None:
        frame = _sse_chunk(None) * 100
        for _ in range(10**5):
            self._chunk(frame)

    def _packed(self, content: str, body: dict) -> None:
        self._chunk(_sse_chunk(None, role="assistant"))
        words = PACKED_WORDS.split(" ")[1:]
        for pair in range(0, len(words), 2):
            time.sleep(0.01)
            self._chunk(_sse_chunk("".join(" " + w for w in words[pair : pair + 2])))
        self._finish("stop", len(words))

    _ANSWERS = {
        "malformed": _malformed,
        "die": _die,
        "slow": _slow,
        "endless": _slow,
        "stall": _stall,
        "shape": _bad_shape,
        "no-choices": _no_choices,
        "no-finish": _no_finish,
        "big-event": _big_event,
        "long-line": _long_line,
        "chatter": _chatter,
        "packed": _packed,
    }

    def _finish(self, reason: str = "stop", tokens: int | None = None) -> None:
        self._chunk(_sse_chunk("", finish=reason))
        if tokens is not None:
            usage = {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}
            self._chunk(f"data: {json.dumps({'object': 'chat.completion.chunk', 'choices': [], 'usage': usage})}\n\n")
        self._chunk("data: [DONE]\n\n")
        self._chunk("")

    def _cut(self) -> None:
        """A body delimited by the connection's close (no length, not chunked), closed mid-answer."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write((_sse_chunk("Hello") + _sse_chunk(" there")).encode())
        self.close_connection = True

    def _big_error(self) -> None:
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._chunk('{"error": {"message": "')
        try:
            self._pour(lambda piece: self._chunk(piece))
        except OSError:
            self.server.client_left.set()

    def _pour(self, write) -> None:
        """HUGE_BYTES of "x" in pieces, counted in `written` as they go, until the client stops reading."""
        piece = "x" * POUR_BYTES
        self.server.written = 0
        while self.server.written < HUGE_BYTES:
            write(piece)
            self.server.written += len(piece)

    def _authorised(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {FAKE_KEY}":
            return True
        self._send(
            401, json.dumps({"error": {"message": "Incorrect API key provided", "type": "invalid_request_error"}})
        )
        return False


def _sse_chunk(text: str | None, finish: str | None = None, role: str | None = None) -> str:
    delta = {"role": role} if role else {} if text is None else {"content": text}
    chunk = {
        "object": "chat.completion.chunk",
        "model": FAKE_MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return f"data: {json.dumps(chunk)}\n\n"


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    model = FAKE_MODEL
    key = FAKE_KEY
    bad_shapes = BAD_SHAPES
    huge_bytes = HUGE_BYTES
    packed_words = PACKED_WORDS

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", free_port()), FakeHandler)
        self.stopping = threading.Event()
        self.client_left = threading.Event()
        self.faults: list[str] = []  # what the next requests get, whatever they say
        self.written = 0  # bytes of the last poured body that went out before the client left
        self._lock = threading.Lock()

    def handle_error(self, request, client_address) -> None:
        """A client that left mid-answer is what several tests do on purpose: only other errors are printed."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def take_fault(self) -> str | None:
        with self._lock:
            return self.faults.pop(0) if self.faults else None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


@pytest.fixture
def refusing_url() -> str:
    """An API base on a free port where nothing listens: every connection is refused."""
    return f"http://127.0.0.1:{free_port()}/v1"


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def fake_session(fake_server, monkeypatch_module) -> Iterator[Session]:
    """A session on the stand-in server, with its key in EXLNB_FAKE_KEY."""
    monkeypatch_module.setenv("EXLNB_FAKE_KEY", fake_server.key)
    session = Session()
    session.load(url=fake_server.url, api_key_env="EXLNB_FAKE_KEY", progress=False)
    yield session
    session.unload()


@contextmanager
def running_fake_server() -> Iterator[FakeServer]:
    """A FakeServer answering on its own thread until the block ends (docs/bad_inputs.py types its rows against it)."""
    server = FakeServer()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stopping.set()
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="session")
def fake_server() -> Iterator[FakeServer]:
    with running_fake_server() as server:
        yield server
