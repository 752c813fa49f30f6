"""IPython magics: argument parsing, then one call into the Python API, nothing more.

`%%exl_generate`'s options are read from the options that `GenerationRequest`, `SamplerSettings` and
`CellOptions` declare (`exlnb.engines.declaration`), grouped as they declare them, so a new sampler setting is
an option (with its help and default) the moment it is a field; `%exl_load`'s from `LoadOptions`, each one a
keyword of `Session.load`; `%%exl_tree`'s from `GenerationRequest`'s prompt options, `SamplerSettings` and
`TreeOptions`. Every other option maps to a keyword of `show_cache` / `show_jobs`, `bench`, `branch_live` or
`Session.cancel`. `%exl_generate?`, `%%exl_generate?` and `--help` print the help; a user's mistake is a
one-line `UsageError`. The magics that measure how far a model's output moves (`%exl_quantize`,
`%exl_divergence`, `%exl_noise_floor`) are `exlnb.quality_magics`.
"""

from __future__ import annotations

import re

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, magic_arguments

from exlnb.generation import Generation
from exlnb.loadtest import bench
from exlnb.magic_arguments import (
    CELL_OPTIONS,
    CellOptions,
    display_argument,
    escaped,
    fill_prompt,
    generation_arguments,
    given_options,
    help_argument,
    load_arguments,
    out_argument,
    parse_options,
    schema_from_notebook,
    tidy_help,
    tree_arguments,
    usage_errors,
)
from exlnb.request import GenerationRequest
from exlnb.session import get_session
from exlnb.streaming import GenerationResult
from exlnb.widgets.branches import BranchTree
from exlnb.widgets.cache import show_jobs
from exlnb.widgets.loadtest import abench, shows_widget
from exlnb.widgets.server import show_cache_or_server
from exlnb.widgets.stream import Interrupted, abranch_live, agenerate_live, branch_live, generate_live
from exlnb.widgets.tree import atree_live, tree_live
from exlnb.workload import DEFAULT_REQUESTS, Workload, length_argument, rates_argument, slo_argument

# what IPython's magic transforms make of a %%exl_generate cell and of an %exl_bench line
_CELL_CALL = re.compile(r"^get_ipython\(\)\.run_cell_magic\('(exl_generate|exl_tree)', ")
_LINE_CALL = re.compile(r"^get_ipython\(\)\.run_line_magic\('(exl_bench|exl_branch)', ")
_AWAIT_MAGIC = "await get_ipython().magics_manager.registry['ExlnbMagics'].{}("


def await_magic_cells(lines: list[str]) -> list[str]:
    """IPython input transformer: a kernel runs a %%exl_generate or %%exl_tree cell, and a cell with an %exl_bench
    or %exl_branch line at its top level, as an async cell awaiting the magic.

    ipykernel (7.4) hands widget messages to their widgets while a cell awaits, not while it blocks: a cell
    blocked in a plain call would hear the Stop button only after its work had ended. An indented %exl_bench
    (or %exl_branch; perhaps inside a function, where `await` cannot go) stays a plain call.
    """
    if lines and _CELL_CALL.match(lines[0]):
        lines = [_CELL_CALL.sub(lambda m: _AWAIT_MAGIC.format(f"{m[1]}_async"), lines[0], count=1), *lines[1:]]
    return [_LINE_CALL.sub(lambda m: _AWAIT_MAGIC.format(f"{m[1]}_async"), line, count=1) for line in lines]


@magics_class
class ExlnbMagics(Magics):
    cell_id: str | None = None  # the cell running now, as the front end names it

    def remember_cell(self, info) -> None:
        """pre_run_cell hook: a re-run cell cancels what it started before."""
        self.cell_id = getattr(info, "cell_id", None)

    @load_arguments
    @line_magic
    def exl_load(self, line: str) -> None:
        """Load a model into the kernel's session; the same options again do nothing."""
        if (args := parse_options(self.exl_load, line)) is None:
            return
        session = get_session()
        before = session.options
        with usage_errors():
            status = session.load(**given_options(args))  # each option's dest is a keyword of Session.load
        if before is not None and session.options != before:
            print(f"replaced {before.model_dir.name} ({before.engine} engine)")
        print(status.line())
        print(f"model folder: {session.options.model_dir}")  # what a server of the same model is started on
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
        try:
            with usage_errors():
                generation = await agenerate_live(request, **show)
        except Interrupted as interrupted:  # the samples as they ended, as after Stop
            self._store(args, interrupted.generation)
            raise
        self._store(args, generation)

    def _generate_call(self, line: str, cell: str | None) -> tuple:
        if (args := parse_options(self.exl_generate, line)) is None:
            return None, None, None
        if cell is None:
            raise UsageError(
                "%%exl_generate is a cell magic: options on the first line, the prompt in the cell "
                "below (see %exl_generate? for the options)"
            )
        given = given_options(args)
        if "json_schema" in given:
            given["json_schema"] = schema_from_notebook(given["json_schema"], self.shell.user_ns)
        with usage_errors():
            cell_options = CellOptions(**{k: given.pop(k) for k in CELL_OPTIONS if k in given})
            request = GenerationRequest.build(fill_prompt(cell.strip(), self.shell.user_ns), **given)
        show = dict(
            background=cell_options.background,
            show_prompt=cell_options.show_prompt,
            display=cell_options.display,
            owner=self.cell_id,
        )
        return cell_options, request, show

    def _store(self, args: CellOptions, generation: Generation) -> None:
        if args.out:
            results = None if args.background else generation.results
            one = len(generation.samples) == 1
            self.shell.user_ns[args.out] = generation if results is None else results[0] if one else results

    @magic_arguments()
    @argument(
        "result",
        metavar="RESULT_VAR",
        help="a notebook variable (or expression, answers[1]) holding a result: %%%%exl_generate's --out, "
        "or a branch's",
    )
    @argument(
        "--at", type=int, required=True, metavar="K", help="the position (0 for the first answer token) to branch at"
    )
    @argument(
        "--token",
        type=escaped,
        metavar="TEXT",
        help="the text of the one token forced at K (default: the likeliest alternative the token view recorded there)",
    )
    @argument("--token-id", type=int, metavar="N", help="the id of the token forced at K, instead of --token")
    @display_argument
    @out_argument("the branch's result (branch it again with %%exl_branch VAR)")
    @help_argument
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
            raise UsageError(
                f"{args.result} does not name a result in the notebook ({type(error).__name__}: "
                f"{error}): give the --out of an %%exl_generate, e.g. answer, or answers[1]"
            ) from None
        if not isinstance(result, GenerationResult):
            raise UsageError(
                f"{args.result} is a {type(result).__name__}, not a result: give the --out of an "
                "%%exl_generate, e.g. answer, or answers[1] for one of several samples"
            )
        return args, result, args.token_id if args.token_id is not None else args.token

    def _show_branch(self, args, branched) -> None:
        if args.out:
            self.shell.user_ns[args.out] = branched
        BranchTree.of(branched).show()

    @tree_arguments
    @line_cell_magic
    @no_var_expand  # options are literal, as %%exl_generate's
    def exl_tree(self, line: str, cell: str | None = None) -> None:
        """Sample the cell body (the user's turn) N times into one tree, drawn as it grows."""
        if (call := self._tree_call(line, cell)) is None:
            return
        prompt, options = call
        with usage_errors():
            tree_live(prompt, **options)

    async def exl_tree_async(self, line: str, cell: str) -> None:
        """`%%exl_tree` as a kernel runs it (see `await_magic_cells`): the cell awaits, so Stop is heard."""
        if (call := self._tree_call(line, cell)) is None:
            return
        prompt, options = call
        with usage_errors():
            await atree_live(prompt, **options)

    def _tree_call(self, line: str, cell: str | None) -> tuple | None:
        if (args := parse_options(self.exl_tree, line)) is None:
            return None
        if cell is None:
            raise UsageError(
                "%%exl_tree is a cell magic: options on the first line, the prompt in the cell below "
                "(see %exl_tree? for the options)"
            )
        options = given_options(args)
        out = options.pop("out", None)
        if out:
            options["on_change"] = lambda tree: self.shell.user_ns.__setitem__(out, tree)
        return fill_prompt(cell.strip(), self.shell.user_ns), {**options, "owner": self.cell_id}

    @magic_arguments()
    @display_argument
    @help_argument
    @line_magic
    def exl_cache(self, line: str) -> None:
        """The cache inspector: pages coloured by owner job, shared pages outlined, free pages, totals; for a model
        behind a server (openai engine), the server view: its queue and KV-cache use, and this kernel's jobs."""
        if (args := parse_options(self.exl_cache, line)) is None:
            return
        with usage_errors():
            show_cache_or_server(display=args.display)

    @magic_arguments()
    @display_argument
    @help_argument
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
    @help_argument
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
    @argument(
        "--request-rate",
        type=rates_argument,
        default=list(Workload.request_rates),
        metavar="RATES",
        help="requests per second, comma separated to sweep, inf for all at once (default inf)",
    )
    @argument(
        "--burstiness", type=float, default=Workload.burstiness, help="gamma shape of the arrival gaps; 1 is Poisson"
    )
    @argument("--max-concurrency", type=int, metavar="N", help="most requests in flight (default: no limit)")
    @argument(
        "--prompt-len",
        type=length_argument,
        default=Workload.prompt_len,
        metavar="TOKENS",
        help=f"prompt tokens, or a range such as 64-256 (default {Workload.prompt_len})",
    )
    @argument(
        "--output-len",
        type=length_argument,
        default=Workload.output_len,
        metavar="TOKENS",
        help=f"exact output tokens, or a range such as 8-64 (default {Workload.output_len})",
    )
    @argument("--dataset", metavar="NAME", help="prompts from data/prompts/NAME.json instead of random tokens")
    @argument("--num-requests", type=int, metavar="N", help=f"requests per rate (default {DEFAULT_REQUESTS})")
    @argument("--duration", type=float, metavar="SECONDS", help="send for this long instead of --num-requests")
    @argument("--seed", type=int, default=Workload.seed, help="the same seed sends the same requests at the same times")
    @argument(
        "--slo",
        action="append",
        type=slo_argument,
        default=[],
        metavar="NAME=MS",
        help="goodput objective, repeatable: ttft_ms=500, tpot_ms=50, e2el_ms=2000",
    )
    @argument("--no-progress", action="store_true", help="nothing shown while it runs (no bar, no Stop button)")
    @display_argument
    @out_argument("the BenchResult (requests, summary, figure())")
    @help_argument
    @line_magic
    def exl_bench(self, line: str) -> None:
        """Load-test the loaded model as vLLM's benchmark_serving does and print its summary table (the widget,
        while it runs, has a Stop button)."""
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
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            dataset=args.dataset,
            num_requests=args.num_requests,
            duration_s=args.duration,
            seed=args.seed,
            slos=dict(args.slo) or None,
        )
        return args, options

    def _show_bench(self, args, result, printed: bool = True) -> None:
        """vLLM's printout, unless the live view showed the results (its record holds them, the printout folded)."""
        if printed:
            print(result.table())
        if args.out:
            self.shell.user_ns[args.out] = result


for _magic in (
    ExlnbMagics.exl_load,
    ExlnbMagics.exl_generate,
    ExlnbMagics.exl_branch,
    ExlnbMagics.exl_cache,
    ExlnbMagics.exl_jobs,
    ExlnbMagics.exl_cancel,
    ExlnbMagics.exl_bench,
    ExlnbMagics.exl_tree,
):
    tidy_help(_magic)
