"""A stand-in LLM server, run as its own process so that its CPU time is its own: `python -m tests.fake_llm_server
--port PORT --after-leaving stop|work-on`.

It speaks vLLM's dialect of the OpenAI API, streaming or not, and spends real CPU on each request: a busy loop
per prompt character (its prefill) and per token (its decode). When a client leaves, `stop` stops at once (it
looks at the connection between slices of its prefill and between tokens), while `work-on`
runs the request to `max_tokens` for nobody, as the servers of the published 2026 issues did. `/metrics` counts
its running requests under vLLM's gauge name, and `/fake/log` says, per request, how far it ran and whether it
saw its client leave, so that a test can check what the server itself saw.
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "fake-llm"
TOKEN_CPU_S = 0.02  # the CPU a token costs
PREFILL_CPU_S_PER_CHAR = 0.0002  # and a prompt character: the bundled model's 512-token filler is ~2,500 characters
MAX_TOKENS = 4096  # a request is refused above this: every request here ends within a bounded time


class FakeLlmServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, work_on: bool) -> None:
        super().__init__(("127.0.0.1", port), FakeLlmHandler)
        self.work_on = work_on
        self.lock = threading.Lock()
        self.log: list[dict] = []  # one entry per generation request, updated as it runs


class StandInHandler(BaseHTTPRequestHandler):
    """What the stand-in servers' handlers share (this one's and tests/servers.py's): HTTP/1.1 without log lines,
    an answer sent whole, or an event stream sent chunk by chunk."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, text: str, content_type: str = "application/json") -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _start_events(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _chunk(self, text: str) -> None:
        data = text.encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


class FakeLlmHandler(StandInHandler):
    server: FakeLlmServer

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            return self._json(
                {
                    "object": "list",
                    "data": [{"id": MODEL, "object": "model", "owned_by": "vllm", "max_model_len": 8192}],
                }
            )
        if self.path == "/metrics":
            with self.server.lock:
                running = sum(not entry["finished"] for entry in self.server.log)
            return self._send(
                200, f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {running}\n", "text/plain"
            )
        if self.path == "/fake/log":
            with self.server.lock:
                return self._json(self.server.log)
        return self._send(404, json.dumps({"detail": "Not Found"}))

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        tokens = int(body.get("max_tokens") or 16)
        if tokens > MAX_TOKENS:
            return self._send(400, json.dumps({"error": {"message": f"max_tokens above {MAX_TOKENS}"}}))
        prompt = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
        entry = {
            "stream": bool(body.get("stream")),
            "max_tokens": tokens,
            "tokens": 0,
            "client_left": False,
            "finished": False,
        }
        with self.server.lock:
            self.server.log.append(entry)
        try:
            self._generate(entry, len(prompt), tokens)
        finally:
            entry["finished"] = True

    def _generate(self, entry: dict, prompt_chars: int, tokens: int) -> None:
        stream = entry["stream"]
        if stream:
            self._start_events()
        for _ in range(max(1, round(prompt_chars * PREFILL_CPU_S_PER_CHAR / TOKEN_CPU_S))):  # prefill, in slices
            _burn(min(TOKEN_CPU_S, prompt_chars * PREFILL_CPU_S_PER_CHAR))
            if self._left(entry) and not self.server.work_on:
                return None
        for _ in range(tokens):
            _burn(TOKEN_CPU_S)
            entry["tokens"] += 1
            if stream and not entry["client_left"]:
                self._write_event(
                    entry, {"choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}]}
                )
            if self._left(entry) and not self.server.work_on:
                return None
        if entry["client_left"]:
            return None
        usage = {"prompt_tokens": prompt_chars // 4, "completion_tokens": tokens}
        if stream:
            self._write_event(
                entry, {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], "usage": usage}
            )
            self._chunk("data: [DONE]\n\n")
            self._chunk("")
            return None
        return self._json(
            {
                "id": "fake",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": MODEL,
                "usage": usage,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": " tok" * tokens},
                        "finish_reason": "length",
                    }
                ],
            }
        )

    def _left(self, entry: dict) -> bool:
        """Whether the client has gone: its socket readable with nothing to read (a closed connection), or a
        failed write."""
        if not entry["client_left"]:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if readable and not self.connection.recv(1, socket.MSG_PEEK):
                entry["client_left"] = True
        return entry["client_left"]

    def _write_event(self, entry: dict, chunk: dict) -> None:
        try:
            chunk |= {"id": "fake", "object": "chat.completion.chunk", "created": int(time.time()), "model": MODEL}
            self._chunk(f"data: {json.dumps(chunk)}\n\n")
        except OSError:
            entry["client_left"] = True

    def _json(self, value: object) -> None:
        self._send(200, json.dumps(value))


def _burn(seconds: float) -> None:
    """Spend this much CPU time (this thread's), not wall time: a busy server, not a sleeping one."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--after-leaving", choices=("stop", "work-on"), required=True)
    args = parser.parse_args()
    FakeLlmServer(args.port, args.after_leaving == "work-on").serve_forever(poll_interval=0.1)


if __name__ == "__main__":
    main()
