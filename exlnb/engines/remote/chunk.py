"""Every event a server streams, checked for shape in one place before any job reads it.

An event is read as OpenAI's streamed chat answer (`choices[0].delta.content`) or completion (`choices[0].text`),
with its `finish_reason`, its `logprobs` (chat's `content` list; completions' `tokens`, `token_logprobs` and
`top_logprobs`) and its `usage`. Fields exlnb does not read are ignored; a field it reads that has the wrong type
fails the event with `MalformedEvent`, one line naming the server, the endpoint and the field. Valid JSON of the
wrong shape (`"choices": "abc"`, `[5]`, `"content": 42`, `"completion_tokens": "lots"`, `"finish_reason": ["stop"]`,
`"logprob": "abc"`) once raised inside the engine's step, which ended every job in flight.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from exlnb.engines.checks import is_number
from exlnb.engines.remote.client import ServerError, quote, server_message

_MISSING = object()
LOGPROB_ROUNDING = 1e-3  # the most a log-probability may exceed 0 by and be read as rounding


class MalformedEvent(ServerError):
    """An event that is not a JSON object, or one whose fields have the wrong types."""


@dataclass(frozen=True)
class TokenLogprob:
    """One token the server names by its text, with its log-probability and its likeliest alternatives."""

    token: str
    logprob: float | None
    top: tuple[tuple[str, float | None], ...]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None


@dataclass(frozen=True)
class Chunk:
    """What exlnb reads of one streamed event, every field of its declared type."""

    text: str  # "" where the event carries none (a role-only, finish-only or usage event)
    finish_reason: str | None
    stop_string: bool  # vLLM names the stop string it met in `stop_reason`
    logprobs: tuple[TokenLogprob, ...]
    usage: Usage | None


class _Wrong(Exception):
    """A field of the wrong type, by its path in the event."""

    def __init__(self, path: str, value: object, expected: str) -> None:
        shown = "missing" if value is _MISSING else f"{_show(value)}, not {expected}"
        super().__init__(f"{path} is {shown}")


def parse_chunk(data: bytes, *, chat: bool, endpoint: str) -> Chunk:
    """One event's data as a `Chunk`; `MalformedEvent` for anything else, and `ServerError` for an error the server
    reports inside the stream (vLLM, llama.cpp and `transformers serve` send {"error": ...} there)."""
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise MalformedEvent(f"the server at {endpoint} sent a malformed event (not a JSON object): {_quoted(data)}")
    if value.get("error") is not None:
        raise ServerError(f"the server at {endpoint} failed the request mid-stream: {server_message(value)}")
    try:
        return _chunk(value, chat)
    except _Wrong as wrong:
        raise MalformedEvent(
            f"the server at {endpoint} sent an event of the wrong shape: {wrong}: {_quoted(data)}"
        ) from None


def _chunk(event: dict, chat: bool) -> Chunk:
    usage = _usage(event.get("usage"))
    if event.get("choices") is None and usage is None:  # only a usage event may leave its choices out
        raise _Wrong("choices", event.get("choices", _MISSING), "a list")
    choices = _list(event.get("choices"), "choices")
    if not choices:
        return Chunk("", None, False, (), usage)
    choice = _object(choices[0], "choices[0]", required=True)
    if chat:
        delta = _object(choice.get("delta"), "choices[0].delta")
        text = _text(delta.get("content"), "choices[0].delta.content")
    else:
        text = _text(choice.get("text"), "choices[0].text")
    finish = _text(choice.get("finish_reason"), "choices[0].finish_reason")
    logprobs = _logprobs(choice.get("logprobs"), "choices[0].logprobs")
    return Chunk(text or "", finish or None, isinstance(choice.get("stop_reason"), str), logprobs, usage)


def _usage(value: object) -> Usage | None:
    if value is None:
        return None
    usage = _object(value, "usage")
    details = _object(usage.get("prompt_tokens_details"), "usage.prompt_tokens_details")
    return Usage(
        _count(usage.get("prompt_tokens"), "usage.prompt_tokens"),
        _count(usage.get("completion_tokens"), "usage.completion_tokens"),
        _count(details.get("cached_tokens"), "usage.prompt_tokens_details.cached_tokens"),
    )


def _logprobs(value: object, path: str) -> tuple[TokenLogprob, ...]:
    """Chat's {"content": [{"token", "logprob", "top_logprobs": [{"token", "logprob"}]}]} or completions'
    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...]}."""
    logprobs = _object(value, path)
    if "content" in logprobs:
        return tuple(
            _token(entry, f"{path}.content[{i}]")
            for i, entry in enumerate(_list(logprobs["content"], f"{path}.content"))
        )
    tokens = [
        _text(t, f"{path}.tokens[{i}]", required=True)
        for i, t in enumerate(_list(logprobs.get("tokens"), f"{path}.tokens"))
    ]
    values = [
        _logprob(v, f"{path}.token_logprobs[{i}]")
        for i, v in enumerate(_list(logprobs.get("token_logprobs"), f"{path}.token_logprobs"))
    ]
    tops = _list(logprobs.get("top_logprobs"), f"{path}.top_logprobs") or [None] * len(tokens)
    if not len(tokens) == len(values) == len(tops):
        raise _Wrong(f"{path}.token_logprobs", values, f"one per token ({len(tokens)})")
    return tuple(
        TokenLogprob(token, logprob, _top_map(top, f"{path}.top_logprobs[{i}]"))
        for i, (token, logprob, top) in enumerate(zip(tokens, values, tops))
    )


def _token(value: object, path: str) -> TokenLogprob:
    entry = _object(value, path, required=True)
    top = []
    for i, alternative in enumerate(_list(entry.get("top_logprobs"), f"{path}.top_logprobs")):
        where = f"{path}.top_logprobs[{i}]"
        alternative = _object(alternative, where, required=True)
        top.append(
            (
                _text(alternative.get("token"), f"{where}.token", required=True),
                _logprob(alternative.get("logprob"), f"{where}.logprob"),
            )
        )
    return TokenLogprob(
        _text(entry.get("token"), f"{path}.token", required=True),
        _logprob(entry.get("logprob"), f"{path}.logprob"),
        tuple(top),
    )


def _top_map(value: object, path: str) -> tuple[tuple[str, float | None], ...]:
    return tuple((token, _logprob(logprob, f"{path}[{token!r}]")) for token, logprob in _object(value, path).items())


def _object(value: object, path: str, *, required: bool = False) -> dict:
    """A JSON object; {} for null where the field may be left out."""
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        raise _Wrong(path, value, "an object")
    return value


def _list(value: object, path: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _Wrong(path, value, "a list")
    return value


def _text(value: object, path: str, *, required: bool = False) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise _Wrong(path, value, "a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # JSON's "\ud800" escape decodes to a lone surrogate, which is no character
        raise _Wrong(path, value, "text (it holds a lone surrogate)") from None
    return value


def _count(value: object, path: str) -> int | None:
    if value is None:
        return None
    if not is_number(value, int) or value < 0:
        raise _Wrong(path, value, "a count (an integer >= 0)")
    return int(value)


def _logprob(value: object, path: str) -> float | None:
    """A log-probability: at most 0, less a rounding error (a certain token's float32 softmax can come out a
    hair above 1), read as 0."""
    if value is None:
        return None
    if not is_number(value, float) or math.isnan(value) or value > LOGPROB_ROUNDING:
        raise _Wrong(path, value, "a log-probability (a number <= 0)")
    return min(float(value), 0.0)


def _show(value: object) -> str:
    shown = quote(json.dumps(value) if isinstance(value, (dict, list)) else repr(value), limit=60)
    return f"{shown} ({type(value).__name__})"


def _quoted(data: bytes) -> str:
    return quote(data[:4096].decode("utf-8", errors="replace"))
