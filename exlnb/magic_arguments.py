"""What the magics parse: the options they declare, their help (grouped, with examples, a misspelt option's
suggestion), the values their flags take, and the one-line errors a user's mistake gets.

`%%exl_generate`'s options are the ones `GenerationRequest`, `SamplerSettings` and `CellOptions` declare, and
`%exl_load`'s the ones `LoadOptions` declares (`exlnb.engines.declaration`); `exlnb.magics` holds the magics
themselves, each one call into the Python API.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import keyword
import re
import shlex
import string
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from IPython.core.error import UsageError
from IPython.core.magic_arguments import MagicHelpFormatter, argument, argument_group, kwds, magic_arguments, real_name

from exlnb.engines.base import SamplerSettings
from exlnb.engines.declaration import GROUPS, LOAD_GROUPS, TREE_GROUPS, Option, declared, option, same_option
from exlnb.request import GenerationRequest
from exlnb.session import LoadFailed, LoadOptions, NoModelLoaded
from exlnb.streaming import JobError
from exlnb.trees import REQUEST_OPTIONS, TreeOptions
from exlnb.widgets.stream import ShowOptions


def variable_name(text: str) -> str:
    """`--out VAR` as every magic reads it: the name of a Python variable to store a result in."""
    if not text.isidentifier() or keyword.iskeyword(text):
        raise ValueError(
            f"--out {text}: name a Python variable (letters, digits and _, not starting with a digit, not a keyword)"
        )
    return text


def out_option(help: str):
    """A cell magic's declared `--out VAR`: the notebook variable it keeps its result in."""
    return option(None, group="output", metavar="VAR", parse=variable_name, help=help)


@dataclass(frozen=True)
class CellOptions(ShowOptions):
    """What `%%exl_generate` adds to a `GenerationRequest`: how the answer is shown and where it is kept."""

    out: str | None = out_option(
        "store the result in this variable (a list for --n > 1; the running Generation with --background)"
    )


@dataclass(frozen=True)
class TreeCellOptions:
    """What `%%exl_tree` adds to a tree's options: how it is shown and where it is kept."""

    display: str = same_option(ShowOptions, "display")
    out: str | None = out_option(
        "store the tree (a SampleTree) in this variable; what the view grows after is stored there too"
    )


# every %%exl_generate option, as its declarations say
GENERATE_OPTIONS = (*declared(GenerationRequest), *declared(SamplerSettings), *declared(CellOptions))
# every %%exl_tree option: the prompt's and the sampler's as %%exl_generate takes them, the tree's own, the cell's
TREE_OPTIONS = (
    *(o for o in declared(GenerationRequest) if o.keyword in REQUEST_OPTIONS),
    *declared(SamplerSettings),
    *declared(TreeOptions),
    *declared(TreeCellOptions),
)
# %%exl_tree's help sections: %%exl_generate's, the tree's own before how it is shown and kept
SHOWN_LAST = ("display", "output")
TREE_HELP_GROUPS = {
    **{name: words for name, words in GROUPS.items() if name not in SHOWN_LAST},
    **TREE_GROUPS,
    **{name: GROUPS[name] for name in SHOWN_LAST},
}
TREE_USAGE = "%%exl_tree [options]\n  the prompt, on the lines below"
TREE_EXAMPLES = """Sample the cell body (the user's turn) N times and merge the answers into one tree (docs/tree.md).

Examples:
  %%exl_tree --n 64 --temperature 1.0 --max-new-tokens 24 --seed 1 --out tree
  Name a colour.

  %%exl_tree --n 32 --reference /models/my-model-fp16
  Write the first line of a poem about {topic}."""
CELL_OPTIONS = tuple(o.keyword for o in declared(CellOptions))  # what the magic keeps from the request
GENERATE_USAGE = "%%exl_generate [options]\n  the prompt, on the lines below"
GENERATE_EXAMPLES = """Generate from the cell body as the user's turn; {name} is filled from the notebook's variables.

Examples:
  %%exl_generate --temperature 0 --max-new-tokens 64
  What is the capital of France?

  %%exl_generate --n 4 --seed 1 --out answers
  Write a haiku about {topic}.

  %%exl_generate --json-schema Person --tokens 5
  Describe a fictional person as JSON."""


class _HelpShown(Exception):
    """`--help` printed the help: the magic has nothing more to do."""


class ShowHelp(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="show this help and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(parser.format_help())
        raise _HelpShown


# every magic's `-h`/`--help`, one argument applied to each, as IPython applies its `magic_gui_arg`
help_argument = argument("-h", "--help", action=ShowHelp)


class _Help(MagicHelpFormatter):
    """IPython's magic help without the reStructuredText `::` before the usage line."""

    def add_usage(self, usage, actions, groups, prefix="%"):
        super().add_usage(usage, actions, groups, prefix)


def escaped(text: str) -> str:
    """Let `--stop "\\n\\n"` mean two newlines."""
    return text.replace("\\n", "\n").replace("\\t", "\t")


def sizes_argument(text: str) -> tuple[int, ...]:
    """`--batch-sizes 2,8,16`: whole numbers, comma separated."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"{text!r}: give whole numbers separated by commas, e.g. 2,8,16") from None


def python_value(text: str):
    """A setting written as a Python literal: `--token-bias "{42: -5.0}"`."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise UsageError(f"{text!r} is not a Python literal (e.g. 1.5, (1, 2), {{'a': 1}})") from None


def parse_options(magic, line: str) -> argparse.Namespace | None:
    """The magic's options, split like a shell line: IPython's own `parse_argstring` keeps the quotes, so
    `--system "Be brief."` would reach the model with its quote marks. An unknown option names the valid ones.
    None when `--help` printed the help."""
    try:
        argv = shlex.split(line)
    except ValueError as error:
        raise UsageError(f"the options do not parse ({error}): {line}") from None
    parser = magic.parser
    try:
        args, unknown = parser.parse_known_args(argv)
    except _HelpShown:
        return None
    if unknown:
        raise UsageError(_unknown_options(unknown, parser, _called_as(magic)))
    return args


CELL_MAGICS = ("exl_generate", "exl_tree")


def _called_as(magic) -> str:
    name = real_name(magic)
    return f"%%{name}" if name in CELL_MAGICS else f"%{name}"


def _unknown_options(unknown: list[str], parser: argparse.ArgumentParser, name: str) -> str:
    known = sorted(s for action in parser._actions for s in action.option_strings if s.startswith("--"))
    wrong = next((u for u in unknown if u.startswith("-")), unknown[0])
    close = difflib.get_close_matches(wrong, known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"{name}: unknown option {wrong}{hint}; {name} --help lists the options"


def schema_from_notebook(name_or_file: str, namespace: dict):
    """`--json-schema NAME_OR_FILE`: the notebook variable of that name (a dict or a pydantic model), else a file."""
    if name_or_file in namespace:
        return namespace[name_or_file]
    if Path(name_or_file).is_file():
        return Path(name_or_file)
    raise UsageError(
        f"--json-schema {name_or_file}: no variable {name_or_file!r} in the notebook and no such file; name a variable "
        "holding a dict or a pydantic model, or a .json file"
    )


def fill_prompt(body: str, namespace: dict) -> str:
    """`{name}` in the cell body becomes the value of `name` in the notebook (`{{` for a literal brace)."""
    formatter = string.Formatter()
    try:
        parsed = [field for _, field, _, _ in formatter.parse(body) if field is not None]
    except ValueError as error:
        raise UsageError(
            f"the prompt's braces do not parse ({error}): write {{{{ and }}}} for literal braces"
        ) from None
    for field in parsed:
        variable = re.split(r"[.\[]", field, maxsplit=1)[0]
        if not variable or variable.isdigit():
            raise UsageError(
                f"the prompt has {{{field}}}: name a notebook variable inside braces, or write {{{{ and }}}}"
            )
        if variable not in namespace:
            raise UsageError(
                f"the prompt names {{{field}}} but no variable {variable!r} exists: define it, or write "
                "{{ and }} for literal braces"
            )
        try:
            formatter.get_field(field, (), namespace)
        except (KeyError, IndexError, AttributeError, TypeError) as error:
            # KeyError's words are the key alone; the others' say what failed ("'int' object is not subscriptable")
            why = f"it has no key {error}" if isinstance(error, KeyError) else str(error)
            held = type(namespace[variable]).__name__
            raise UsageError(
                f"the prompt's {{{field}}} could not be filled from {variable} ({held}): {why} "
                f"({type(error).__name__}); write {{{{ and }}}} for literal braces"
            ) from None
    try:
        return formatter.vformat(body, (), namespace)
    except (ValueError, TypeError) as error:  # a bad format spec or conversion, e.g. {x:q}
        raise UsageError(f"the prompt's braces could not be filled ({error})") from None


@contextmanager
def usage_errors():
    """A bad value, no model loaded, a failed load or a failed job reads as a one-line UsageError."""
    try:
        yield
    except (ValueError, TypeError, FileNotFoundError, NotADirectoryError, NoModelLoaded, LoadFailed, JobError) as error:
        raise UsageError(str(error)) from None


def declared_arguments(options: tuple[Option, ...], groups: dict[str, str], **about):
    """A magic's arguments from declared options, grouped as declared, each with its help and default; `about`
    (`usage`, `description`) as IPython's `kwds` takes it."""

    def decorate(func):
        decorators = [kwds(**about)] if about else []
        decorators.append(help_argument)
        for group, words in groups.items():
            members = [o for o in options if o.group == group]
            if members:
                decorators += [argument_group(group, words), *map(option_argument, members)]
        for decorator in reversed(decorators):
            func = decorator(func)
        return magic_arguments()(func)

    return decorate


# `%%exl_generate`'s options, examples first; `%exl_load`'s
generation_arguments = declared_arguments(GENERATE_OPTIONS, GROUPS, usage=GENERATE_USAGE, description=GENERATE_EXAMPLES)
tree_arguments = declared_arguments(TREE_OPTIONS, TREE_HELP_GROUPS, usage=TREE_USAGE, description=TREE_EXAMPLES)
load_arguments = declared_arguments(declared(LoadOptions), LOAD_GROUPS)


def given_options(args: argparse.Namespace) -> dict:
    """The options a magic's line gave: every flag left out keeps the Python API's default."""
    return {name: value for name, value in vars(args).items() if value is not None}


_METAVARS = {int: "N", float: "X", str: "TEXT"}


def option_argument(o: Option):
    """The magic's argument for a declared option: its flag, help and default, read as its type says."""
    shown = "" if o.default is None or o.default == () or isinstance(o.default, bool) else f" (default: {o.default})"
    help_text = o.help + shown
    if o.positional:
        return argument(o.keyword, nargs="?", default=None, metavar=o.keyword.upper(), help=help_text)
    if o.parse:
        return argument(o.flag, dest=o.keyword, type=_read_by(o.parse), metavar=o.metavar, help=help_text)
    if o.choices:
        return argument(o.flag, dest=o.keyword, choices=o.choices, help=help_text)
    if o.scalar is bool:
        return argument(o.flag, dest=o.keyword, action="store_const", const=not o.default, help=help_text)
    if o.repeatable:  # one value per use
        return argument(o.flag, dest=o.keyword, action="append", type=escaped, metavar=o.metavar, help=help_text)
    kind = o.scalar or python_value  # anything richer is written as a Python literal
    return argument(
        o.flag, dest=o.keyword, type=kind, metavar=o.metavar or _METAVARS.get(kind, "LITERAL"), help=help_text
    )


def _read_by(parse):
    """A flag's reading as the magic does it: a value the declaration's `parse` refuses is a one-line UsageError
    (argparse would only say the value is invalid)."""

    def read(text: str):
        try:
            return parse(text)
        except ValueError as error:
            raise UsageError(str(error)) from None

    return read


# `--display` and `--out` as the magics that show or keep something take them, from `%%exl_generate`'s declarations
_DISPLAY, _OUT = (next(o for o in declared(CellOptions) if o.keyword == name) for name in ("display", "out"))
display_argument = argument(
    _DISPLAY.flag,
    choices=_DISPLAY.choices,
    default=_DISPLAY.default,
    help=f"{_DISPLAY.help} (default: {_DISPLAY.default})",
)


def out_argument(what: str):
    """`--out VAR`: store `what` in a notebook variable (read as `%%exl_generate`'s `--out` is)."""
    return option_argument(replace(_OUT, help=f"store {what}"))


def tidy_help(magic) -> None:
    """Help without IPython's `::` and with every default, for `%magic?` and `--help` alike."""
    magic.parser.formatter_class = _Help
    magic.__doc__ = magic.parser.format_help()
