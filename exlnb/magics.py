"""IPython magics: argument parsing, then one call into the Python API, nothing more.

Every option maps to a keyword of `Session.load`, `exlnb.widgets.stream.generate_live`,
`exlnb.widgets.cache.show_cache` / `show_jobs` or `Session.cancel`; `%exl_generate?` prints the help.
"""

from __future__ import annotations

import re
import shlex
import string
from contextlib import contextmanager

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from exlnb.loadtest import bench
from exlnb.generation import Generation
from exlnb.models import BUNDLED_MODEL
from exlnb.session import NoModelLoaded, get_session
from exlnb.templates import TEMPLATES
from exlnb.widgets.cache import show_cache, show_jobs
from exlnb.widgets.stream import agenerate_live, generate_live
from exlnb.workload import DEFAULT_REQUESTS, Workload, length_argument, rates_argument, slo_argument

# option name -> the SamplerSettings field it sets (exllamav2's names)
SAMPLER_OPTIONS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "rep_penalty": "token_repetition_penalty",
    "freq_penalty": "token_frequency_penalty",
    "presence_penalty": "token_presence_penalty",
}
DISPLAY_HELP = "auto: a widget where the front end renders widgets, plain text otherwise (papermill, terminal)"


def gpu_split(text: str) -> list[float]:
    """'20,24' -> [20.0, 24.0] (GiB per GPU)."""
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"--gpu-split {text!r}: give GiB per GPU separated by commas, e.g. 20,24") from None


def parse_options(magic, line: str):
    """The magic's options, split like a shell line: IPython's own `parse_argstring` keeps the quotes, so
    `--system "Be brief."` would reach the model with its quote marks."""
    try:
        argv = shlex.split(line)
    except ValueError as error:
        raise UsageError(f"the options do not parse ({error}): {line}") from None
    return magic.parser.parse_args(argv)


def escaped(text: str) -> str:
    """Let `--stop "\\n\\n"` mean two newlines."""
    return text.replace("\\n", "\n").replace("\\t", "\t")


def fill_prompt(body: str, namespace: dict) -> str:
    """`{name}` in the cell body becomes the value of `name` in the notebook (`{{` for a literal brace)."""
    try:
        return string.Formatter().vformat(body, (), namespace)
    except KeyError as error:
        raise UsageError(
            f"the prompt names {{{error.args[0]}}} but no variable {error.args[0]!r} exists: define it, or write "
            "{{ and }} for literal braces"
        ) from None
    except (IndexError, ValueError, AttributeError) as error:
        raise UsageError(f"the prompt's braces do not parse ({error}): write {{{{ and }}}} for literal braces") from None


@contextmanager
def _usage_errors():
    """A bad option value or no model loaded reads as a one-line UsageError, not a traceback."""
    try:
        yield
    except (ValueError, NoModelLoaded) as error:
        raise UsageError(str(error)) from None


# what IPython's cell-magic transform makes of a %%exl_generate cell
_GENERATE_CALL = re.compile(r"^get_ipython\(\)\.run_cell_magic\('exl_generate', ")


def await_generate_cells(lines: list[str]) -> list[str]:
    """IPython input transformer: a kernel runs a %%exl_generate cell as an async cell awaiting the magic.

    ipykernel (7.4) hands widget messages to their widgets while a cell awaits, not while it blocks: a cell
    blocked in a plain call would hear the Stop button only after its job had ended.
    """
    if lines and _GENERATE_CALL.match(lines[0]):
        call = _GENERATE_CALL.sub("", lines[0], count=1)
        lines = [f"await get_ipython().magics_manager.registry['ExlnbMagics'].exl_generate_async({call}", *lines[1:]]
    return lines


@magics_class
class ExlnbMagics(Magics):
    cell_id: str | None = None  # the cell running now, as the front end names it

    def remember_cell(self, info) -> None:
        """pre_run_cell hook: a re-run cell cancels what it started before."""
        self.cell_id = getattr(info, "cell_id", None)

    @magic_arguments()
    @argument("model", nargs="?", default=BUNDLED_MODEL,
              help=f'a model folder (HF fp16; EXL2 on the exllamav2 engine) or "{BUNDLED_MODEL}" (default)')
    @argument("--engine", choices=("auto", "exllamav2", "cpu"), default="auto",
              help="auto: exllamav2 where CUDA is available, cpu otherwise")
    @argument("--cache-tokens", type=int, help="KV cache size in tokens (default: the engine's)")
    @argument("--cache", choices=("fp16", "q4", "q6", "q8"), default="fp16", help="KV cache precision (exllamav2)")
    @argument("--max-batch-size", type=int, help="most jobs decoded together")
    @argument("--gpu-split", type=gpu_split, help="GiB per GPU, comma separated, e.g. 20,24 (exllamav2)")
    @argument("--reload", action="store_true", help="load again even if the same model is loaded")
    @line_magic
    def exl_load(self, line: str) -> None:
        """Load a model into the kernel's session; the same arguments again do nothing."""
        args = parse_options(self.exl_load, line)
        try:
            status = get_session().load(
                args.model, engine=args.engine, cache_tokens=args.cache_tokens, cache=args.cache,
                max_batch_size=args.max_batch_size, gpu_split=args.gpu_split, reload=args.reload,
            )
        except (ValueError, FileNotFoundError) as error:
            raise UsageError(str(error)) from None
        print(status.line())
        for note in status.notes:
            print(note)

    @magic_arguments()
    @argument("--system", help="system prompt")
    @argument("--template", choices=TEMPLATES, default="auto", help="prompt format; auto: the model's own chat template")
    @argument("--max-new-tokens", type=int, default=256)
    @argument("--temperature", type=float, help="0 is greedy (exllamav2 default 0.8)")
    @argument("--top-k", type=int, help="0 disables (default 50)")
    @argument("--top-p", type=float, help="1 disables (default 0.8)")
    @argument("--min-p", type=float, help="0 disables (default 0)")
    @argument("--rep-penalty", type=float, help="token_repetition_penalty (exllamav2 default 1.025)")
    @argument("--freq-penalty", type=float, help="token_frequency_penalty (default 0)")
    @argument("--presence-penalty", type=float, help="token_presence_penalty (default 0)")
    @argument("--seed", type=int, help="sample i uses seed + i")
    @argument("--stop", action="append", default=[], type=escaped,
              help=r'stop string or special token, repeatable ("\n" for a newline)')
    @argument("--n", type=int, default=1, help="samples run concurrently, shown side by side")
    @argument("--chat", metavar="NAME", help="keep this conversation's turns in the session and answer after them")
    @argument("--amnesia", action="store_true", help="forget the chat's earlier turns before this one")
    @argument("--out", metavar="VAR", help="store the result (a list for --n > 1; the running Generation with --background)")
    @argument("--background", action="store_true", help="return at once; the widget keeps streaming")
    @argument("--loop-guard", action="store_true", help="cancel a sample caught in a repetition loop")
    @argument("--show-prompt", action="store_true", help="show the exact tokens, special tokens highlighted")
    @argument("--display", choices=("auto", "widget", "text"), default="auto", help=DISPLAY_HELP)
    @cell_magic
    def exl_generate(self, line: str, cell: str) -> None:
        """Generate from the cell body as the user's turn; `{name}` is filled from the notebook's variables."""
        args, prompt, options = self._generate_call(line, cell)
        with _usage_errors():
            generation = generate_live(prompt, **options)
        self._store(args, generation)

    async def exl_generate_async(self, line: str, cell: str) -> None:
        """`%%exl_generate` as a kernel runs it (see `await_generate_cells`): the cell awaits, so the Stop
        button is heard while it runs."""
        args, prompt, options = self._generate_call(line, cell)
        with _usage_errors():
            generation = await agenerate_live(prompt, **options)
        self._store(args, generation)

    def _generate_call(self, line: str, cell: str) -> tuple:
        args = parse_options(self.exl_generate, line)
        prompt = fill_prompt(cell.strip(), self.shell.user_ns)
        sampler = {field: getattr(args, option) for option, field in SAMPLER_OPTIONS.items()
                   if getattr(args, option) is not None}
        options = dict(
            system=args.system, template=args.template, max_new_tokens=args.max_new_tokens, stop=args.stop,
            n=args.n, seed=args.seed, chat=args.chat, amnesia=args.amnesia, background=args.background,
            loop_guard=args.loop_guard, show_prompt=args.show_prompt, display=args.display, owner=self.cell_id,
            **sampler,
        )
        return args, prompt, options

    def _store(self, args, generation: Generation) -> None:
        if args.out:
            results = None if args.background else generation.results
            self.shell.user_ns[args.out] = generation if results is None else results[0] if args.n == 1 else results

    @magic_arguments()
    @argument("--display", choices=("auto", "widget", "text"), default="auto", help=DISPLAY_HELP)
    @line_magic
    def exl_cache(self, line: str) -> None:
        """The cache inspector: pages coloured by owner job, shared pages outlined, free pages, totals."""
        args = parse_options(self.exl_cache, line)
        show_cache(display=args.display)

    @magic_arguments()
    @argument("--display", choices=("auto", "widget", "text"), default="auto", help=DISPLAY_HELP)
    @line_magic
    def exl_jobs(self, line: str) -> None:
        """Pending and active jobs, whether their streams are read, with Cancel buttons."""
        args = parse_options(self.exl_jobs, line)
        show_jobs(display=args.display)

    @magic_arguments()
    @argument("job_ids", nargs="*", type=int, help="jobs to cancel (ids from %%exl_jobs)")
    @argument("--all", action="store_true", help="cancel every pending and active job")
    @line_magic
    def exl_cancel(self, line: str) -> None:
        """Cancel jobs by id, or all of them; their cache pages are free when this returns."""
        args = parse_options(self.exl_cancel, line)
        if not args.job_ids and not args.all:
            raise UsageError("name the jobs to cancel (see %exl_jobs), or pass --all")
        session = get_session()
        if args.all:
            print(f"cancelled {session.cancel_all()} jobs")
        for job_id in args.job_ids:
            print(f"job {job_id}: {'cancelled' if session.cancel(job_id) else 'not running'}")

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
    @argument("--no-progress", action="store_true", help="no progress bar")
    @argument("--out", metavar="VAR", help="store the BenchResult (requests, summary, figure())")
    @line_magic
    def exl_bench(self, line: str) -> None:
        """Load-test the loaded model as vLLM's benchmark_serving does and print its summary table."""
        args = parse_options(self.exl_bench, line)
        with _usage_errors():
            result = bench(
                args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                prompt_len=args.prompt_len, output_len=args.output_len, dataset=args.dataset,
                num_requests=args.num_requests, duration_s=args.duration, seed=args.seed,
                slos=dict(args.slo) or None, progress=not args.no_progress,
            )
        print(result.table())
        if args.out:
            self.shell.user_ns[args.out] = result
