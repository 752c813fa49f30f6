"""IPython magics: argument parsing, then one call into the Python API, nothing more.

`%%exl_generate`'s options are read from the options that `GenerationRequest`, `SamplerSettings` and
`CellOptions` declare (`exlnb.engines.declaration`), grouped as they declare them, so a new sampler setting is
an option (with its help and default) the moment it is a field. `%exl_load`'s options are `Session.load`'s
keywords by name. Every other option maps to a keyword of `show_cache` / `show_jobs`, `bench` or
`Session.cancel`. `%exl_generate?`, `%%exl_generate?` and `--help` print the help; a user's mistake is a
one-line `UsageError`.
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
from dataclasses import dataclass
from pathlib import Path

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import MagicHelpFormatter, argument, argument_group, kwds, magic_arguments, real_name

from exlnb.divergence import REFERENCE_DTYPES
from exlnb.engines.base import SamplerSettings
from exlnb.engines.declaration import GROUPS, Option, declared, option
from exlnb.engines.options import AUTO_SPLIT, CACHE_DTYPES, DISPLAY_HELP, DISPLAY_MODES, ENGINE_NAMES, GRAPH_MODES, SERVER_APIS
from exlnb.generation import Generation
from exlnb.loadtest import bench
from exlnb.models import BUNDLED_MODEL
from exlnb.quantize import DEFAULT_HEAD_BITS, QUANT_FORMATS, quantize
from exlnb.request import GenerationRequest
from exlnb.scoring import DEFAULT_TOKENS, divergence_from
from exlnb.session import LoadFailed, NoModelLoaded, get_session
from exlnb.streaming import GenerationResult, JobError
from exlnb.widgets.cache import show_jobs
from exlnb.widgets.loadtest import abench, shows_widget
from exlnb.widgets.server import show_cache_or_server
from exlnb.widgets.branches import BranchTree
from exlnb.widgets.stream import abranch_live, agenerate_live, branch_live, generate_live
from exlnb.workload import DEFAULT_REQUESTS, Workload, length_argument, rates_argument, slo_argument


@dataclass(frozen=True)
class CellOptions:
    """What `%%exl_generate` adds to a `GenerationRequest`: how the answer is shown and where it is kept."""

    display: str = option("auto", group="display", choices=DISPLAY_MODES, help=DISPLAY_HELP)
    background: bool = option(False, group="display", help="return at once; the widget keeps streaming")
    show_prompt: bool = option(False, group="display", help="show the exact tokens, special tokens highlighted")
    out: str | None = option(None, group="output", metavar="VAR",
                             help="store the result in this variable (a list for --n > 1; the running Generation "
                                  "with --background)")

    def __post_init__(self) -> None:
        if self.out is not None and (not self.out.isidentifier() or keyword.iskeyword(self.out)):
            raise ValueError(f"--out {self.out}: name a Python variable (letters, digits and _, not starting "
                             "with a digit, not a keyword)")


# every %%exl_generate option, as its declarations say
GENERATE_OPTIONS = (*declared(GenerationRequest), *declared(SamplerSettings), *declared(CellOptions))
SHOW_OPTIONS = tuple(o.keyword for o in declared(CellOptions))
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


class _ShowHelp(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="show this help and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(parser.format_help())
        raise _HelpShown


class _Help(MagicHelpFormatter):
    """IPython's magic help without the reStructuredText `::` before the usage line."""

    def add_usage(self, usage, actions, groups, prefix="%"):
        super().add_usage(usage, actions, groups, prefix)


def gpu_split(text: str) -> list[float] | str:
    """'20,24' -> [20.0, 24.0] (GiB per GPU); 'auto' -> 'auto' (the library fills the GPUs in turn)."""
    if text == AUTO_SPLIT:
        return AUTO_SPLIT
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"--gpu-split {text!r}: give {AUTO_SPLIT}, or GiB per GPU separated by commas, "
                         "e.g. 20,24") from None


def escaped(text: str) -> str:
    """Let `--stop "\\n\\n"` mean two newlines."""
    return text.replace("\\n", "\n").replace("\\t", "\t")


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


def _called_as(magic) -> str:
    name = real_name(magic)
    return f"%%{name}" if name == "exl_generate" else f"%{name}"


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
        raise UsageError(f"the prompt's braces do not parse ({error}): write {{{{ and }}}} for literal braces") from None
    for field in parsed:
        variable = re.split(r"[.\[]", field, maxsplit=1)[0]
        if not variable or variable.isdigit():
            raise UsageError(f"the prompt has {{{field}}}: name a notebook variable inside braces, or write {{{{ and }}}}")
        if variable not in namespace:
            raise UsageError(
                f"the prompt names {{{field}}} but no variable {variable!r} exists: define it, or write "
                "{{ and }} for literal braces"
            )
        try:
            formatter.get_field(field, (), namespace)
        except (KeyError, IndexError, AttributeError, TypeError) as error:
            raise UsageError(
                f"the prompt's {{{field}}} could not be filled: {variable!r} has no {error} "
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


def generation_arguments(func):
    """`%%exl_generate`'s options, grouped as declared, each with its help and default; examples first."""
    decorators = [kwds(usage=GENERATE_USAGE, description=GENERATE_EXAMPLES), argument("-h", "--help", action=_ShowHelp)]
    for group, about in GROUPS.items():
        members = [o for o in GENERATE_OPTIONS if o.group == group]
        if members:
            decorators += [argument_group(group, about), *map(option_argument, members)]
    for decorate in reversed(decorators):
        func = decorate(func)
    return magic_arguments()(func)


_METAVARS = {int: "N", float: "X", str: "TEXT"}


def option_argument(o: Option):
    """The magic's argument for a declared option: its flag, help and default, read as its type says."""
    shown = "" if o.default is None or o.default == () or isinstance(o.default, bool) else f" (default: {o.default})"
    help_text = o.help + shown
    if o.choices:
        return argument(o.flag, dest=o.keyword, choices=o.choices, help=help_text)
    if o.scalar is bool:
        return argument(o.flag, dest=o.keyword, action="store_const", const=not o.default, help=help_text)
    if o.repeatable:  # one value per use
        return argument(o.flag, dest=o.keyword, action="append", type=escaped, metavar=o.metavar, help=help_text)
    kind = o.scalar or python_value  # anything richer is written as a Python literal
    return argument(o.flag, dest=o.keyword, type=kind, metavar=o.metavar or _METAVARS.get(kind, "LITERAL"),
                    help=help_text)


def _tidy_help(magic) -> None:
    """Help without IPython's `::` and with every default, for `%magic?` and `--help` alike."""
    magic.parser.formatter_class = _Help
    magic.__doc__ = magic.parser.format_help()


# what IPython's magic transforms make of a %%exl_generate cell and of an %exl_bench line
_GENERATE_CALL = re.compile(r"^get_ipython\(\)\.run_cell_magic\('exl_generate', ")
_LINE_CALL = re.compile(r"^get_ipython\(\)\.run_line_magic\('(exl_bench|exl_branch)', ")
_AWAIT_MAGIC = "await get_ipython().magics_manager.registry['ExlnbMagics'].{}("


def await_magic_cells(lines: list[str]) -> list[str]:
    """IPython input transformer: a kernel runs a %%exl_generate cell, and a cell with an %exl_bench or
    %exl_branch line at its top level, as an async cell awaiting the magic.

    ipykernel (7.4) hands widget messages to their widgets while a cell awaits, not while it blocks: a cell
    blocked in a plain call would hear the Stop button only after its work had ended. An indented %exl_bench
    (or %exl_branch; perhaps inside a function, where `await` cannot go) stays a plain call.
    """
    if lines and _GENERATE_CALL.match(lines[0]):
        lines = [_GENERATE_CALL.sub(_AWAIT_MAGIC.format("exl_generate_async"), lines[0], count=1), *lines[1:]]
    return [_LINE_CALL.sub(lambda m: _AWAIT_MAGIC.format(f"{m[1]}_async"), line, count=1) for line in lines]


@magics_class
class ExlnbMagics(Magics):
    cell_id: str | None = None  # the cell running now, as the front end names it

    def remember_cell(self, info) -> None:
        """pre_run_cell hook: a re-run cell cancels what it started before."""
        self.cell_id = getattr(info, "cell_id", None)

    @magic_arguments()
    @argument("model", nargs="?", default=BUNDLED_MODEL,
              help=f'a model folder (HF fp16; EXL2 on the exllamav2 engine) or "{BUNDLED_MODEL}" (default)')
    @argument("--engine", choices=ENGINE_NAMES, default="auto",
              help="auto: exllamav2 where CUDA is available, cpu otherwise (default: auto)")
    @argument("--cache-tokens", type=int, help="KV cache size in tokens (default: the engine's, 8192)")
    @argument("--cache", choices=CACHE_DTYPES, default="fp16", help="KV cache precision, exllamav2 (default: fp16)")
    @argument("--max-batch-size", type=int, help="most jobs decoded together (default: 16)")
    @argument("--gpu-split", type=gpu_split,
              help="auto (fill the GPUs in turn), or GiB per GPU, comma separated, e.g. 20,24; 0 leaves a GPU out "
                   "(exllamav2, exllamav3)")
    @argument("--tensor-parallel", action="store_true",
              help="split every layer over the GPUs instead of placing whole layers (exllamav2, exllamav3; 2+ GPUs)")
    @argument("--graphs", choices=GRAPH_MODES, default="auto",
              help="CUDA-graph decode, exllamav2: auto uses it where its load check passes (default: auto)")
    @argument("--url", help="an OpenAI-compatible server's API base, e.g. http://127.0.0.1:8000/v1 (openai engine); "
              "the model argument then names the same model's local folder, for its tokenizer and template")
    @argument("--served-model", metavar="NAME", help="the server's name for the model (default: the one it serves)")
    @argument("--api-key-env", metavar="VAR", help="environment variable holding the server's API key")
    @argument("--api", choices=SERVER_APIS, default="chat",
              help="chat: the server's chat template; completions: exlnb's templates (default: chat)")
    @argument("--reload", action="store_true",
              help="load again even if the same model is loaded; replace a model while jobs run (they end)")
    @argument("-h", "--help", action=_ShowHelp)
    @line_magic
    def exl_load(self, line: str) -> None:
        """Load a model into the kernel's session; the same arguments again do nothing."""
        if (args := parse_options(self.exl_load, line)) is None:
            return
        session = get_session()
        before = session.options
        with usage_errors():
            status = session.load(**vars(args))  # each option's dest is a keyword of Session.load
        if before is not None and session.options != before:
            print(f"replaced {before.model_dir.name} ({before.engine} engine)")
        print(status.line())
        for note in status.notes:
            print(note)

    @generation_arguments
    @line_cell_magic
    @no_var_expand  # options are literal, as in a kernel's async cell: IPython would make --regex 'a{2,9}' a(2, 9)
    def exl_generate(self, line: str, cell: str | None = None) -> None:
        """Generate from the cell body as the user's turn; `{name}` is filled from the notebook's variables."""
        args, request, show = self._generate_call(line, cell)
        if args is None:
            return
        with usage_errors():
            generation = generate_live(request, **show)
        self._store(args, generation)

    async def exl_generate_async(self, line: str, cell: str) -> None:
        """`%%exl_generate` as a kernel runs it (see `await_generate_cells`): the cell awaits, so the Stop
        button is heard while it runs."""
        args, request, show = self._generate_call(line, cell)
        if args is None:
            return
        with usage_errors():
            generation = await agenerate_live(request, **show)
        self._store(args, generation)

    def _generate_call(self, line: str, cell: str | None) -> tuple:
        if (args := parse_options(self.exl_generate, line)) is None:
            return None, None, None
        if cell is None:
            raise UsageError("%%exl_generate is a cell magic: options on the first line, the prompt in the cell "
                             "below (see %exl_generate? for the options)")
        given = {k: v for k, v in vars(args).items() if v is not None}
        if "json_schema" in given:
            given["json_schema"] = schema_from_notebook(given["json_schema"], self.shell.user_ns)
        with usage_errors():
            cell_options = CellOptions(**{k: given.pop(k) for k in SHOW_OPTIONS if k in given})
            request = GenerationRequest.build(fill_prompt(cell.strip(), self.shell.user_ns), **given)
        show = dict(background=cell_options.background, show_prompt=cell_options.show_prompt,
                    display=cell_options.display, owner=self.cell_id)
        return cell_options, request, show

    def _store(self, args: CellOptions, generation: Generation) -> None:
        if args.out:
            results = None if args.background else generation.results
            one = len(generation.samples) == 1
            self.shell.user_ns[args.out] = generation if results is None else results[0] if one else results

    @magic_arguments()
    @argument("result", metavar="RESULT_VAR",
              help="a notebook variable (or expression, answers[1]) holding a result: %%%%exl_generate's --out, "
                   "or a branch's")
    @argument("--at", type=int, required=True, metavar="K",
              help="the position (0 for the first answer token) to branch at")
    @argument("--token", type=escaped, metavar="TEXT",
              help="the text of the one token forced at K (default: the likeliest alternative the token view "
                   "recorded there)")
    @argument("--token-id", type=int, metavar="N", help="the id of the token forced at K, instead of --token")
    @argument("--display", choices=DISPLAY_MODES, default="auto", help=DISPLAY_HELP)
    @argument("--out", metavar="VAR", help="store the branch's result (branch it again with %%exl_branch VAR)")
    @argument("-h", "--help", action=_ShowHelp)
    @line_magic
    def exl_branch(self, line: str) -> None:
        """Run a result again from token K with another token forced there, show it as it streams, then the tree."""
        if (call := self._branch_call(line)) is None:
            return
        args, result, token = call
        with usage_errors():
            branched = branch_live(result, at=args.at, token=token, display=args.display, owner=self.cell_id)
        self._show_branch(args, branched)

    async def exl_branch_async(self, line: str) -> None:
        """`%exl_branch` as a kernel runs it (see `await_magic_cells`): the cell awaits, so Stop is heard."""
        if (call := self._branch_call(line)) is None:
            return
        args, result, token = call
        with usage_errors():
            branched = await abranch_live(result, at=args.at, token=token, display=args.display, owner=self.cell_id)
        self._show_branch(args, branched)

    def _branch_call(self, line: str) -> tuple | None:
        if (args := parse_options(self.exl_branch, line)) is None:
            return None
        if args.token is not None and args.token_id is not None:
            raise UsageError("give the forced token as --token TEXT or --token-id N, not both")
        try:  # a name, or an expression such as answers[1] (--n 4 stores a list)
            result = self.shell.ev(args.result)
        except Exception as error:
            raise UsageError(f"{args.result} does not name a result in the notebook ({type(error).__name__}: "
                             f"{error}): give the --out of an %%exl_generate, e.g. answer, or answers[1]") from None
        if not isinstance(result, GenerationResult):
            raise UsageError(f"{args.result} is a {type(result).__name__}, not a result: give the --out of an "
                             "%%exl_generate, e.g. answer, or answers[1] for one of several samples")
        return args, result, args.token_id if args.token_id is not None else args.token

    def _show_branch(self, args, branched) -> None:
        if args.out:
            self.shell.user_ns[args.out] = branched
        BranchTree.of(branched).show()

    @magic_arguments()
    @argument("--display", choices=DISPLAY_MODES, default="auto", help=DISPLAY_HELP)
    @argument("-h", "--help", action=_ShowHelp)
    @line_magic
    def exl_cache(self, line: str) -> None:
        """The cache inspector: pages coloured by owner job, shared pages outlined, free pages, totals; for a model
        behind a server (openai engine), the server view: its queue and KV-cache use, and this kernel's jobs."""
        if (args := parse_options(self.exl_cache, line)) is None:
            return
        with usage_errors():
            show_cache_or_server(display=args.display)

    @magic_arguments()
    @argument("--display", choices=DISPLAY_MODES, default="auto", help=DISPLAY_HELP)
    @argument("-h", "--help", action=_ShowHelp)
    @line_magic
    def exl_jobs(self, line: str) -> None:
        """Pending and active jobs, with Cancel buttons; a job whose answer nobody is reading is marked."""
        if (args := parse_options(self.exl_jobs, line)) is None:
            return
        with usage_errors():
            show_jobs(display=args.display)

    @magic_arguments()
    @argument("job_ids", nargs="*", type=int, help="jobs to cancel (ids from %%exl_jobs)")
    @argument("--all", action="store_true", help="cancel every pending and active job")
    @argument("-h", "--help", action=_ShowHelp)
    @line_magic
    def exl_cancel(self, line: str) -> None:
        """Cancel jobs by id, or all of them; their cache pages are free when this returns."""
        if (args := parse_options(self.exl_cancel, line)) is None:
            return
        if not args.job_ids and not args.all:
            raise UsageError("name the jobs to cancel (see %exl_jobs), or pass --all")
        session = get_session()
        if args.all:
            count = session.cancel_all()
            print(f"cancelled {count} job{'' if count == 1 else 's'}")
        for job_id in args.job_ids:
            print(f"job {job_id}: {'cancelled' if session.cancel(job_id) else 'not running'}")

    @magic_arguments()
    @argument("model", nargs="?", default=BUNDLED_MODEL,
              help=f'an unquantized model folder, a hub repo id, or "{BUNDLED_MODEL}" (default)')
    @argument("--format", choices=QUANT_FORMATS, default="exl3", help="exl3 (exllamav3) or exl2 (exllamav2)")
    @argument("--bits", type=float, default=4.0, help="bits per weight (EXL3 1-8, EXL2 2-8)")
    @argument("--head-bits", type=int, help=f"bits per weight of the output layer (default {DEFAULT_HEAD_BITS})")
    @argument("-h", "--help", action=_ShowHelp)
    @line_magic
    def exl_quantize(self, line: str) -> None:
        """Quantize with the library's own converter (cached, resumable) and print the folder to %exl_load."""
        if (args := parse_options(self.exl_quantize, line)) is None:
            return
        try:
            folder = quantize(args.model, format=args.format, bits=args.bits, head_bits=args.head_bits)
        except (ValueError, OSError, RuntimeError) as error:  # OSError: a file, or a folder it may not read
            raise UsageError(str(error)) from None
        print(folder)

    @magic_arguments()
    @argument("reference", help='the reference: a model folder (or "smollm2-135m-instruct"), or a .pt file of '
                                "reference logits that exlnb kept")
    @argument("--tokens", type=int, default=DEFAULT_TOKENS,
              help=f"length of the fixed text scored, for a reference folder (default {DEFAULT_TOKENS})")
    @argument("--engine", choices=ENGINE_NAMES, default="auto",
              help="the engine that computes the reference's logits when they are not cached (default: auto)")
    @argument("--dtype", choices=tuple(REFERENCE_DTYPES), default="float32",
              help="how the reference's logits are kept on disk (default: float32)")
    @argument("--no-noise-floor", action="store_true", help="leave out the fp16 noise floor")
    @argument("--out", metavar="VAR", help="store the Divergence")
    @argument("-h", "--help", action=_ShowHelp)
    @line_magic
    def exl_divergence(self, line: str) -> None:
        """Score the loaded model against a reference (KL per position, top-1 agreement, perplexities) and print
        the table; the reference's logits are computed once and cached on disk."""
        if (args := parse_options(self.exl_divergence, line)) is None:
            return
        with usage_errors():
            result = divergence_from(get_session(), args.reference, tokens=args.tokens, engine=args.engine,
                                     dtype=args.dtype, noise_floor=not args.no_noise_floor)
        print(result.table())
        if args.out:
            self.shell.user_ns[args.out] = result

    @magic_arguments()
    @argument("--request-rate", type=rates_argument, default=list(Workload.request_rates), metavar="RATES",
              help="requests per second, comma separated to sweep, inf for all at once (default inf)")
    @argument("--burstiness", type=float, default=Workload.burstiness,
              help="gamma shape of the arrival gaps; 1 is Poisson")
    @argument("--max-concurrency", type=int, metavar="N", help="most requests in flight (default: no limit)")
    @argument("--prompt-len", type=length_argument, default=Workload.prompt_len, metavar="TOKENS",
              help=f"prompt tokens, or a range such as 64-256 (default {Workload.prompt_len})")
    @argument("--output-len", type=length_argument, default=Workload.output_len, metavar="TOKENS",
              help=f"exact output tokens, or a range such as 8-64 (default {Workload.output_len})")
    @argument("--dataset", metavar="NAME", help="prompts from data/prompts/NAME.json instead of random tokens")
    @argument("--num-requests", type=int, metavar="N", help=f"requests per rate (default {DEFAULT_REQUESTS})")
    @argument("--duration", type=float, metavar="SECONDS", help="send for this long instead of --num-requests")
    @argument("--seed", type=int, default=Workload.seed, help="the same seed sends the same requests at the same times")
    @argument("--slo", action="append", type=slo_argument, default=[], metavar="NAME=MS",
              help="goodput objective, repeatable: ttft_ms=500, tpot_ms=50, e2el_ms=2000")
    @argument("--no-progress", action="store_true", help="nothing shown while it runs (no bar, no Stop button)")
    @argument("--display", choices=DISPLAY_MODES, default="auto",
              help=f"{DISPLAY_HELP}; the widget has a Stop button (default: auto)")
    @argument("--out", metavar="VAR", help="store the BenchResult (requests, summary, figure())")
    @argument("-h", "--help", action=_ShowHelp)
    @line_magic
    def exl_bench(self, line: str) -> None:
        """Load-test the loaded model as vLLM's benchmark_serving does and print its summary table."""
        if (call := self._bench_call(line)) is None:
            return
        args, options = call
        with usage_errors():
            result = bench(**options, progress=not args.no_progress)
        self._show_bench(args, result)

    async def exl_bench_async(self, line: str) -> None:
        """`%exl_bench` as a kernel runs it (see `await_magic_cells`): the cell awaits, so the Stop button is
        heard, and an interrupt stops the test with every job of it ended."""
        if (call := self._bench_call(line)) is None:
            return
        args, options = call
        with usage_errors():
            result = await abench(**options, display=args.display, progress=not args.no_progress)
        self._show_bench(args, result, printed=not shows_widget(args.display, not args.no_progress))

    def _bench_call(self, line: str) -> tuple | None:
        if (args := parse_options(self.exl_bench, line)) is None:
            return None
        options = dict(
            request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
            prompt_len=args.prompt_len, output_len=args.output_len, dataset=args.dataset,
            num_requests=args.num_requests, duration_s=args.duration, seed=args.seed, slos=dict(args.slo) or None,
        )
        return args, options

    def _show_bench(self, args, result, printed: bool = True) -> None:
        """vLLM's printout, unless the live view showed the results (its record holds them, the printout folded)."""
        if printed:
            print(result.table())
        if args.out:
            self.shell.user_ns[args.out] = result


for _magic in (ExlnbMagics.exl_load, ExlnbMagics.exl_generate, ExlnbMagics.exl_branch, ExlnbMagics.exl_cache,
               ExlnbMagics.exl_jobs, ExlnbMagics.exl_cancel, ExlnbMagics.exl_quantize, ExlnbMagics.exl_bench,
               ExlnbMagics.exl_divergence):
    _tidy_help(_magic)
