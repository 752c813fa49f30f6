"""Prompt formats: rendering chat messages to prompt text, and the ChatML mistakes of field report 4.

`render(template, messages)` turns system/user/assistant turns into the text a model expects: ChatML,
Llama 3, Mistral, raw text, or the model's own template ("auto", the tokenizer's chat_template).
`CHATML_VARIANTS` are ChatML with one mistake each, for measuring what a wrong template costs
(`exlnb.templates.lint` finds those mistakes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from exlnb.engines.base import Tokenizer

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Message:
    """One turn of a conversation."""

    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} is not one of {', '.join(ROLES)}")

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


MessagesLike = Iterable["Message | Mapping[str, str]"]


def as_messages(messages: MessagesLike) -> list[Message]:
    """Accept `Message`s or Hugging Face style dicts ({"role": ..., "content": ...})."""
    return [m if isinstance(m, Message) else Message(m["role"], m["content"]) for m in messages]


def conversation(user: str, system: str | None = None, history: MessagesLike = ()) -> list[Message]:
    """The messages for one new user turn: an optional system prompt, earlier turns, the new question."""
    head = [Message("system", system)] if system else []
    return head + as_messages(history) + [Message("user", user)]


@dataclass(frozen=True)
class TurnFormat:
    """A template that wraps every turn as `turn_start role role_end content turn_end separator`.

    ChatML and Llama 3 both have this shape; so the renderer and the linter serve both.
    """

    name: str
    begin: str  # once, before the first turn
    turn_start: str
    role_end: str
    turn_end: str
    separator: str

    def render(self, messages: MessagesLike, *, add_generation_prompt: bool = True) -> str:
        turns = "".join(
            f"{self.turn_start}{m.role}{self.role_end}{m.content}{self.turn_end}{self.separator}"
            for m in as_messages(messages)
        )
        answer = f"{self.turn_start}assistant{self.role_end}" if add_generation_prompt else ""
        return f"{self.begin}{turns}{answer}"

    @property
    def tags(self) -> tuple[str, ...]:
        """The special tokens the format writes into the text."""
        parts = (self.begin, self.turn_start, self.role_end.strip(), self.turn_end)
        return tuple(dict.fromkeys(p for p in parts if p))


# field report 4's correct form:
# <|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n
CHATML = TurnFormat("chatml", "", "<|im_start|>", "\n", "<|im_end|>", "\n")
# Meta's Llama 3 instruct format: a header per turn, two newlines after it, no separator between turns
LLAMA3 = TurnFormat("llama3", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>\n\n", "<|eot_id|>", "")
TURN_FORMATS = {f.name: f for f in (CHATML, LLAMA3)}


def render_mistral(messages: MessagesLike) -> str:
    """Mistral instruct: `<s>[INST] {user} [/INST]{answer}</s>`; no system role, so the system prompt
    leads the first user turn, as Mistral's own template does."""
    messages = as_messages(messages)
    system = "\n\n".join(m.content for m in messages if m.role == "system")
    parts = ["<s>"]
    for m in (m for m in messages if m.role != "system"):
        if m.role == "user":
            content = f"{system}\n\n{m.content}" if system else m.content
            system = ""
            parts.append(f"[INST] {content} [/INST]")
        else:
            parts.append(f"{m.content}</s>")
    return "".join(parts)


def render_raw(messages: MessagesLike) -> str:
    """No template: the turns' text, separated by blank lines."""
    return "\n\n".join(m.content for m in as_messages(messages))


TEMPLATES = ("auto", "chatml", "llama3", "mistral", "raw")


def render(
    template: str,
    messages: MessagesLike,
    tokenizer: Tokenizer | None = None,
    *,
    add_generation_prompt: bool = True,
) -> str:
    """Messages to prompt text in `template`: "chatml", "llama3", "mistral", "raw", or "auto" (the
    model's own chat template, which needs `tokenizer`). Encode the result with special tokens enabled."""
    if template in TURN_FORMATS:
        return TURN_FORMATS[template].render(messages, add_generation_prompt=add_generation_prompt)
    if template == "mistral":
        return render_mistral(messages)
    if template == "raw":
        return render_raw(messages)
    if template == "auto":
        return _render_own(messages, tokenizer, add_generation_prompt)
    raise ValueError(f"unknown template {template!r}: use one of {', '.join(TEMPLATES)}")


def _render_own(messages: MessagesLike, tokenizer: Tokenizer | None, add_generation_prompt: bool) -> str:
    if tokenizer is None:
        raise ValueError('template "auto" renders with the model\'s own chat template: pass the tokenizer')
    if not tokenizer.chat_template:
        raise ValueError(
            'this model has no chat template, so template "auto" cannot render: pick "chatml", "llama3", '
            '"mistral" or "raw"'
        )
    dicts = [m.as_dict() for m in as_messages(messages)]
    return tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt)


def chatml(user: str, system: str | None = SMOLLM2_SYSTEM) -> str:
    """One user turn in ChatML, ending where the assistant's answer begins (SmolLM2's system prompt by default)."""
    return CHATML.render(conversation(user, system))


# -- ChatML with one mistake each (field report 4) -------------------------------------------------------


@dataclass(frozen=True)
class ChatmlVariant:
    """ChatML rendered with (at most) one of field report 4's mistakes."""

    name: str
    mistake: str  # in field report 4's words
    render: Callable[[MessagesLike], str]
    special: bool = True  # encode tag text as special tokens; False is the "special tokens as text" mistake
    lint_kind: str | None = None  # what `exlnb.templates.lint` reports for it (None: nothing)

    def encode(self, messages: MessagesLike, tokenizer: Tokenizer) -> list[int]:
        return tokenizer.encode(self.render(messages), special=self.special)


def _no_im_end(messages: MessagesLike) -> str:
    turns = "".join(f"<|im_start|>{m.role}\n{m.content}\n" for m in as_messages(messages))
    return f"{turns}<|im_start|>assistant\n"


def _tags_removed(messages: MessagesLike) -> str:
    return "".join(f"{m.role}\n{m.content}\n" for m in as_messages(messages)) + "assistant\n"


def _misplaced_newlines(messages: MessagesLike) -> str:
    turns = "".join(f"<|im_start|>\n{m.role} {m.content}<|im_end|>" for m in as_messages(messages))
    return f"{turns}<|im_start|>\nassistant"


CHATML_VARIANTS: dict[str, ChatmlVariant] = {
    v.name: v
    for v in (
        ChatmlVariant("chatml", "none: the correct template", CHATML.render),
        ChatmlVariant("no_im_end", "missing tags: no <|im_end|> closes a turn", _no_im_end, lint_kind="unbalanced_tag"),
        ChatmlVariant(
            "tags_removed",
            "missing tags: role names without <|im_start|> or <|im_end|>",
            _tags_removed,
            lint_kind="missing_tag",
        ),
        ChatmlVariant(
            "misplaced_newlines",
            "newlines in the wrong place: before the role instead of after it, none between turns or after assistant",
            _misplaced_newlines,
            lint_kind="misplaced_newline",
        ),
        ChatmlVariant(
            "special_as_text",
            "special tokens encoded as plain text (encode_special_tokens=False)",
            CHATML.render,
            special=False,
            lint_kind="special_as_text",
        ),
        ChatmlVariant("no_template", "no template: the turns' bare text", render_raw, lint_kind="missing_tag"),
    )
}
