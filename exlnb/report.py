"""The main job (`make report`): run the investigation notebooks with papermill and write `reports/`.

    python -m exlnb.report [--engine auto|NAME] [--out reports] [--only NAME ...]
                           [--preset full] [--set NAME.PARAMETER=VALUE ...] [--publish [DIR]]

For each notebook, `reports/<name>/` gets the executed notebook, its HTML rendering, the JSON summary, the
CSVs of raw measurements and the PNG figure; `reports/summary.md` has one line per effect. A notebook runs
in `reports/.running/<name>/` and replaces `reports/<name>/` only once it has finished, so a failed or killed
run never overwrites the last complete one (a failed run is kept in `reports/failed/<name>/`). The default
engine is ExLlamaV2 where CUDA is available, the CPU engine otherwise. The notebooks' own defaults are
small enough for CI on two CPU cores; `--preset full` and `--set` give larger runs. `--publish` copies
the summaries, CSVs and figures to the engine's folder under `data/results/` (its registry entry's
`published_under`: docs/engines.md lists them).
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from exlnb.engines.formats import engine_for, model_format
from exlnb.engines.options import ENGINE_NAMES
from exlnb.engines.registry import engine_spec
from exlnb.experiments.notebooks import NOTEBOOKS, check_parameters
from exlnb.experiments.record import FIELD_REPORTS, read_summary, write_atomically
from exlnb.models import BUNDLED_MODEL, prepare_bundled

REPOSITORY = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPOSITORY / "notebooks"
RESULTS_DIR = REPOSITORY / "data" / "results"

# Larger runs for a GPU (or a patient CPU): more requests, longer outputs, tighter intervals. Sized so
# that the notebooks finish in about ten minutes on an H100 with the bundled model.
PRESETS: dict[str, dict[str, dict]] = {
    "full": {
        # 8 pages, one per request (prompt and 200 new tokens fit one 256-token page): two rounds of requests
        "latency": {"requests": 16, "max_new_tokens": 200, "cache_tokens": 2048, "trials": 5},
        "repetition": {"prompts": 12, "max_new_tokens": 160, "samples_per_prompt": 3},
        "prompt_format": {"questions": None, "max_new_tokens": 48},  # None: all of data/questions/short_answers.csv
        "concurrency": {"prompts": 16, "max_new_tokens": 96, "concurrency": [2, 4, 8, 16]},
        "streaming": {"max_new_tokens": 200},
        "context": {
            "turns": 10,
            "answer_tokens": 96,
            "context_lengths": [128, 1024, 2048, 4096, 8000],
            "cache_tokens": 16384,
            "timing_repeats": 8,
        },
        # a few hundred answers: two such runs over disjoint questions are data/results/cpu's near_ties rows
        "near_ties": {"answers": 196, "max_new_tokens": 48, "calibration": 8, "questions_from": 8},
    },
}


@dataclass(frozen=True)
class NotebookRun:
    name: str
    seconds: float | None  # None for results found from an earlier run
    summary: dict | None  # the notebook's JSON summary; None when the notebook failed
    error: str | None = None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    overrides = _overrides(args.preset, args.set, args.only)
    args.out.mkdir(parents=True, exist_ok=True)
    engine = chosen_engine(args.engine)
    runs = []
    for number, name in enumerate(args.only, 1):
        step = f"[{number}/{len(args.only)}] {name}"
        print(f"{step}: running on the {engine} engine ...", flush=True)
        run = run_notebook(name, args.out, engine=engine, parameters=overrides.get(name, {}), progress=step)
        outcome = f"failed: {run.error}" if run.error else f"done -> {args.out / name}"
        print(f"{step}: {outcome} ({run.seconds:.0f} s)", flush=True)
        runs.append(run)
    if not any((args.out / ".running").iterdir()):  # a notebook killed mid-run leaves its folder here
        (args.out / ".running").rmdir()
    summary = args.out / "summary.md"
    write_atomically(summary, summary_markdown(runs + earlier_runs(args.out, skip=args.only)))
    print(f"wrote {summary}")
    if args.publish:
        target = publish(runs, args.out, None if args.publish == "auto" else Path(args.publish))
        print(f"copied summaries, CSVs and figures to {target}")
    return 1 if any(run.error for run in runs) else 0


def chosen_engine(engine: str) -> str:
    """The engine every notebook will load, named before they run: "auto" resolved as `Session.load` resolves it
    for the bundled model, which is prepared here (fetched and converted once, with its progress shown) rather
    than silently inside the first notebook's kernel."""
    print(f"the bundled model ({BUNDLED_MODEL}) ...", flush=True)
    folder = prepare_bundled(progress=True)
    print(f"the bundled model is ready at {folder}", flush=True)
    if engine != "auto":
        return engine
    import torch

    return engine_for(model_format(folder), cuda=torch.cuda.is_available())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m exlnb.report",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--engine",
        default="auto",
        choices=ENGINE_NAMES,
        help="auto: ExLlamaV2 where CUDA is available, else the CPU engine",
    )
    parser.add_argument("--out", type=Path, default=Path("reports"), help="where reports go (default: reports)")
    parser.add_argument(
        "--only",
        nargs="+",
        default=list(NOTEBOOKS),
        choices=NOTEBOOKS,
        metavar="NAME",
        help=f"run only these notebooks ({', '.join(NOTEBOOKS)})",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), help="larger parameters for real runs")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME.PARAMETER=VALUE",
        help="override one notebook parameter, e.g. --set latency.requests=24 (a Python literal)",
    )
    parser.add_argument(
        "--publish",
        nargs="?",
        const="auto",
        metavar="DIR",
        help="copy summaries, CSVs and figures to DIR (default: the engine's folder under data/results)",
    )
    return parser


def _overrides(preset: str | None, assignments: list[str], names: list[str]) -> dict[str, dict]:
    """Notebook parameters from the preset, then from each `--set NAME.PARAMETER=VALUE`; each one checked
    against those the notebook takes (its experiment's `run()`), so a misspelt name fails before any run."""
    overrides = {name: dict(values) for name, values in PRESETS.get(preset, {}).items()}
    for name, values in overrides.items():
        _check(f"--preset {preset}", name, values)
    for assignment in assignments:
        target, _, text = assignment.partition("=")
        name, _, parameter = target.partition(".")
        if not text or not parameter or name not in NOTEBOOKS:
            raise SystemExit(
                f"--set {assignment!r}: write NAME.PARAMETER=VALUE with NAME one of {', '.join(NOTEBOOKS)}, "
                "e.g. --set latency.requests=24"
            )
        if name not in names:
            raise SystemExit(f"--set {assignment!r}: the notebook {name!r} is not among those run (--only)")
        _check(f"--set {assignment!r}", name, [parameter])
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text  # a bare word is a string: --set latency.engine=cpu
        overrides.setdefault(name, {})[parameter] = value
    return overrides


def _check(where: str, name: str, parameters) -> None:
    try:
        check_parameters(name, parameters)
    except ValueError as error:
        raise SystemExit(f"{where}: {error}") from None


def run_notebook(name: str, out: Path, *, engine: str, parameters: dict, progress: str = "") -> NotebookRun:
    """Execute one notebook into `out/.running/<name>/`, then put it in place of `out/<name>/` once it has
    finished; a failure is reported, not raised, and leaves the last complete result where it was."""
    import papermill
    from nbclient.exceptions import DeadKernelError

    running, failed = out / ".running" / name, out / "failed" / name
    shutil.rmtree(running, ignore_errors=True)
    running.mkdir(parents=True)
    executed = running / f"{name}.ipynb"
    start = time.perf_counter()
    error = None
    try:
        papermill.execute_notebook(
            NOTEBOOK_DIR / f"{name}.ipynb",
            executed,
            # "." with the kernel started in the run's folder: the notebook records no path of this machine
            parameters={"engine": engine, "output_dir": ".", **parameters},
            cwd=str(running),
            kernel_name="python3",
            progress_bar={"desc": f"{progress} cells", "file": sys.stdout, "ascii": True, "leave": False}
            if progress
            else False,
            config=_kernel_config(),
        )
    except papermill.PapermillExecutionError as failure:
        error = f"{failure.ename}: {failure.evalue}"
    except DeadKernelError as failure:  # e.g. killed for memory: the other notebooks can still run
        error = f"the kernel died: {failure}"
    seconds = time.perf_counter() - start
    if executed.exists():
        _strip_machine_paths(executed, name)
        _write_html(executed)
    summary = None
    if error is None:
        summary, error = read_summary(running / f"{name}.json")
    if error is not None:
        shutil.rmtree(failed, ignore_errors=True)
        failed.parent.mkdir(exist_ok=True)
        running.rename(failed)
        kept = f"; the last complete run is still in {out / name}" if (out / name).exists() else ""
        return NotebookRun(name, seconds, None, f"{error} (see {failed / executed.name}{kept})")
    _replace_folder(out / name, running)
    shutil.rmtree(failed, ignore_errors=True)  # an older failure of this notebook is no longer the news
    return NotebookRun(name, seconds, summary, None)


def _kernel_config():
    """Kernels on IPC sockets where the platform has them: no network port, and no "running over TCP without
    encryption" warning from every kernel ipykernel starts."""
    from traitlets.config import Config

    config = Config()
    if os.name == "posix":
        config.KernelManager.transport = "ipc"
    return config


def _strip_machine_paths(notebook: Path, name: str) -> None:
    """papermill records where the notebook was read and written: keep those relative to the repository, so an
    executed notebook shared or committed carries no path of the machine that ran it."""
    import nbformat

    executed = nbformat.read(notebook, as_version=4)
    record = executed.metadata.get("papermill", {})
    record["input_path"] = f"notebooks/{name}.ipynb"
    record["output_path"] = f"{name}.ipynb"
    write_atomically(notebook, nbformat.writes(executed) + "\n")


def _replace_folder(target: Path, finished: Path) -> None:
    """Put a finished run's folder in place of the last one: two renames, so `target` is never half-written."""
    previous = target.with_name(f".{target.name}.previous")
    shutil.rmtree(previous, ignore_errors=True)
    if target.exists():
        target.rename(previous)
    finished.rename(target)
    shutil.rmtree(previous, ignore_errors=True)


def earlier_runs(out: Path, *, skip: list[str]) -> list[NotebookRun]:
    """Complete results an earlier run left in `out`, so that runs split with --only still add up to one
    summary; a summary that cannot be read is skipped with one line saying which."""
    runs = []
    for name in NOTEBOOKS:
        path = out / name / f"{name}.json"
        if name in skip or not path.exists():
            continue
        summary, error = read_summary(path)
        if error:
            print(f"skipping {name}'s earlier result: {error}", file=sys.stderr)
            continue
        runs.append(NotebookRun(name, None, summary))
    return runs


def _write_html(notebook: Path) -> None:
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_filename(str(notebook))
    write_atomically(notebook.with_suffix(".html"), body)


def summary_markdown(runs: list[NotebookRun]) -> str:
    """One line per effect, grouped by notebook, with where the numbers came from."""
    lines = ["# exlnb investigations", ""]
    environments = {_environment_line(run.summary["environment"]) for run in runs if run.summary}
    lines += [f"- {line}" for line in sorted(environments)]
    for run in sorted(runs, key=lambda run: NOTEBOOKS.index(run.name)):
        when = f"{run.seconds:.0f} s" if run.seconds is not None else _earlier(run.summary["environment"])
        lines += ["", f"## {run.name} ({when})", ""]
        if run.error:
            lines.append(f"- FAILED: {run.error}")
            continue
        # quantization answers none
        lines += [
            f"Field report {n} (docs/field-reports.md): {FIELD_REPORTS[n]}." for n in run.summary["field_reports"]
        ]
        lines += [""] if run.summary["field_reports"] else []
        lines += [f"- {effect['line']}" for effect in run.summary["effects"]]
        lines += ["", *[f"- {finding}" for finding in run.summary["findings"]]]
        if "figure" in run.summary and run.summary["figure"] is None:
            lines.append("- No figure: nothing measured here could be drawn; the lines above say why.")
    return "\n".join(lines) + "\n"


def _earlier(env: dict) -> str:
    """Results kept from an earlier run say when they were measured, so they are not read as this run's."""
    return f"from an earlier run, {env['date']}" if env.get("date") else "from an earlier run"


def _environment_line(env: dict) -> str:
    versions = ", ".join(f"{name} {version}" for name, version in env["versions"].items() if version)
    mode = "paged" if env["paged"] else "unpaged"
    return f"{env['engine']} engine, {env['model']}, {env['device']} ({mode}, {env['attention']}); {versions}"


def publish(runs: list[NotebookRun], out: Path, target: Path | None) -> Path:
    """Copy each notebook's summary, CSVs and figure to `target` (default: the engine's folder under data/results/)."""
    done = [run for run in runs if run.summary]
    if target is None:
        engines = {run.summary["environment"]["engine"] for run in done}
        if len(engines) != 1:
            raise SystemExit(
                f"--publish needs results from one engine to choose its folder under data/results/; got {engines}"
            )
        target = RESULTS_DIR / engine_spec(engines.pop()).published_under
    target.mkdir(parents=True, exist_ok=True)
    for run in done:
        for path in sorted((out / run.name).iterdir()):
            if path.suffix in (".json", ".csv", ".png"):
                write_atomically(target / path.name, path.read_bytes())
    return target


if __name__ == "__main__":
    sys.exit(main())
