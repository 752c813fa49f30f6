"""Prompt formats (`render`, ChatML and its broken variants) and the linter for field report 4's mistakes."""

from exlnb.templates.formats import (
    CHATML,
    CHATML_VARIANTS,
    LLAMA3,
    SMOLLM2_SYSTEM,
    TEMPLATES,
    TURN_FORMATS,
    ChatmlVariant,
    Message,
    TurnFormat,
    as_messages,
    chatml,
    conversation,
    render,
)
from exlnb.templates.lint import LintFinding, LintKind, lint, lint_rendered, summarise

__all__ = [
    "CHATML",
    "CHATML_VARIANTS",
    "LLAMA3",
    "SMOLLM2_SYSTEM",
    "TEMPLATES",
    "TURN_FORMATS",
    "ChatmlVariant",
    "LintFinding",
    "LintKind",
    "Message",
    "TurnFormat",
    "as_messages",
    "chatml",
    "conversation",
    "lint",
    "lint_rendered",
    "summarise",
    "render",
]
