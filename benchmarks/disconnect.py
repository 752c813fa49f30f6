"""The disconnect notebook against each server this machine can start, every mode, one after the other.

    python -m benchmarks disconnect --out benchmarks/results/disconnect-<device>-<date> [--only NAME ...] [--repeats N]

Each server is started on 127.0.0.1 and a free port on the bundled model (`local_servers.py`, as the tests start
it), the notebook runs under papermill against it with exlnb's CPU engine as the control, given the server's PID
(so its CPU time is read) and its mode, and the server is stopped; with `--repeats N`, N times, the servers
taken in turns. `summary.json` gets each run's rows, findings, parameters and environment, and per server, mode,
request kind and phase every run's verdict and the one they all give (or that they disagree); each run's figure
goes beside it. The executed notebooks, CSVs and server logs stay under `raw/` (not kept in git).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import pandas as pd
import papermill

from benchmarks import local_servers
from benchmarks.harness import write_json
from exlnb.experiments.disconnect_signals import verdict_kind

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "disconnect.ipynb"
THREADS = 1  # each server's threads: on two cores beside the notebook's kernel, two threads of a server wait for
# each other at every step (local_servers.py says what that cost)
SERVERS = {  # name -> how to start it (a context manager yielding a LocalServer), and the command, for the record
    "transformers": (
        lambda log_dir: local_servers.transformers_serve(log_dir, threads=THREADS),
        f"OMP_NUM_THREADS={THREADS} transformers serve FOLDER --device cpu --host 127.0.0.1 --port PORT "
        "--dtype float32",
    ),
    "transformers-cb": (
        lambda log_dir: local_servers.transformers_serve(log_dir, continuous_batching=True, threads=THREADS),
        f"OMP_NUM_THREADS={THREADS} transformers serve FOLDER --device cpu --host 127.0.0.1 --port PORT "
        "--dtype float32 --continuous-batching",
    ),
    "llama-cpp": (
        lambda log_dir: local_servers.llama_cpp_server(log_dir, threads=THREADS),
        f"python -m llama_cpp.server --model GGUF --model_alias smollm2-135m-instruct --host 127.0.0.1 "
        f"--port PORT --n_ctx 2048 --n_threads {THREADS} --n_threads_batch {THREADS} "
        "--interrupt_requests False --verbose False",
    ),
}
ROW_COLUMNS = ["abandoned", "slowdown", "server_cpu_after_left_s", "probe_says", "metrics_says", "cpu_says", "verdict"]


def run_one(name: str, repeat: int, out: Path, parameters: dict) -> dict:
    """One server started, measured by the notebook and stopped: its record for the summary."""
    raw = out / "raw" / f"{name}-{repeat}"
    raw.mkdir(parents=True, exist_ok=True)
    start, command = SERVERS[name]
    with start(raw) as server:
        print(f"{name}, run {repeat}: {server.mode} at {server.url} (pid {server.pid})", flush=True)
        papermill.execute_notebook(
            str(NOTEBOOK),
            str(raw / "disconnect.ipynb"),
            kernel_name="python3",
            progress_bar=False,
            parameters=dict(
                engine="cpu",
                output_dir=str(raw),
                url=server.url,
                served_model=server.served_model,
                dialect=server.dialect,
                server_pid=server.pid,
                server_mode=server.mode,
                **parameters,
            ),
        )
    figure = f"{name}-{repeat}.png"
    shutil.copyfile(raw / "disconnect.png", out / figure)
    summary = json.loads((raw / "disconnect.json").read_text())
    phases = pd.read_csv(raw / "disconnect-phases.csv")
    return {
        "run": repeat,
        "mode": server.mode,
        "server_command": command,
        "figure": figure,
        "findings": summary["findings"],
        "parameters": summary["parameters"] | {"url": "http://127.0.0.1:PORT/v1", "server_pid": "PID"},
        "phases": [_plain(row) for row in phases.to_dict("records")],
        "environment": summary["environment"],
    }


def verdicts(runs: dict[str, list[dict]]) -> list[dict]:
    """One entry per server, target, request kind and phase: each run's signals and verdict, and the verdict
    every run that abandoned a request gives ("stopped", "kept working", "unclear"), or "runs disagree"; a run in
    which every request was answered before its client left has nothing to say about it."""
    cells: dict[tuple, list[dict]] = {}
    for name, repeats in runs.items():
        for repeat in repeats:
            for row in repeat["phases"]:
                cells.setdefault((name, row["target"], row["mode"], row["request"], row["phase"]), []).append(row)
    entries = []
    for (name, target, mode, request, phase), rows in cells.items():
        kinds = {verdict_kind(row["verdict"]) for row in rows} - {"nothing abandoned"}
        agreed = "nothing abandoned" if not kinds else kinds.pop() if len(kinds) == 1 else "runs disagree"
        entries.append(
            {
                "server": name,
                "target": target,
                "mode": mode,
                "request": request,
                "phase": phase,
                "verdict": agreed,
                "runs_abandoning": sum(row["abandoned"] > 0 for row in rows),
                "runs": [{column: row[column] for column in ROW_COLUMNS} for row in rows],
            }
        )
    return entries


def _plain(row: dict) -> dict:
    """A CSV row as JSON takes it: an empty cell (a signal not read) is null, not NaN."""
    return {key: None if isinstance(value, float) and math.isnan(value) else value for key, value in row.items()}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m benchmarks disconnect", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="the run's folder, e.g. benchmarks/results/disconnect-cpu-..."
    )
    parser.add_argument("--only", nargs="+", choices=list(SERVERS), default=list(SERVERS))
    parser.add_argument("--repeats", type=int, default=1, help="runs of every server, taken in turns")
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="PARAMETER=VALUE",
        help="a notebook parameter other than its default, e.g. abandoned=1 (read as JSON)",
    )
    args = parser.parse_args(argv)
    parameters = {key: json.loads(value) for key, value in (item.split("=", 1) for item in args.set)}
    path = args.out / "summary.json"
    record = json.loads(path.read_text()) if path.exists() else {"runs": {}}  # a later call adds runs to it
    for _ in range(args.repeats):
        for name in args.only:
            runs = record["runs"].setdefault(name, [])
            runs.append(run_one(name, len(runs) + 1, args.out, parameters))
            record["verdicts"] = verdicts(record["runs"])
            write_json(path, record, indent=1)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
