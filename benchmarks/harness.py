"""Measuring honestly: warm-ups, device synchronisation before every clock read, repeats, medians, spread.

Also the record of where a number came from (device, driver, versions, date), written beside it.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from importlib import metadata

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def clock() -> float:
    """Read the clock only after the device has finished what was queued (field report 5)."""
    sync()
    return time.perf_counter()


def repeat(measure: Callable[[], float], *, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        measure()
    return [measure() for _ in range(repeats)]


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
    versions = {}
    for name in ("torch", "transformers", "exllamav2", "exlnb"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "versions": versions,
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
    else:
        info["device"] = f"cpu: {platform.machine()}, {torch.get_num_threads()} threads"
        info["driver"] = None
    return info


def device_slug(env: dict) -> str:
    return env["device"].split(":")[0].split(" (")[0].replace(" ", "-").lower()
