"""What every investigation hands back and how it is kept: tables, effects, environment, files.

A result is written as `<name>-<table>.csv` per raw table, `<name>.json` (the summary: effects with their
intervals, parameters, engine, model, device, versions, notes) and `<name>.png` (the figure). `environment()` is
the one record of where numbers come from, the benchmarks' too.
"""

from __future__ import annotations

import datetime
import io
import json
import os
import platform
import subprocess
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pandas as pd

from exlnb.analysis import Estimate
from exlnb.engines.registry import engine_libraries
from exlnb.session import Session

# the kit's own packages whose versions decide its numbers; each registered engine's library is recorded besides
KIT_PACKAGES = ("exlnb", "torch", "triton", "transformers", "numpy", "pandas")
# what each field report (docs/field-reports.md, whose headings these are) is about, for a reader who has not read it
FIELD_REPORTS = {
    1: "Latency that grows from seconds to minutes",
    2: "Concurrent requests mixing each other's context",
    3: "Streaming that stalls, then bursts",
    4: "Speed falling over many prompts, and prompt-format mistakes",
    5: "Long prompts: speed drop and an impossible measurement",
}


@dataclass(frozen=True)
class Effect:
    """One contrast an investigation measured: the symptom's condition against the fix's."""

    name: str  # what was measured, e.g. "next job, time to last token"
    symptom: Estimate
    fix: Estimate
    symptom_label: str  # the condition that shows the symptom, e.g. "un-cancelled"
    fix_label: str
    ratio: Estimate | None = None  # symptom / fix, where a ratio means something

    def line(self) -> str:
        """One line for reports/summary.md: "un-cancelled -> cancelled, next job: 12.1 s -> 0.41 s (29x)"."""
        ratio = ""
        if self.ratio and self.ratio.n > 1:
            ratio = f" ({self.ratio.value:.3g}x, 95% CI {self.ratio.low:.3g}-{self.ratio.high:.3g})"
        elif self.ratio:
            ratio = f" ({self.ratio.value:.3g}x)"
        return (
            f"{self.name}, {self.symptom_label} -> {self.fix_label}: "
            f"{_short(self.symptom)} -> {_short(self.fix)}{ratio}"
        )

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "symptom_label": self.symptom_label,
            "fix_label": self.fix_label,
            "symptom": self.symptom.as_dict(),
            "fix": self.fix.as_dict(),
            "ratio": self.ratio.as_dict() if self.ratio else None,
            "line": self.line(),
        }


@dataclass
class ExperimentResult:
    """Raw measurements and what they show, for one investigation on one engine."""

    name: str
    field_reports: tuple[int, ...]
    tables: dict[str, pd.DataFrame]
    effects: list[Effect]
    parameters: dict
    environment: dict
    findings: list[str] = field(default_factory=list)  # plain statements, including where a report is not borne out
    values: dict = field(default_factory=dict)  # further summary numbers, each with its unit in its name or value

    def summary(self) -> dict:
        return {
            "experiment": self.name,
            "field_reports": list(self.field_reports),
            "effects": [e.as_dict() for e in self.effects],
            "values": self.values,
            "findings": self.findings,
            "parameters": self.parameters,
            "environment": self.environment,
            "tables": {name: len(table) for name, table in self.tables.items()},
        }

    def markdown(self) -> str:
        """The effects and findings as Markdown, for the notebook's closing cell."""
        env = self.environment
        lines = [
            f"**{env['engine']} engine**, {env['model']}, {env['device']} ({'paged' if env['paged'] else 'unpaged'})",
            "",
            "| measured | symptom | fix | symptom / fix |",
            "|---|---|---|---|",
        ]
        for e in self.effects:
            ratio = f"{e.ratio.value:.3g}x" if e.ratio else ""
            lines.append(
                f"| {e.name} | {e.symptom_label}: {_short(e.symptom)} | {e.fix_label}: {_short(e.fix)} | {ratio} |"
            )
        lines += ["", *[f"- {finding}" for finding in self.findings]]
        return "\n".join(lines)

    def save(self, out_dir: str | Path, figure=None) -> list[Path]:
        """Write the CSVs, the JSON summary and (given one) the figure; returns the paths written. Each file is
        written whole or not at all, and the summary last: a summary on disk means its tables are there too."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for table_name, table in self.tables.items():
            path = out / f"{self.name}-{table_name}.csv"
            write_atomically(path, table.to_csv(index=False))
            written.append(path)
        if figure is not None:
            path = out / f"{self.name}.png"
            buffer = io.BytesIO()
            figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
            write_atomically(path, buffer.getvalue())
            written.append(path)
        path = out / f"{self.name}.json"
        summary = self.summary() | {"figure": f"{self.name}.png" if figure is not None else None}
        write_atomically(path, json.dumps(summary, indent=2, default=_jsonable) + "\n")
        written.append(path)
        return written


def write_atomically(path: Path, content: str | bytes) -> None:
    """Write to a temporary file beside `path`, then rename it over `path`: a reader (or a later run) sees the
    old file or the new one, never one cut short by a crash or a kill mid-write."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if isinstance(content, bytes):
            temporary.write_bytes(content)
        else:
            temporary.write_text(content)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def read_summary(path: Path) -> tuple[dict | None, str | None]:
    """A notebook's JSON summary, or why there is none: missing, or cut short (a run killed while writing it)."""
    if not path.exists():
        return None, f"the notebook ran but wrote no {path.name}"
    try:
        return json.loads(path.read_text()), None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return None, f"{path} is not valid JSON ({error})"


def environment(session: Session | None = None) -> dict:
    """Where numbers come from, as every summary and benchmark record says it: the date, Python, the versions of
    the kit's packages and of every registered engine's library, the commit, the machine's device and driver and
    how busy it was (a busy 2-core machine halves what torch gets); with a session, what it has loaded (engine,
    model, the device it runs on, attention, cache, notes)."""
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in dict.fromkeys([*KIT_PACKAGES, *engine_libraries()])},
        "exlnb_commit": git_commit(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0],
        **_device_and_driver(),
    }
    if session is not None:
        status = session.status()
        record |= {
            "engine": status.engine,
            "model": status.model,
            "device": status.device,
            "paged": status.paged,
            "attention": status.attention,
            "cache_tokens": status.cache_tokens,
            "max_batch_size": status.max_batch_size,
            "engine_notes": list(status.notes),
        }
    return record


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _device_and_driver() -> dict:
    """The machine's GPU and its driver, or its CPU and the threads torch uses."""
    import torch

    if not torch.cuda.is_available():
        return {"device": f"cpu: {_cpu_model()}, {torch.get_num_threads()} threads", "driver": None}
    driver = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
    ).stdout.strip()
    return {"device": torch.cuda.get_device_name(), "driver": driver}


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _short(estimate: Estimate) -> str:
    """ "0.41 s [0.38-0.45]", "44% [23%-67%]"; a single measurement has no interval to show."""
    if estimate.unit == "fraction":
        value, interval = f"{estimate.value:.0%}", f" [{estimate.low:.0%}-{estimate.high:.0%}]"
    else:
        unit = f" {estimate.unit}" if estimate.unit else ""
        value, interval = f"{estimate.value:.3g}{unit}", f" [{estimate.low:.3g}-{estimate.high:.3g}]"
    return value + (interval if estimate.n > 1 else "")


def git_commit() -> str | None:
    """The commit of the code that ran, `-dirty` where the working tree differs from it (a copy of the tree
    on another machine may carry an older `.git`); outside a git checkout, what `EXLNB_COMMIT` says (a copy
    sent to a bare machine without its `.git`), else None."""
    named = os.environ.get("EXLNB_COMMIT") or None
    try:
        result = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
        )
    except FileNotFoundError:  # no git on this machine
        return named
    return result.stdout.strip() or named


def _jsonable(value):
    """numpy scalars and similar: JSON has no type for them."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
