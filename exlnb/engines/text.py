"""Turning a growing list of token ids into text chunks, and cutting the text at stop strings.

Shared by engines that produce tokens themselves (the CPU engine); exllamav2 does the same internally.
"""

from __future__ import annotations

from collections.abc import Sequence

from exlnb.engines.base import Tokenizer


class IncrementalDecoder:
    """Emits only complete characters: a token that ends inside a multi-byte character waits for the next.

    Decoding a short window of recent tokens (not the whole sequence) keeps the cost per token constant
    and still gets spacing right for tokenizers that merge pieces.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the window that gives context for spacing
        self._read = 0  # tokens already turned into emitted text

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._tokenizer.decode(self._ids[self._prefix : self._read])
        after = self._tokenizer.decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]


class StopStringFilter:
    """Holds back text that might be the start of a stop string, and cuts the text where one appears."""

    def __init__(self, stop_strings: Sequence[str]) -> None:
        self._stops = [s for s in stop_strings if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was found)."""
        held = self._held + text
        cut = min((held.find(s) for s in self._stops if s in held), default=-1)
        if cut >= 0:
            self._held = ""
            return held[:cut], True
        keep = max((_overlap(held, s) for s in self._stops), default=0)
        self._held = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
