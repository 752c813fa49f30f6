"""The disconnect notebook against each server this machine can start, every mode, one after the other.

    python -m benchmarks disconnect --out benchmarks/results/disconnect-<device>-<date> [--only NAME ...]

Each server is started on 127.0.0.1 and a free port on the bundled model (`local_servers.py`, as the tests start
it), the notebook runs under papermill against it with exlnb's CPU engine as the control, given the server's PID
(so its CPU time is read) and its mode, and the server is stopped. `summary.json` gets each run's rows, findings,
parameters and environment, and one verdict per server, mode, request kind and phase; each run's figure goes
beside it. The executed notebooks, CSVs and server logs stay under `raw/` (not kept in git).
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

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "disconnect.ipynb"
THREADS = 1  # each server's threads: on two cores beside the notebook's kernel, two threads of a server wait for
# each other at every step (local_servers.py says what that cost)
SERVERS = {  # name -> how to start it (a context manager yielding a LocalServer), and the command, for the record
    "transformers": (lambda log_dir: local_servers.transformers_serve(log_dir, threads=THREADS),
                     f"OMP_NUM_THREADS={THREADS} transformers serve FOLDER --device cpu --host 127.0.0.1 --port PORT "
                     "--dtype float32"),
    "transformers-cb": (lambda log_dir: local_servers.transformers_serve(log_dir, continuous_batching=True,
                                                                        threads=THREADS),
                        f"OMP_NUM_THREADS={THREADS} transformers serve FOLDER --device cpu --host 127.0.0.1 --port PORT "
                        "--dtype float32 --continuous-batching"),
    "llama-cpp": (lambda log_dir: local_servers.llama_cpp_server(log_dir, threads=THREADS),
                  f"python -m llama_cpp.server --model GGUF --model_alias smollm2-135m-instruct --host 127.0.0.1 "
                  f"--port PORT --n_ctx 2048 --n_threads {THREADS} --n_threads_batch {THREADS} "
                  "--interrupt_requests False --verbose False"),
}
VERDICT_COLUMNS = ["target", "mode", "request", "phase", "probe_says", "metrics_says", "cpu_says", "verdict"]


def run_one(name: str, out: Path, parameters: dict) -> dict:
    """One server started, measured by the notebook and stopped: its record for the summary."""
    raw = out / "raw" / name
    raw.mkdir(parents=True, exist_ok=True)
    start, command = SERVERS[name]
    with start(raw) as server:
        print(f"{name}: {server.mode} at {server.url} (pid {server.pid})", flush=True)
        papermill.execute_notebook(
            str(NOTEBOOK), str(raw / "disconnect.ipynb"), kernel_name="python3", progress_bar=False,
            parameters=dict(engine="cpu", output_dir=str(raw), url=server.url, server_pid=server.pid,
                            server_mode=server.mode, **parameters),
        )
    shutil.copyfile(raw / "disconnect.png", out / f"{name}.png")
    summary = json.loads((raw / "disconnect.json").read_text())
    phases = pd.read_csv(raw / "disconnect-phases.csv")
    return {"mode": server.mode, "server_command": command, "figure": f"{name}.png", "findings": summary["findings"],
            "parameters": summary["parameters"] | {"url": "http://127.0.0.1:PORT/v1", "server_pid": "PID"},
            "phases": [_plain(row) for row in phases.to_dict("records")], "environment": summary["environment"]}


def _plain(row: dict) -> dict:
    """A CSV row as JSON takes it: an empty cell (a signal not read) is null, not NaN."""
    return {key: None if isinstance(value, float) and math.isnan(value) else value for key, value in row.items()}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m benchmarks disconnect", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the run's folder, e.g. benchmarks/results/disconnect-cpu-...")
    parser.add_argument("--only", nargs="+", choices=list(SERVERS), default=list(SERVERS))
    parser.add_argument("--set", nargs="*", default=[], metavar="PARAMETER=VALUE",
                        help="a notebook parameter other than its default, e.g. abandoned=1 (read as JSON)")
    args = parser.parse_args(argv)
    parameters = {key: json.loads(value) for key, value in (item.split("=", 1) for item in args.set)}
    path = args.out / "summary.json"
    record = json.loads(path.read_text()) if path.exists() else {"runs": {}}  # a run with --only adds to it
    for name in args.only:
        record["runs"][name] = run_one(name, args.out, parameters)
        record["verdicts"] = [{"server": name, **{c: row[c] for c in VERDICT_COLUMNS}}
                              for name, run in record["runs"].items() for row in run["phases"]]
        write_json(path, record, indent=1)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
