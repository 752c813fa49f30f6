"""A server's streamed answer read frame by frame, each frame checked (`chunk.parse_chunk`), every read bounded.

The event stream is split into events here rather than by a library, so that nothing is held without a bound: an
event (or a line still without its end) past `MAX_EVENT_BYTES`, and an answer past `answer_limit` bytes, are
refused in one line and the connection closed (one 20 MB event became 10,000,000 "new tokens" after 38.6 s of
tokenising; a 200 MB line without a newline was read whole). An answer is finished by its `finish_reason`, which
every server sends (vLLM, SGLang, TabbyAPI and llama.cpp then `[DONE]`; `transformers serve` closes the stream);
a stream that stops before one (a close-delimited body cut mid-answer, a `[DONE]` after no answer) is an error,
not an end of turn.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import aclosing

import httpx

from exlnb.engines.base import wall_clock
from exlnb.engines.remote import client as http
from exlnb.engines.remote.chunk import Chunk, MalformedEvent, parse_chunk
from exlnb.engines.remote.client import ServerAddress, ServerError, open_stream, unreachable

# one frame carries a few tokens: a chat frame of one token with 20 alternatives' logprobs is about 1.5 KB (each
# alternative's {"token", "logprob", "bytes"} some 60 bytes, and the frame's own fields).
# 1 MiB holds hundreds of such tokens, and tokenises in about a second (1 MB of English text: 1.1 s, SmolLM2).
MAX_EVENT_BYTES = 1 << 20
# an answer of n tokens: up to 4 KiB a token (twice the 20-alternative frame above), and room for the role,
# finish and usage frames and one frame at its largest
ANSWER_BYTES_PER_TOKEN = 4 << 10
ANSWER_BYTES_SLACK = 2 * MAX_EVENT_BYTES
_LINE_END = re.compile(rb"\r\n|\r|\n")
_DONE = b"[DONE]"


def answer_limit(max_new_tokens: int) -> int:
    return ANSWER_BYTES_SLACK + ANSWER_BYTES_PER_TOKEN * max_new_tokens


class EventReader:
    """Server-sent events from bytes as they arrive: `feed` returns the data of each event completed, and refuses
    an event over MAX_EVENT_BYTES or a stream over `limit` bytes."""

    def __init__(self, endpoint: str, limit: int) -> None:
        self.endpoint = endpoint
        self.limit = limit
        self.received = 0
        self._pending = bytearray()  # the line not yet ended
        self._data: list[bytes] = []  # the event's data lines so far
        self._event_bytes = 0

    def feed(self, piece: bytes) -> list[bytes]:
        self.received += len(piece)
        if self.received > self.limit:
            raise ServerError(
                f"the server at {self.endpoint} sent more than {self.limit:,} bytes for one answer "
                "(the limit for its max_new_tokens): exlnb closed the stream"
            )
        self._pending += piece
        events = [event for line in self._lines() if (event := self._line(line)) is not None]
        self._check_size(len(self._pending))
        return events

    def _check_size(self, pending: int) -> None:
        """The event so far, with `pending` bytes of a line not yet ended, within MAX_EVENT_BYTES."""
        if self._event_bytes + pending > MAX_EVENT_BYTES:
            raise MalformedEvent(
                f"the server at {self.endpoint} sent an event over {MAX_EVENT_BYTES >> 20} MiB "
                "(or a line that does not end): exlnb read no further"
            )

    def _lines(self) -> list[bytes]:
        lines, start = [], 0
        while (end := _LINE_END.search(self._pending, start)) is not None:
            if end.group() == b"\r" and end.end() == len(self._pending):
                break  # perhaps the first half of \r\n: wait for the next byte
            lines.append(bytes(self._pending[start : end.start()]))
            start = end.end()
        del self._pending[:start]
        return lines

    def _line(self, line: bytes) -> bytes | None:
        """The event's data where `line` ends one (a blank line), else None (comments and other fields are skipped)."""
        if not line:
            data, self._data, self._event_bytes = self._data, [], 0
            return b"\n".join(data) if data else None
        name, _, value = line.partition(b":")
        if name == b"data":
            value = value[1:] if value.startswith(b" ") else value
            self._data.append(value)
            self._event_bytes += len(value)
            self._check_size(0)
        return None


async def answer_chunks(
    client: httpx.AsyncClient, address: ServerAddress, path: str, body: dict, *, chat: bool, max_new_tokens: int
) -> AsyncIterator[tuple[Chunk, float]]:
    """POST `body` and yield each frame's checked chunk with its arrival (`wall_clock()`) until the stream ends;
    ServerError for anything else, a stream that ends before the answer does included."""
    endpoint = address.endpoint(path)
    reader = EventReader(endpoint, answer_limit(max_new_tokens))
    finished = False
    try:
        async with open_stream(client, address, path, body) as response, aclosing(_frames(response, reader)) as frames:
            async for data, arrived in frames:
                chunk = parse_chunk(data, chat=chat, endpoint=endpoint)
                finished = finished or chunk.finish_reason is not None
                yield chunk, arrived
    except httpx.ReadTimeout as error:
        raise ServerError(
            f"the server at {address.shown} sent nothing for {http.READ_TIMEOUT_S:g} s (read timeout): "
            "the stream stalled, so exlnb closed it"
        ) from error
    except httpx.HTTPError as error:
        raise ServerError(unreachable(address, error)) from error
    if not finished:
        raise ServerError(
            f"the server at {endpoint} ended the stream without finishing the answer (no finish_reason "
            f"in {reader.received:,} bytes)"
        )


async def _frames(response: httpx.Response, reader: EventReader) -> AsyncIterator[tuple[bytes, float]]:
    """Each event's data with the moment its bytes arrived, up to `[DONE]` (nothing after it is read)."""
    async for piece in response.aiter_raw():
        arrived = wall_clock()
        for data in reader.feed(piece):
            if data.strip() == _DONE:
                return
            yield data, arrived
