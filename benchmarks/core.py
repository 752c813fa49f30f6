"""The core suite: every core benchmark this machine can run, a table, JSON (and the context curve as PNG).

    python -m benchmarks core [--quick] [--only kit,peer,context,concurrency,hardware] [--engine E] [--model M]
                              [--out benchmarks/results]

The engine is chosen as in the kit (ExLlamaV2 with CUDA, else CPU; `--engine exllamav3` for ExLlamaV3);
`hardware` needs the ExLlamaV2 engine; `peer` adds exllamav3's own generator where it is installed.
Numbers are medians of repeats after warm-ups, clocks read after device synchronisation; the JSON keeps
the raw samples, the spread, and where they were taken (device, driver, versions, commit, load, date).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from benchmarks import suites
from benchmarks.harness import clock, device_slug, environment, new_result_path, write_json
from benchmarks.table import markdown
from exlnb import get_session
from exlnb.engines.options import ENGINE_NAMES
from exlnb.models import BUNDLED_MODEL

ALL = ("kit", "peer", "context", "concurrency", "hardware")


def plot_context(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [r["context_tokens"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label, color in (
        (axes[0], "decode_tokens_per_s", "decode", "C0"),
        (axes[1], "prefill_tokens_per_s", "prefill", "C1"),
    ):
        medians = [r[key]["median"] for r in rows]
        spread = [
            [m - r[key]["min"] for m, r in zip(medians, rows)],
            [r[key]["max"] - m for m, r in zip(medians, rows)],
        ]
        ax.errorbar(lengths, medians, yerr=spread, marker="o", color=color, capsize=3)
        ax.set(xscale="log", xlabel="context tokens", ylabel=f"{label} tokens/s", title=f"{label} (median, min-max)")
        ax.set_ylim(bottom=0)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m benchmarks core", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few, short runs: checks that everything runs")
    parser.add_argument("--only", default=",".join(ALL), help=f"comma-separated subset of {','.join(ALL)}")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--engine", default="auto", choices=ENGINE_NAMES)
    parser.add_argument(
        "--model",
        default=BUNDLED_MODEL,
        help="a model name or folder the engine loads (default: the bundled model), e.g. an EXL3 quant",
    )
    args = parser.parse_args(argv)
    chosen = [name for name in args.only.split(",") if name]
    unknown = set(chosen) - set(ALL)
    if unknown:
        parser.error(f"unknown benchmarks {sorted(unknown)}: choose from {', '.join(ALL)}")
    plan = suites.Plan.for_mode(args.quick, torch.cuda.is_available())

    started = clock()
    session = get_session()
    status = session.load(args.model, engine=args.engine, cache_tokens=8448, progress=False)
    env = environment()
    results = {
        "environment": env,
        "engine": status.line(),
        "model": args.model,
        "quick": args.quick,
        "plan": plan.__dict__,
        "benchmarks": {},
        "skipped": {},
    }
    for name in chosen:
        if name == "hardware" and status.engine != "exllamav2":
            results["skipped"][name] = "needs the ExLlamaV2 engine on CUDA"
            continue
        print(f"running {name} ...", flush=True)
        run = getattr(suites, name)
        results["benchmarks"][name] = (
            suites.timed(run, plan) if name == "hardware" else suites.timed(run, session, plan)
        )
    results["elapsed_s"] = clock() - started
    env["load_average_1min_at_end"] = os.getloadavg()[0]

    path = new_result_path(
        args.out, f"{status.engine}-{device_slug(env)}-{env['date'][:10]}" + ("-quick" if args.quick else "")
    )
    write_json(path, results, indent=2)
    if "context" in results["benchmarks"]:
        plot_context(
            results["benchmarks"]["context"]["rows"], path.with_name(f"{path.stem}-context.png"), status.line()
        )
    print(markdown([{**results, "file": path.name}]))
    print(f"wrote {path} in {results['elapsed_s']:.0f} s")
    return path
