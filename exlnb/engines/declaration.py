"""Options declared once, as dataclass fields that carry their help, their group and their flag.

`SamplerSettings`, `JobOptions`, `GenerationRequest`, `%%exl_generate`'s `CellOptions` and `LoadOptions` declare
every option with `option()`. The magics' flags, grouping and help, the Python keywords and signatures
(`takes_options`) and `docs/options.md` are all read back from those fields (`declared`), so adding an option is
one field and nothing can disagree with it.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields

# %%exl_generate's help sections, in the order a user meets them
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
# what %%exl_tree adds, shown before %%exl_generate's display and output groups
TREE_GROUPS = {"tree": "what a sample tree records, how far an expansion reaches, and what the tree is compared with"}
# %exl_load's
LOAD_GROUPS = {
    "model": "what is loaded, and by which engine",
    "cache": "the KV cache and the jobs that share it",
    "GPUs": "how the model is spread over GPUs and how its decode steps run",
    "server": "an OpenAI-compatible server, for the engines that load a url",
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
    parse: Callable[[str], object] | None = None  # how the magic reads the flag's text, where its type cannot say
    positional: bool = False  # the magic's positional argument (`%exl_load MODEL`), not a flag

    @property
    def scalar(self) -> type | None:
        """int, float, str or bool where the option takes one such value; None for anything richer."""
        arms = [a for a in typing.get_args(self.hint) if a is not type(None)] or [self.hint]
        if str in arms:  # text the reader of the option interprets (a file name, a pattern)
            return str
        return arms[0] if len(arms) == 1 and arms[0] in (bool, int, float) else None


def option(
    default: object = MISSING,
    *,
    help: str,
    group: str,
    short: str | None = None,
    flag: str | None = None,
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    repeatable: bool = False,
    parse: Callable[[str], object] | None = None,
    positional: bool = False,
) -> typing.Any:
    """A dataclass field declaring an option: `short` is the keyword where the field's name is long
    (exllamav2's `token_repetition_penalty` is `rep_penalty`), `flag` the magic's where it differs from it,
    `parse` how the magic reads a flag whose values its type cannot say (`--gpu-split 20,24`)."""
    if group not in {**GROUPS, **TREE_GROUPS, **LOAD_GROUPS}:
        raise ValueError(f"group={group!r}: choose one of {', '.join([*GROUPS, *TREE_GROUPS, *LOAD_GROUPS])}")
    metadata = dict(
        help=help,
        group=group,
        short=short,
        flag=flag,
        choices=choices,
        metavar=metavar,
        repeatable=repeatable,
        parse=parse,
        positional=positional,
    )
    return field(default=default, metadata=metadata)


def same_option(cls: type, name: str) -> typing.Any:
    """`cls`'s declaration of option `name` again, for a class that takes the same option (`GenerationRequest`
    takes `JobOptions`' `max_new_tokens`): one declaration, one help, one default."""
    declared_field = cls.__dataclass_fields__[name]
    return field(default=declared_field.default, metadata=declared_field.metadata)


def declared(cls: type) -> tuple[Option, ...]:
    """The options a dataclass declares with `option()`, in field order."""
    hints = typing.get_type_hints(cls)
    return tuple(_read(f, hints[f.name]) for f in fields(cls) if "group" in f.metadata)


def _read(f: Field, hint: object) -> Option:
    meta = f.metadata
    keyword = meta["short"] or f.name
    return Option(
        name=f.name,
        keyword=keyword,
        flag=meta["flag"] or "--" + keyword.replace("_", "-"),
        help=meta["help"],
        group=meta["group"],
        default=f.default,
        hint=hint,
        choices=meta["choices"],
        metavar=meta["metavar"],
        repeatable=meta["repeatable"],
        parse=meta["parse"],
        positional=meta["positional"],
    )


def takes_options(*declaring: type, leading: Sequence[inspect.Parameter] = ()):
    """Give `func(..., **options)` a signature that names every option the classes declare, with its type and
    default, after `leading` ones of its own (`sampler`), so `help()`, a notebook's `func?` and tab completion
    show them. Options the function names itself keep its own parameter."""

    def decorate(func):
        signature = inspect.signature(func)
        kept = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
        named = {p.name for p in kept}
        options = [
            *leading,
            *(
                inspect.Parameter(o.keyword, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=o.hint)
                for cls in declaring
                for o in declared(cls)
                if o.keyword not in named
            ),
        ]
        func.__signature__ = signature.replace(parameters=[*kept, *options])
        return func

    return decorate
