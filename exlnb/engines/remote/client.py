"""HTTP to one OpenAI-compatible server, every failure as one line naming the server's words.

httpx carries the requests. Every read has a time bound (`READ_TIMEOUT_S` between bytes) and a size bound: an error
body past `MAX_ERROR_BODY_BYTES` and a probe past `MAX_PROBE_BYTES` are not read further (a 200 MB error body was
read whole, +230 MB). No redirect is followed, so a key never goes on to another address; a redirect is named as
such. A stream is an `async with` block (`open_stream`): leaving it (the job ended, was cancelled, or its task was)
closes the connection, which is how a server learns that its client has gone; whether it then stops generating is
the server's business (experiments/disconnect.py measures it).
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx

from exlnb.engines.options import shown_url

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 60.0  # no byte for this long from a streaming server is a stall: the job fails, the others run on
# FastAPI's 422 repeats the request it refuses, prompt included (a 100k-token prompt is some 400 KB of text)
MAX_ERROR_BODY_BYTES = 1 << 20
# /models lists a few entries; vLLM's /metrics with every histogram is a few hundred KB
MAX_PROBE_BYTES = 8 << 20


class ServerError(RuntimeError):
    """A server refused, failed or could not be reached; the message is one line and quotes the server."""


@dataclass(frozen=True)
class ServerAddress:
    """Where the server is and the key it wants (read from an environment variable, never stored in a notebook).
    `options.check_server_url` has refused a url that is not http(s) or that carries credentials."""

    url: str  # the API's base, e.g. http://127.0.0.1:8000/v1
    api_key_env: str | None = None

    @property
    def base(self) -> str:
        return self.url.rstrip("/")

    @property
    def root(self) -> str:
        """The server's own root (where /metrics and /health live), the API base without its /v1."""
        return self.base.removesuffix("/v1")

    @property
    def shown(self) -> str:
        """The API base as every message and view shows it."""
        return shown_url(self.base)

    def endpoint(self, path: str) -> str:
        """An endpoint as messages name it, e.g. http://127.0.0.1:8000/v1/chat/completions."""
        return f"{self.shown}{path}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {os.environ[self.api_key_env]}"} if self.api_key_env else {}


class Body:
    """A response body read up to `limit` bytes and no further."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.cut = False  # more came than `limit`: the rest was not read

    def add(self, piece: bytes) -> bool:
        """Keep `piece`; False once the body is past its limit (stop reading)."""
        self.data += piece[: self.limit - len(self.data) + 1]
        self.cut = len(self.data) > self.limit
        del self.data[self.limit :]
        return not self.cut

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


def _probe(address: ServerAddress, url: str, path: str) -> Body:
    """GET `url` and read its body up to MAX_PROBE_BYTES; ServerError in one line for anything but an answer."""
    body = Body(MAX_PROBE_BYTES)
    try:
        with httpx.stream("GET", url, headers=address.headers(), timeout=_timeout()) as response:
            for piece in response.iter_bytes():
                if not body.add(piece):
                    break
    except httpx.HTTPError as error:
        raise ServerError(unreachable(address, error)) from error
    if response.is_redirect or response.is_error:
        raise ServerError(refusal(address, path, response, body))
    if body.cut:
        raise ServerError(
            f"the server at {address.endpoint(path)} answered with more than {_size(body.limit)}: exlnb read no further"
        )
    return body


def get_json(address: ServerAddress, path: str) -> dict:
    """GET `path` under the API base (a load-time probe such as /models); ServerError in one line otherwise."""
    body = _probe(address, f"{address.base}{path}", path)
    try:
        value = json.loads(body.data)
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise ServerError(
            f"the server at {address.endpoint(path)} answered with something that is not a JSON object: "
            f"{quote(body.text)}"
        )
    return value


def get_text(address: ServerAddress, path: str) -> str | None:
    """GET `path` under the server's root (e.g. /metrics); None where the server gives no such page."""
    try:
        return _probe(address, f"{address.root}{path}", path).text
    except ServerError:
        return None


@asynccontextmanager
async def open_stream(
    client: httpx.AsyncClient, address: ServerAddress, path: str, body: dict
) -> AsyncIterator[httpx.Response]:
    """POST `body` and hand over the response once it is an event stream; ServerError for a refusal, a redirect
    or another kind of answer. httpx's exceptions pass through: the reader names them (`unreachable`)."""
    # identity: the reader bounds the bytes as they come, which a compressed body would not let it do
    headers = {
        **address.headers(),
        "Accept": "text/event-stream",
        "Accept-Encoding": "identity",
        "Cache-Control": "no-store",
    }
    async with client.stream(
        "POST", f"{address.base}{path}", json=body, headers=headers, timeout=_timeout()
    ) as response:
        if response.is_redirect or response.is_error:
            error_body = Body(MAX_ERROR_BODY_BYTES)
            async for piece in response.aiter_bytes():
                if not error_body.add(piece):
                    break
            raise ServerError(refusal(address, path, response, error_body))
        kind = response.headers.get("content-type", "").partition(";")[0].strip()
        if kind != "text/event-stream":
            raise ServerError(
                f"the server at {address.endpoint(path)} did not answer with an event stream: "
                f"its Content-Type is {kind or 'missing'!r}, not 'text/event-stream'"
            )
        yield response


def unreachable(address: ServerAddress, error: httpx.HTTPError) -> str:
    if isinstance(error, httpx.ConnectError):
        return f"cannot connect to the server at {address.shown}: {error} (is it running, and is the url right?)"
    if isinstance(error, httpx.RemoteProtocolError):
        return f"the server at {address.shown} closed the connection mid-answer: {error}"
    if isinstance(error, httpx.TimeoutException):
        return f"the server at {address.shown} did not answer in time ({type(error).__name__})"
    return f"talking to the server at {address.shown} failed: {type(error).__name__}: {error}"


def refusal(address: ServerAddress, path: str, response: httpx.Response, body: Body) -> str:
    """An HTTP error or redirect as one line: the status, its meaning and the server's own message (or where a
    redirect points, since exlnb follows none: a key would go with it)."""
    status = response.status_code
    said = f"the server at {address.endpoint(path)} answered {status} {httpx.codes.get_reason_phrase(status)}"
    if response.is_redirect:
        target = response.headers.get("location", "")
        where = shown_url(str(response.url.join(target))) if target else "nowhere"
        return (
            f"{said}, a redirect to {where}: exlnb follows no redirect, so that a key never goes on to "
            "another address; give the url it points to"
        )
    if body.cut:
        return f"{said} with a body over {_size(body.limit)}, read no further: {quote(body.text)}"
    try:
        message = server_message(json.loads(body.data))
    except (ValueError, RecursionError):
        message = quote(body.text)
    hint = {
        401: " (check --api-key-env)",
        403: " (check --api-key-env)",
        404: " (check the url and the model name)",
        429: " (the server is rate limiting: retry later, or send fewer requests)",
        503: " (the server is overloaded or starting: retry later)",
    }.get(status, "")
    return f"{said}: {message}{hint}"


def server_message(value: object) -> str:
    """The human part of an error body, as OpenAI ({"error": {"message"}}), FastAPI ({"detail"}) and others write it."""
    if isinstance(value, dict):
        for key in ("error", "detail", "message"):
            if key in value:
                return server_message(value[key])
        return quote(json.dumps(value))
    if isinstance(value, list) and value:
        return "; ".join(server_message(v) for v in value[:3])
    return quote(str(value))


def quote(text: str, limit: int = 300) -> str:
    """A server's words in one line of at most `limit` characters."""
    line = " ".join(text[: 4 * limit].split())
    return line if len(line) <= limit else line[:limit] + "..."


def _size(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit >> 10} KiB"


def _timeout() -> httpx.Timeout:
    return httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
