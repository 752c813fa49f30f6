"""IPython magics: argument parsing, then one call into the Python API, nothing more.

`%%exl_generate`'s options are generated from `GenerationRequest` and `SamplerSettings`, so a new sampler
setting is an option (with its help and default) the moment it is a field. Every other option maps to a
keyword of `Session.load`, `generate_live`, `show_cache` / `show_jobs` or `Session.cancel`. `%exl_generate?`,
`%%exl_generate?` and `--help` print the help; a user's mistake is a one-line `UsageError`.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import shlex
import string
import typing
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import MagicHelpFormatter, argument, magic_arguments, real_name

from exlnb.engines.base import SamplerSettings
from exlnb.engines.options import CACHE_DTYPES, DISPLAY_HELP, DISPLAY_MODES, ENGINE_NAMES, GRAPH_MODES, TOKEN_COLOURS
from exlnb.generation import Generation
from exlnb.loadtest import bench
from exlnb.models import BUNDLED_MODEL
from exlnb.quantize import DEFAULT_HEAD_BITS, QUANT_FORMATS, quantize
from exlnb.request import REQUEST_HELP, GenerationRequest
from exlnb.session import LoadFailed, NoModelLoaded, get_session
from exlnb.streaming import JobError
from exlnb.templates import TEMPLATES
from exlnb.widgets.cache import show_cache, show_jobs
from exlnb.widgets.loadtest import abench
from exlnb.widgets.stream import agenerate_live, generate_live
from exlnb.workload import DEFAULT_REQUESTS, Workload, length_argument, rates_argument, slo_argument

# %%exl_generate options that say how to show the answer, not what to generate
SHOW_OPTIONS = ("out", "background", "show_prompt", "display")


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


def gpu_split(text: str) -> list[float]:
    """'20,24' -> [20.0, 24.0] (GiB per GPU)."""
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"--gpu-split {text!r}: give GiB per GPU separated by commas, e.g. 20,24") from None


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
        raise UsageError(_unknown_options(unknown, parser, real_name(magic)))
    return args


def _unknown_options(unknown: list[str], parser: argparse.ArgumentParser, name: str) -> str:
    known = sorted(s for action in parser._actions for s in action.option_strings if s.startswith("--"))
    wrong = next((u for u in unknown if u.startswith("-")), unknown[0])
    close = difflib.get_close_matches(wrong, known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"%{name}: unknown option {wrong}{hint}; the options are {' '.join(known)}"


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
    """`%%exl_generate`'s options, one per `GenerationRequest` field and sampler setting, with help and defaults."""
    defaults = GenerationRequest(prompt="")
    declared = [_request_argument(f, getattr(defaults, f.name)) for f in fields(GenerationRequest)
                if f.name not in ("prompt", "sampler")]
    declared += [_sampler_argument(f) for f in fields(SamplerSettings)]
    declared += [
        argument("--out", metavar="VAR",
                 help="store the result (a list for --n > 1; the running Generation with --background)"),
        argument("--background", action="store_true", help="return at once; the widget keeps streaming"),
        argument("--show-prompt", action="store_true", help="show the exact tokens, special tokens highlighted"),
        argument("--display", choices=DISPLAY_MODES, default="auto", help=DISPLAY_HELP),
        argument("-h", "--help", action=_ShowHelp),
    ]
    for decorate in reversed(declared):
        func = decorate(func)
    return magic_arguments()(func)


CHOICES = {"template": TEMPLATES, "token_colour": TOKEN_COLOURS}  # request fields with a fixed set of values
TEXT_METAVARS = {"json_schema": "NAME_OR_FILE", "regex": "PATTERN"}  # request fields given as text, read as such


def _request_argument(f, default):
    flag, help_text = "--" + f.name.replace("_", "-"), REQUEST_HELP[f.name]
    if f.name in CHOICES:
        return argument(flag, choices=CHOICES[f.name], default=default, help=f"{help_text} (default: {default})")
    if f.name in ("stop", "banned_strings"):  # repeatable: one value per use
        flag = {"stop": "--stop", "banned_strings": "--ban"}[f.name]
        return argument(flag, dest=f.name, action="append", default=[], type=escaped, metavar="TEXT", help=help_text)
    if isinstance(default, bool):
        return argument(flag, action="store_true", help=help_text)
    if f.name in TEXT_METAVARS:
        return argument(flag, metavar=TEXT_METAVARS[f.name], help=help_text)
    kind = _scalar_type(typing.get_type_hints(GenerationRequest)[f.name])
    shown = f" (default: {default})" if default is not None else ""
    return argument(flag, type=kind, default=default, metavar=_METAVARS.get(kind, "VALUE"), help=help_text + shown)


def _sampler_argument(f):
    option = f.metadata.get("option", f.name)
    flag = "--" + option.replace("_", "-")
    help_text = f"{f.metadata.get('help', f.name)} (default: {f.default})"
    hint = typing.get_type_hints(SamplerSettings)[f.name]
    if hint is bool:
        return argument(flag, dest=option, action="store_const", const=not f.default, help=help_text)
    kind = _scalar_type(hint)
    return argument(flag, dest=option, type=kind, metavar=_METAVARS.get(kind, "VALUE"), help=help_text)


_METAVARS = {int: "N", float: "X", str: "TEXT"}


def _scalar_type(hint):
    """The argparse type for a field: int, float, str, or a Python literal for anything richer."""
    arms = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return arms[0] if len(arms) == 1 and arms[0] in (int, float, str) else python_value


def _tidy_help(magic) -> None:
    """Help without IPython's `::` and with every default, for `%magic?` and `--help` alike."""
    magic.parser.formatter_class = _Help
    magic.__doc__ = magic.parser.format_help()


# what IPython's magic transforms make of a %%exl_generate cell and of an %exl_bench line
_GENERATE_CALL = re.compile(r"^get_ipython\(\)\.run_cell_magic\('exl_generate', ")
_BENCH_CALL = re.compile(r"^get_ipython\(\)\.run_line_magic\('exl_bench', ")
_AWAIT_MAGIC = "await get_ipython().magics_manager.registry['ExlnbMagics'].{}("


def await_magic_cells(lines: list[str]) -> list[str]:
    """IPython input transformer: a kernel runs a %%exl_generate cell, and a cell with an %exl_bench line at
    its top level, as an async cell awaiting the magic.

    ipykernel (7.4) hands widget messages to their widgets while a cell awaits, not while it blocks: a cell
    blocked in a plain call would hear the Stop button only after its work had ended. An indented %exl_bench
    (perhaps inside a function, where `await` cannot go) stays a plain call.
    """
    if lines and _GENERATE_CALL.match(lines[0]):
        lines = [_GENERATE_CALL.sub(_AWAIT_MAGIC.format("exl_generate_async"), lines[0], count=1), *lines[1:]]
    return [_BENCH_CALL.sub(_AWAIT_MAGIC.format("exl_bench_async"), line, count=1) for line in lines]


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
              help="GiB per GPU, comma separated, e.g. 20,24; 0 leaves a GPU out (exllamav2, exllamav3)")
    @argument("--tensor-parallel", action="store_true",
              help="split every layer over the GPUs instead of placing whole layers (exllamav2, exllamav3; 2+ GPUs)")
    @argument("--graphs", choices=GRAPH_MODES, default="auto",
              help="CUDA-graph decode, exllamav2: auto uses it where its load check passes (default: auto)")
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
            status = session.load(
                args.model, engine=args.engine, cache_tokens=args.cache_tokens, cache=args.cache,
                max_batch_size=args.max_batch_size, gpu_split=args.gpu_split, graphs=args.graphs,
                tensor_parallel=args.tensor_parallel, reload=args.reload,
            )
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
        values = {k: v for k, v in vars(args).items() if v is not None and k not in SHOW_OPTIONS}
        if "json_schema" in values:
            values["json_schema"] = schema_from_notebook(values["json_schema"], self.shell.user_ns)
        with usage_errors():
            request = GenerationRequest.build(fill_prompt(cell.strip(), self.shell.user_ns), **values)
        show = dict(background=args.background, show_prompt=args.show_prompt, display=args.display,
                    owner=self.cell_id)
        return args, request, show

    def _store(self, args, generation: Generation) -> None:
        if args.out:
            results = None if args.background else generation.results
            one = len(generation.samples) == 1
            self.shell.user_ns[args.out] = generation if results is None else results[0] if one else results

    @magic_arguments()
    @argument("--display", choices=DISPLAY_MODES, default="auto", help=DISPLAY_HELP)
    @argument("-h", "--help", action=_ShowHelp)
    @line_magic
    def exl_cache(self, line: str) -> None:
        """The cache inspector: pages coloured by owner job, shared pages outlined, free pages, totals."""
        if (args := parse_options(self.exl_cache, line)) is None:
            return
        with usage_errors():
            show_cache(display=args.display)

    @magic_arguments()
    @argument("--display", choices=DISPLAY_MODES, default="auto", help=DISPLAY_HELP)
    @argument("-h", "--help", action=_ShowHelp)
    @line_magic
    def exl_jobs(self, line: str) -> None:
        """Pending and active jobs, whether their streams are read, with Cancel buttons."""
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
        except (ValueError, FileNotFoundError, RuntimeError) as error:
            raise UsageError(str(error)) from None
        print(folder)

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
        self._show_bench(args, result)

    def _bench_call(self, line: str) -> tuple | None:
        if (args := parse_options(self.exl_bench, line)) is None:
            return None
        options = dict(
            request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
            prompt_len=args.prompt_len, output_len=args.output_len, dataset=args.dataset,
            num_requests=args.num_requests, duration_s=args.duration, seed=args.seed, slos=dict(args.slo) or None,
        )
        return args, options

    def _show_bench(self, args, result) -> None:
        print(result.table())
        if args.out:
            self.shell.user_ns[args.out] = result


for _magic in (ExlnbMagics.exl_load, ExlnbMagics.exl_generate, ExlnbMagics.exl_cache, ExlnbMagics.exl_jobs,
               ExlnbMagics.exl_cancel, ExlnbMagics.exl_quantize, ExlnbMagics.exl_bench):
    _tidy_help(_magic)
