"""Options declared once, as dataclass fields that carry their help, their group and their flag.

`SamplerSettings`, `GenerationRequest` and `%%exl_generate`'s `CellOptions` declare every option with
`option()`. The magic's flags, grouping and help, the Python keywords and signature (`takes_request_options`)
and `docs/options.md` are all read back from those fields (`declared`), so adding an option is one field and
nothing can disagree with it.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, Field, dataclass, field, fields

# the help's sections, in the order a user meets them
GROUPS = {
    "prompt": "what the model is asked and how it is rendered",
    "samples": "how many answers, how long, and where they stop",
    "sampling": "how each token is drawn",
    "penalties": "repetition penalties over the whole sequence",
    "DRY and XTC": "DRY's repeat penalty and XTC's exclusion of the top choices",
    "constraints": "what the answer must be, or must never contain",
    "display": "how the answer is shown",
    "output": "where the answer is kept",
}


@dataclass(frozen=True)
class Option:
    """One declared option as every reader sees it: the Python keyword, the magic's flag, help and type."""

    name: str  # the dataclass field
    keyword: str  # the name users write in Python and, with dashes, in the magic: the field's, or a short one
    flag: str
    help: str
    group: str
    default: object
    hint: object  # the field's type
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    repeatable: bool = False  # given once per item in the magic (`--stop A --stop B`)

    @property
    def scalar(self) -> type | None:
        """int, float, str or bool where the option takes one such value; None for anything richer."""
        arms = [a for a in typing.get_args(self.hint) if a is not type(None)] or [self.hint]
        if str in arms:  # text the reader of the option interprets (a file name, a pattern)
            return str
        return arms[0] if len(arms) == 1 and arms[0] in (bool, int, float) else None


def option(default: object = MISSING, *, help: str, group: str, short: str | None = None, flag: str | None = None,
           choices: tuple[str, ...] | None = None, metavar: str | None = None, repeatable: bool = False) -> typing.Any:
    """A dataclass field declaring an option: `short` is the keyword where the field's name is long
    (exllamav2's `token_repetition_penalty` is `rep_penalty`), `flag` the magic's where it differs from it."""
    if group not in GROUPS:
        raise ValueError(f"group={group!r}: choose one of {', '.join(GROUPS)}")
    metadata = dict(help=help, group=group, short=short, flag=flag, choices=choices, metavar=metavar,
                    repeatable=repeatable)
    return field(default=default, metadata=metadata)


def declared(cls: type) -> tuple[Option, ...]:
    """The options a dataclass declares with `option()`, in field order."""
    hints = typing.get_type_hints(cls)
    return tuple(_read(f, hints[f.name]) for f in fields(cls) if "group" in f.metadata)


def _read(f: Field, hint: object) -> Option:
    meta = f.metadata
    keyword = meta["short"] or f.name
    return Option(
        name=f.name, keyword=keyword, flag=meta["flag"] or "--" + keyword.replace("_", "-"), help=meta["help"],
        group=meta["group"], default=f.default, hint=hint, choices=meta["choices"], metavar=meta["metavar"],
        repeatable=meta["repeatable"],
    )
