"""Named multi-turn chats, kept in the kernel process for as long as it lives.

Field report 4: keeping every earlier turn in the context makes each answer slower than the last
(attention over an ever longer sequence). `Chat.clear()` (what `--amnesia` does before a turn) is the fix
the report gives, as exllamav2's chat example does with its `--amnesia` flag.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from exlnb.engines.base import Tokenizer
from exlnb.templates import Message, conversation, render


@dataclass
class Chat:
    """A conversation: an optional system prompt and the user/assistant turns so far."""

    name: str
    system: str | None = None
    turns: list[Message] = field(default_factory=list)

    def prompt(self, user: str, template: str, tokenizer: Tokenizer | None = None) -> str:
        """The prompt text for a new user turn after everything said so far."""
        return render(template, conversation(user, self.system, self.turns), tokenizer)

    def add_turn(self, user: str, answer: str) -> None:
        self.turns += [Message("user", user), Message("assistant", answer)]

    def clear(self) -> None:
        """Forget every turn (the system prompt stays)."""
        self.turns.clear()

    def __repr__(self) -> str:
        return f"<Chat {self.name!r}: {len(self.turns) // 2} exchanges>"


_chats: dict[str, Chat] = {}
_chats_lock = threading.Lock()


def get_chat(name: str) -> Chat:
    """The chat called `name`, created empty on first use."""
    with _chats_lock:
        return _chats.setdefault(name, Chat(name))


def forget_chat(name: str) -> bool:
    """Drop a chat entirely; False if there was none by that name."""
    with _chats_lock:
        return _chats.pop(name, None) is not None
