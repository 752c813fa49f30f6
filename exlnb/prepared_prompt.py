"""A request's prompt as the model gets it: its user turn rendered through its template, after its system prompt
and its chat's earlier turns, checked to fit the cache, encoded and linted once. `%%exl_generate` and `%%exl_tree`
render a user's turn the same way, through `prepare_prompt`.
"""

from __future__ import annotations

from dataclasses import dataclass

from exlnb.chat import Chat, get_chat
from exlnb.request import GenerationRequest
from exlnb.session import Session
from exlnb.templates import LintFinding, conversation, lint_rendered, render


@dataclass(frozen=True)
class PreparedPrompt:
    """The prompt exactly as the model gets it, rendered and linted once."""

    text: str
    ids: list[int]
    findings: list[LintFinding]
    chat: Chat | None
    loop_guard_by_engine: bool = False  # the jobs carry the engine's own loop detector (`--loop-guard`)


def prepare_prompt(request: GenerationRequest, session: Session) -> PreparedPrompt:
    """The request's prompt as the model gets it: its user turn rendered through its template (after its system
    prompt and its chat's earlier turns), checked to fit, encoded and linted once."""
    tokenizer = session.tokenizer
    conv = conversation_for(request)
    text = (
        conv.prompt(request.prompt, request.template, tokenizer)
        if conv
        else render(request.template, conversation(request.prompt, request.system), tokenizer)
    )
    ids = session.prompt_ids(text, request.max_new_tokens)
    # a class attribute, read without the engine's thread: it never changes
    by_engine = request.loop_guard and session.engine.loop_guard_by_engine
    return PreparedPrompt(text, ids, lint_rendered(ids, request.template, tokenizer), conv, by_engine)


def conversation_for(request: GenerationRequest) -> Chat | None:
    """The chat the request continues, if it names one: its system prompt set, its history cleared for amnesia."""
    if request.chat is None:
        return None
    conv = get_chat(request.chat)
    if request.system is not None:
        conv.system = request.system
    if request.amnesia:
        conv.clear()
    return conv
