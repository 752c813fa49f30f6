"""Measuring honestly: warm-ups, device synchronisation before every clock read, repeats, medians, spread.

Also the record of where a number came from (device, driver, versions, date), written beside it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from importlib import metadata
from pathlib import Path

import torch

from exlnb.experiments.record import git_commit, write_atomically


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def clock() -> float:
    """Read the clock only after the device has finished what was queued (field report 5)."""
    sync()
    return time.perf_counter()


def summarise(samples: list[float]) -> dict:
    """Median and spread (interquartile range, min, max) of raw samples, which are kept too."""
    ordered = sorted(samples)
    q = statistics.quantiles(ordered, n=4) if len(ordered) >= 2 else [ordered[0]] * 3
    return {
        "samples": samples,
        "median": statistics.median(ordered),
        "iqr": q[2] - q[0],
        "min": ordered[0],
        "max": ordered[-1],
    }


def environment() -> dict:
    """Where the numbers come from. The load average marks runs taken on a busy machine: on a 2-core CPU,
    one other busy process halves what two torch threads get."""
    versions = {}
    for name in ("torch", "triton", "transformers", "exllamav2", "exllamav3", "exlnb"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "versions": versions,
        "exlnb_commit": git_commit(),
        "load_average_1min": os.getloadavg()[0],
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
    else:
        info["device"] = f"cpu: {_cpu_model()}, {torch.get_num_threads()} threads"
        info["driver"] = None
    return info


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def device_slug(env: dict) -> str:
    """`nvidia-h100-80gb-hbm3`, `amd-epyc`: the device part of a result's file name."""
    name = env["device"].removeprefix("cpu: ").split(",")[0].split(" (")[0]
    return "-".join(name.lower().replace("(r)", "").replace("(tm)", "").split())


def new_result_path(out: Path, stem: str) -> Path:
    """`out/<stem>.json`, or `<stem>-2.json`, `-3`, ... where an earlier run (of the same day, the same device)
    holds the name: a second run never replaces the first's files, the JSON nor what is written beside it."""
    out.mkdir(parents=True, exist_ok=True)
    number = 1
    while (path := out / f"{stem if number == 1 else f'{stem}-{number}'}.json").exists():
        number += 1
    return path


def write_json(path: Path, record: dict, **dumps) -> None:
    """The record as strict JSON (NaN and infinity refused), written whole or not at all."""
    write_atomically(path, json.dumps(record, allow_nan=False, **dumps) + "\n")
