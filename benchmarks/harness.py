"""Measuring honestly: warm-ups, device synchronisation before every clock read, repeats, medians, spread.

Also the record of where a number came from (`environment`: exlnb's one record of device, driver, versions and
date), written beside it.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from exlnb.experiments.record import environment as environment  # the benchmarks read the one record from here
from exlnb.experiments.record import write_atomically


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def clock() -> float:
    """Read the clock only after the device has finished what was queued (field report 5)."""
    sync()
    return time.perf_counter()


def gpu_ms_per_call(fn, repeats: int) -> float:
    """Mean GPU ms of `repeats` back-to-back calls of `fn`: CUDA events around them, read once the last has ended
    (the host's own time per call does not count, as long as it keeps the GPU fed)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


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
