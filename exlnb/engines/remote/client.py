"""HTTP and server-sent events to one OpenAI-compatible server, every failure as one line naming the server's words.

httpx carries the requests and httpx-sse parses the event stream. A stream is an `async with` block: leaving it
(the job ended, was cancelled, or its task was) closes the connection, which is how a server learns that its
client has gone; whether it then stops generating is the server's business (experiments/disconnect.py measures it).
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from httpx_sse import SSEError, aconnect_sse

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 60.0  # no byte for this long from a streaming server is a stall: the job fails, the others run on


class ServerError(RuntimeError):
    """A server refused, failed or could not be reached; the message is one line and quotes the server."""


@dataclass(frozen=True)
class ServerAddress:
    """Where the server is and the key it wants (read from an environment variable, never stored in a notebook)."""

    url: str  # the API's base, e.g. http://127.0.0.1:8000/v1
    api_key_env: str | None = None

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url={self.url!r} is not an http(s) address: give the API's base, e.g. http://127.0.0.1:8000/v1")
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise ValueError(f"api_key_env={self.api_key_env!r}: that environment variable is not set (or empty)")

    @property
    def base(self) -> str:
        return self.url.rstrip("/")

    @property
    def root(self) -> str:
        """The server's own root (where /metrics and /health live), the API base without its /v1."""
        return self.base.removesuffix("/v1")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {os.environ[self.api_key_env]}"} if self.api_key_env else {}


def get_json(address: ServerAddress, path: str) -> dict:
    """GET `path` under the API base (a load-time probe such as /models); ServerError in one line otherwise."""
    try:
        response = httpx.get(f"{address.base}{path}", headers=address.headers(), timeout=_timeout())
    except httpx.HTTPError as error:
        raise ServerError(unreachable(address, error)) from error
    if response.is_error:
        raise ServerError(refusal(address, response.status_code, response.text))
    try:
        return response.json()
    except ValueError as error:
        raise ServerError(f"the server at {address.base} answered {path} with something that is not JSON: "
                          f"{_quote(response.text)}") from error


def get_text(address: ServerAddress, path: str) -> str | None:
    """GET `path` under the server's root (e.g. /metrics); None where the server has no such page."""
    try:
        response = httpx.get(f"{address.root}{path}", headers=address.headers(), timeout=_timeout())
    except httpx.HTTPError:
        return None
    return None if response.is_error else response.text


async def stream_events(client: httpx.AsyncClient, address: ServerAddress, path: str, body: dict) -> AsyncIterator[dict]:
    """POST `body` with streaming on and yield each event's JSON until `[DONE]`; ServerError for anything else."""
    try:
        async with aconnect_sse(client, "POST", f"{address.base}{path}", json=body, headers=address.headers(),
                                timeout=_timeout()) as source:
            if source.response.is_error:
                await source.response.aread()
                raise ServerError(refusal(address, source.response.status_code, source.response.text))
            async for event in source.aiter_sse():
                if event.data.strip() == "[DONE]":
                    return
                yield _event_json(address, event.data)
    except httpx.ReadTimeout as error:
        raise ServerError(f"the server at {address.base} sent nothing for {READ_TIMEOUT_S:g} s (read timeout): the stream "
                          "stalled, so exlnb closed it") from error
    except SSEError as error:
        raise ServerError(f"the server at {address.base} did not answer with an event stream: {error}") from error
    except httpx.HTTPError as error:
        raise ServerError(unreachable(address, error)) from error


def _event_json(address: ServerAddress, data: str) -> dict:
    try:
        value = json.loads(data)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ServerError(f"the server at {address.base} sent a malformed event (not a JSON object): {_quote(data)}")
    if "error" in value:  # vLLM and llama.cpp report a failure inside an open stream this way
        raise ServerError(f"the server at {address.base} failed the request mid-stream: {server_message(value)}")
    return value


def unreachable(address: ServerAddress, error: httpx.HTTPError) -> str:
    if isinstance(error, httpx.ConnectError):
        return f"cannot connect to the server at {address.base}: {error} (is it running, and is the url right?)"
    if isinstance(error, httpx.RemoteProtocolError):
        return f"the server at {address.base} closed the connection mid-answer: {error}"
    if isinstance(error, httpx.TimeoutException):
        return f"the server at {address.base} did not answer in time ({type(error).__name__})"
    return f"talking to the server at {address.base} failed: {type(error).__name__}: {error}"


def refusal(address: ServerAddress, status: int, text: str) -> str:
    """An HTTP error answer as one line: the status, its meaning and the server's own message."""
    try:
        message = server_message(json.loads(text))
    except ValueError:
        message = _quote(text)
    reason = httpx.codes.get_reason_phrase(status)
    hint = {401: " (check --api-key-env)", 403: " (check --api-key-env)", 404: " (check the url and the model name)",
            429: " (the server is rate limiting: retry later, or send fewer requests)",
            503: " (the server is overloaded or starting: retry later)"}.get(status, "")
    return f"the server at {address.base} answered {status} {reason}: {message}{hint}"


def server_message(value: object) -> str:
    """The human part of an error body, as OpenAI ({"error": {"message"}}), FastAPI ({"detail"}) and others write it."""
    if isinstance(value, dict):
        for key in ("error", "detail", "message"):
            if key in value:
                return server_message(value[key])
        return _quote(json.dumps(value))
    if isinstance(value, list) and value:
        return "; ".join(server_message(v) for v in value[:3])
    return _quote(str(value))


def _quote(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit] + "..."


def _timeout() -> httpx.Timeout:
    return httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
