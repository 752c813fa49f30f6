"""Finding field report 4's template mistakes in a prompt, and saying where they are.

Two questions, kept apart: is the text shaped like the template (tags balanced, newlines where the
template puts them, a generation prompt at the end), and does the tokenizer turn the tags into their
special tokens (it does not when encoding with special=False, or when the tag is not in the vocabulary at
all; the model then reads `<|im_start|>` as six ordinary tokens).
"""

from __future__ import annotations

import bisect
import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass

from exlnb.engines.base import Tokenizer
from exlnb.templates.formats import TURN_FORMATS, TurnFormat


class LintKind(str, enum.Enum):
    MISSING_TAG = "missing_tag"  # no template, role names without tags, no generation prompt
    UNBALANCED_TAG = "unbalanced_tag"  # a turn opened and never closed, or closed twice
    MISPLACED_NEWLINE = "misplaced_newline"  # newlines (or spaces) where the template has none, or missing
    SPECIAL_AS_TEXT = "special_as_text"  # a tag the model will read as ordinary tokens


@dataclass(frozen=True)
class LintFinding:
    kind: LintKind
    position: int  # character offset in the linted text
    line: int  # 1-based
    column: int  # 1-based
    message: str
    excerpt: str  # the text around the position
    token_index: int | None = None  # where in the encoded prompt, when a tokenizer was given
    tag: str | None = None  # the tag a special_as_text finding is about

    def __str__(self) -> str:
        where = f"line {self.line}, column {self.column}"
        if self.token_index is not None:
            where += f", token {self.token_index}"
        return f"{self.kind.value} at {where}: {self.message} (near {self.excerpt!r})"


@dataclass(frozen=True)
class _Text:
    """The text the model sees, and where each token starts in it."""

    text: str
    token_starts: tuple[int, ...]  # empty when no tokenizer was given
    special_starts: frozenset[int]  # character offsets where a special token begins

    def token_at(self, position: int) -> int | None:
        return bisect.bisect_right(self.token_starts, position) - 1 if self.token_starts else None

    def tokens_between(self, start: int, end: int) -> int:
        return len({self.token_at(p) for p in range(start, end)})


def lint(
    prompt: str | Sequence[int],
    tokenizer: Tokenizer | None = None,
    *,
    template: str = "chatml",
    special: bool = True,
    expect_generation_prompt: bool = True,
) -> list[LintFinding]:
    """Mistakes in `prompt` (text, or token ids) against `template` ("chatml" or "llama3"), in text order.

    With a tokenizer, the prompt is linted as the model receives it: text is encoded with `special`
    (False reproduces exllamav2's default `encode_special_tokens=False`) and decoded token by token, so
    a tag that did not become its special token is reported. Without one, only the text's shape is checked.
    """
    fmt = _turn_format(template)
    if tokenizer is None and not isinstance(prompt, str):
        raise ValueError("linting token ids needs the tokenizer that made them: pass tokenizer=")
    seen = _as_seen(prompt, tokenizer, special)
    findings = _shape(seen, fmt, expect_generation_prompt)
    if tokenizer is not None:
        findings += _tags_as_text(seen, fmt, tokenizer)
    return sorted(findings, key=lambda f: f.position)


def lint_rendered(ids: Sequence[int], template: str, tokenizer: Tokenizer) -> list[LintFinding]:
    """The findings for a prompt exlnb rendered itself in `template`, as `%%exl_generate` shows them.

    "auto" is the model's own chat template, linted as the turn format it uses (if exlnb knows it);
    formats without turn tags ("mistral", "raw") have nothing to lint.
    """
    if template == "auto":
        template = own_turn_format(tokenizer) or ""
    if template not in TURN_FORMATS:
        return []
    return lint(ids, tokenizer, template=template)


def own_turn_format(tokenizer: Tokenizer) -> str | None:
    """The turn format of the model's own chat template, where exlnb knows it ("chatml", "llama3")."""
    own = tokenizer.chat_template or ""
    return next((f.name for f in TURN_FORMATS.values() if f.turn_start in own), None)


def summarise(findings: Sequence[LintFinding], template: str, tokenizer: Tokenizer) -> list[str]:
    """The findings as a reader takes them in: the tags of `template` that this tokenizer does not have at all,
    which the model reads as plain text wherever they stand, as one line ("6 llama3 tags are plain text here:
    this model's template is chatml"), then every other finding as itself."""
    if template == "auto":
        template = own_turn_format(tokenizer) or template
    specials = set(tokenizer.special_tokens())
    foreign = [f for f in findings if f.kind is LintKind.SPECIAL_AS_TEXT and f.tag not in specials]
    lines = [str(f) for f in findings if f not in foreign]
    if not foreign:
        return lines
    tags = ", ".join(dict.fromkeys(f.tag for f in foreign))
    own = own_turn_format(tokenizer)
    whose = (
        f"this model's template is {own} (--template {own}, or auto)"
        if own and own != template
        else f"this model's template is not {template} (--template auto renders its own)"
    )
    plural = "s are" if len(foreign) > 1 else " is"
    return [f"{len(foreign)} {template} tag{plural} plain text here ({tags}): {whose}", *lines]


def _turn_format(template: str) -> TurnFormat:
    try:
        return TURN_FORMATS[template]
    except KeyError:
        raise ValueError(f"lint knows the turn formats {', '.join(TURN_FORMATS)}, not {template!r}") from None


def _as_seen(prompt: str | Sequence[int], tokenizer: Tokenizer | None, special: bool) -> _Text:
    if tokenizer is None:
        return _Text(prompt, (), frozenset())
    ids = tokenizer.encode(prompt, special=special) if isinstance(prompt, str) else list(prompt)
    special_ids = set(tokenizer.special_tokens().values())
    pieces, starts, special_starts, offset = [], [], set(), 0
    for token_id in ids:
        piece = tokenizer.decode([token_id])
        starts.append(offset)
        if token_id in special_ids:
            special_starts.add(offset)
        pieces.append(piece)
        offset += len(piece)
    return _Text("".join(pieces), tuple(starts), frozenset(special_starts))


class _Reporter:
    def __init__(self, seen: _Text) -> None:
        self.seen = seen
        self.findings: list[LintFinding] = []

    def add(self, kind: LintKind, position: int, message: str, tag: str | None = None) -> None:
        text = self.seen.text
        line = text.count("\n", 0, position) + 1
        column = position - (text.rfind("\n", 0, position) + 1) + 1
        excerpt = text[max(0, position - 12) : position + 18]
        self.findings.append(
            LintFinding(kind, position, line, column, message, excerpt, self.seen.token_at(position), tag)
        )


def _shape(seen: _Text, fmt: TurnFormat, expect_generation_prompt: bool) -> list[LintFinding]:
    """Tags balanced, roles followed by the template's role end, separators between turns."""
    text, report = seen.text, _Reporter(seen)
    start, end = fmt.turn_start, fmt.turn_end
    if fmt.begin and not text.startswith(fmt.begin):
        report.add(LintKind.MISSING_TAG, 0, f"{fmt.name} text starts with {fmt.begin}")
    tags = [(m.start(), m.group()) for m in re.finditer(f"{re.escape(start)}|{re.escape(end)}", text)]
    if not any(tag == start for _, tag in tags):
        report.add(
            LintKind.MISSING_TAG,
            0,
            f"no {start} anywhere: this is not {fmt.name} (no template, or role names without their tags)",
        )
        return report.findings
    _check_gap(report, fmt, len(fmt.begin) if text.startswith(fmt.begin) else 0, tags[0][0], expected="")
    open_role, open_at, content_start = None, None, 0
    for i, (position, tag) in enumerate(tags):
        next_at = tags[i + 1][0] if i + 1 < len(tags) else len(text)
        if tag == start:
            if open_at is not None:
                report.add(
                    LintKind.UNBALANCED_TAG,
                    position,
                    f"{start} opens a turn while the {open_role} turn opened at character {open_at} has no {end}",
                )
            open_role, content_start = _check_header(report, fmt, position + len(start))
            open_at = position
        else:
            if open_at is None:
                report.add(LintKind.UNBALANCED_TAG, position, f"{end} closes no open turn")
            elif text[content_start:position].endswith("\n"):
                report.add(
                    LintKind.MISPLACED_NEWLINE,
                    position - 1,
                    f"a newline before {end} becomes part of the {open_role} turn",
                )
            open_role, open_at = None, None
            at_end = next_at == len(text)
            _check_gap(
                report, fmt, position + len(end), next_at, expected="" if at_end else fmt.separator, at_end=at_end
            )
    if open_at is not None and open_role != "assistant":
        report.add(LintKind.UNBALANCED_TAG, open_at, f"the {open_role} turn opened here is never closed with {end}")
    if open_at is None and expect_generation_prompt:
        report.add(
            LintKind.MISSING_TAG,
            len(text),
            f"the text ends without {start}assistant{fmt.role_end!r}: nothing tells the model to answer",
        )
    return report.findings


def _check_header(report: _Reporter, fmt: TurnFormat, after_tag: int) -> tuple[str, int]:
    """The role right after the start tag, then exactly the template's role end. Returns (role, content start)."""
    text = report.seen.text
    leading = len(text[after_tag:]) - len(text[after_tag:].lstrip())
    if leading:
        report.add(
            LintKind.MISPLACED_NEWLINE,
            after_tag,
            f"{text[after_tag : after_tag + leading]!r} after {fmt.turn_start}: "
            "the role name must follow the tag directly",
        )
    role_match = re.compile(r"\w*").match(text, after_tag + leading)
    role, role_end_at = role_match.group(), role_match.end()
    if not role:
        report.add(LintKind.MISSING_TAG, role_end_at, f"no role name after {fmt.turn_start}")
    if text.startswith(fmt.role_end, role_end_at):
        content_start = role_end_at + len(fmt.role_end)
        if fmt.role_end.endswith("\n") and text.startswith("\n", content_start):
            report.add(
                LintKind.MISPLACED_NEWLINE,
                content_start,
                f"an extra newline starts the {role} turn: the template puts exactly {fmt.role_end!r} after the role",
            )
        return role, content_start
    found = text[role_end_at : role_end_at + len(fmt.role_end)] or "the end of the text"
    report.add(
        LintKind.MISPLACED_NEWLINE,
        role_end_at,
        f"the role {role!r} must be followed by {fmt.role_end!r}, found {found!r}",
    )
    return role, role_end_at


def _check_gap(
    report: _Reporter, fmt: TurnFormat, start: int, end: int, *, expected: str, at_end: bool = False
) -> None:
    """What lies between two turns (or before the first) must be the template's separator and nothing else."""
    gap = report.seen.text[start:end]
    if gap == expected or (at_end and gap == fmt.separator):
        return
    if gap.strip():
        offset = start + len(gap) - len(gap.lstrip())
        report.add(LintKind.MISSING_TAG, offset, f"text outside any turn: a {fmt.turn_start}role line is missing")
    else:
        report.add(LintKind.MISPLACED_NEWLINE, start, f"{gap!r} between turns where {fmt.name} puts {expected!r}")


def _tags_as_text(seen: _Text, fmt: TurnFormat, tokenizer: Tokenizer) -> list[LintFinding]:
    """Every tag (of the template, or any special token) that reached the model as ordinary tokens."""
    report = _Reporter(seen)
    specials = set(tokenizer.special_tokens())
    for tag in set(fmt.tags) | specials:
        for match in re.finditer(re.escape(tag), seen.text):
            position = match.start()
            if position in seen.special_starts:
                continue
            count = seen.tokens_between(position, match.end())
            if tag in specials:
                report.add(
                    LintKind.SPECIAL_AS_TEXT,
                    position,
                    f"{tag} was encoded as {count} plain tokens, not its special token: encode with special=True "
                    "(exllamav2: encode_special_tokens=True)",
                    tag,
                )
            else:
                report.add(
                    LintKind.SPECIAL_AS_TEXT,
                    position,
                    f"{tag} is not a special token of this tokenizer, so the model reads {count} ordinary tokens: "
                    f"this model's template is probably not {fmt.name}",
                    tag,
                )
    return report.findings
