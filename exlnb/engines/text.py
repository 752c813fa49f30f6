"""Turning a growing list of token ids into text chunks, and cutting the text at stop strings.

Shared by engines that produce tokens themselves (the CPU engine); exllamav2 does the same internally.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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

    def state(self) -> tuple[int, int, int]:
        return len(self._ids), self._prefix, self._read

    def restore(self, state: tuple[int, int, int]) -> None:
        """Go back to an earlier `state()`, forgetting the tokens pushed since."""
        count, self._prefix, self._read = state
        del self._ids[count:]


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


@dataclass(frozen=True)
class Rewind:
    """Take the sequence back to `length` tokens and the decoder to `decoder_state`: a banned string appeared."""

    length: int
    decoder_state: tuple[int, int, int]


class BannedStrings:
    """exllamav2's banned strings (dynamic.py): hold back text that could begin one, case-insensitively; when the
    held text contains one, go back to where the hold began and ban there the token that began it.

    The ban lasts while generation stays at that position; each new attempt that ends in a banned string is
    banned too, so the job always moves on.
    """

    def __init__(self, banned: Sequence[str]) -> None:
        self._banned = [b.lower() for b in banned]
        self._text = ""
        self._tokens: list[int] = []
        self._start: Rewind | None = None  # where the current hold began
        self._bans: tuple[int, list[int]] | None = None  # (position, tokens banned there)

    def blocked(self, length: int) -> list[int]:
        """Tokens that may not be sampled at sequence position `length`."""
        return self._bans[1] if self._bans and self._bans[0] == length else []

    def feed(
        self, token: int, text: str, length: int, decoder_state: tuple[int, int, int]
    ) -> tuple[str, list[int]] | Rewind:
        """Text and tokens now safe to emit, or a Rewind. `length` and `decoder_state` are from before `token`."""
        if not self._tokens:
            self._start = Rewind(length, decoder_state)
        self._text += text
        self._tokens.append(token)
        held = self._text.lower()
        if any(b in held for b in self._banned):
            start, first = self._start, self._tokens[0]
            if self._bans and self._bans[0] == start.length:
                self._bans[1].append(first)
            else:
                self._bans = (start.length, [first])
            self._text, self._tokens = "", []
            return start
        if any(_overlap(held, b) for b in self._banned):
            return "", []
        return self.flush()

    def flush(self) -> tuple[str, list[int]]:
        out = self._text, self._tokens
        self._text, self._tokens = "", []
        return out
