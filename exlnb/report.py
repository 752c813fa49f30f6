"""The main job (`make report`): run the six investigation notebooks with papermill and write `reports/`.

    python -m exlnb.report [--engine auto|exllamav2|cpu] [--out reports] [--only NAME ...]
                           [--preset full] [--set NAME.PARAMETER=VALUE ...] [--publish [DIR]]

For each notebook, `reports/<name>/` gets the executed notebook, its HTML rendering, the JSON summary, the
CSVs of raw measurements and the PNG figure; `reports/summary.md` has one line per effect. The default
engine is ExLlamaV2 where CUDA is available, the CPU engine otherwise. The notebooks' own defaults are
small enough for CI on two CPU cores; `--preset full` and `--set` give larger runs. `--publish` copies
the summaries, CSVs and figures to `data/results/gpu/` (ExLlamaV2 engine), `data/results/exllamav3/` or
`data/results/cpu/`.
"""

from __future__ import annotations

import argparse
import ast
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from exlnb.engines.options import ENGINE_NAMES
from exlnb.experiments.notebooks import NOTEBOOKS, check_parameters

REPOSITORY = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPOSITORY / "notebooks"
RESULTS_DIR = REPOSITORY / "data" / "results"
PUBLISHED_UNDER = {"exllamav2": "gpu", "exllamav3": "exllamav3", "cpu": "cpu"}  # data/results/<this>/ per engine

# Larger runs for a GPU (or a patient CPU): more requests, longer outputs, tighter intervals. Sized so
# that all six finish in about ten minutes on an H100 with the bundled model.
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
    runs = []
    for number, name in enumerate(args.only, 1):
        print(f"[{number}/{len(args.only)}] {name}: running on engine {args.engine!r} ...", flush=True)
        run = run_notebook(name, args.out / name, engine=args.engine, parameters=overrides.get(name, {}))
        outcome = f"failed: {run.error}" if run.error else "done"
        print(f"[{number}/{len(args.only)}] {name}: {outcome} in {run.seconds:.0f} s -> {args.out / name}", flush=True)
        runs.append(run)
    summary = args.out / "summary.md"
    summary.write_text(summary_markdown(runs + earlier_runs(args.out, skip=args.only)))
    print(f"wrote {summary}")
    if args.publish:
        target = publish(runs, args.out, None if args.publish == "auto" else Path(args.publish))
        print(f"copied summaries, CSVs and figures to {target}")
    return 1 if any(run.error for run in runs) else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m exlnb.report", description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", default="auto", choices=ENGINE_NAMES,
                        help="auto: ExLlamaV2 where CUDA is available, else the CPU engine")
    parser.add_argument("--out", type=Path, default=Path("reports"), help="where reports go (default: reports)")
    parser.add_argument("--only", nargs="+", default=list(NOTEBOOKS), choices=NOTEBOOKS, metavar="NAME",
                        help=f"run only these notebooks ({', '.join(NOTEBOOKS)})")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="larger parameters for real runs")
    parser.add_argument("--set", action="append", default=[], metavar="NAME.PARAMETER=VALUE",
                        help="override one notebook parameter, e.g. --set latency.requests=24 (a Python literal)")
    parser.add_argument("--publish", nargs="?", const="auto", metavar="DIR",
                        help="copy summaries, CSVs and figures to DIR (default: data/results/gpu, exllamav3 or cpu, by engine)")
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


def run_notebook(name: str, out_dir: Path, *, engine: str, parameters: dict) -> NotebookRun:
    """Execute one notebook into `out_dir` (notebook, HTML, results); a failure is reported, not raised."""
    import papermill
    from nbclient.exceptions import DeadKernelError

    out_dir.mkdir(parents=True, exist_ok=True)
    executed = out_dir / f"{name}.ipynb"
    start = time.perf_counter()
    error = None
    try:
        papermill.execute_notebook(
            NOTEBOOK_DIR / f"{name}.ipynb",
            executed,
            parameters={"engine": engine, "output_dir": str(out_dir.resolve()), **parameters},
            cwd=str(NOTEBOOK_DIR),
            kernel_name="python3",
            progress_bar=sys.stderr.isatty(),
        )
    except papermill.PapermillExecutionError as failure:
        error = f"{failure.ename}: {failure.evalue} (see {executed})"
    except DeadKernelError as failure:  # e.g. killed for memory: the other notebooks can still run
        error = f"the kernel died: {failure} (see {executed})"
    seconds = time.perf_counter() - start
    if executed.exists():
        _write_html(executed)
    summary_path = out_dir / f"{name}.json"
    summary = json.loads(summary_path.read_text()) if error is None and summary_path.exists() else None
    if error is None and summary is None:
        error = f"the notebook ran but wrote no {summary_path.name}"
    return NotebookRun(name, seconds, summary, error)


def earlier_runs(out: Path, *, skip: list[str]) -> list[NotebookRun]:
    """Results an earlier run left in `out`, so that runs split with --only still add up to one summary."""
    return [
        NotebookRun(name, None, json.loads(path.read_text()))
        for name in NOTEBOOKS
        if name not in skip and (path := out / name / f"{name}.json").exists()
    ]


def _write_html(notebook: Path) -> None:
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_filename(str(notebook))
    notebook.with_suffix(".html").write_text(body)


def summary_markdown(runs: list[NotebookRun]) -> str:
    """One line per effect, grouped by notebook, with where the numbers came from."""
    lines = ["# exlnb investigations", ""]
    environments = {_environment_line(run.summary["environment"]) for run in runs if run.summary}
    lines += [f"- {line}" for line in sorted(environments)]
    for run in sorted(runs, key=lambda run: NOTEBOOKS.index(run.name)):
        when = "from an earlier run" if run.seconds is None else f"{run.seconds:.0f} s"
        lines += ["", f"## {run.name} ({when})", ""]
        if run.error:
            lines.append(f"- FAILED: {run.error}")
            continue
        if reports := ", ".join(str(n) for n in run.summary["field_reports"]):  # quantization answers none
            lines += [f"Field report{'s' if ',' in reports else ''} {reports}.", ""]
        lines += [f"- {effect['line']}" for effect in run.summary["effects"]]
        lines += ["", *[f"- {finding}" for finding in run.summary["findings"]]]
    return "\n".join(lines) + "\n"


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
            raise SystemExit(f"--publish needs results from one engine to choose its folder under data/results/; got {engines}")
        target = RESULTS_DIR / PUBLISHED_UNDER[engines.pop()]
    target.mkdir(parents=True, exist_ok=True)
    for run in done:
        for path in sorted((out / run.name).iterdir()):
            if path.suffix in (".json", ".csv", ".png"):
                shutil.copy2(path, target / path.name)
    return target


if __name__ == "__main__":
    sys.exit(main())
