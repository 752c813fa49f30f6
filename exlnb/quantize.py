"""Quantizing a model from a notebook with each library's own converter: EXL2 (exllamav2) or EXL3 (exllamav3).

The converter runs in a subprocess, its output feeds a progress bar, and the result is kept in the exlnb
cache, keyed by source model, format, bits and head bits, so asking again returns the folder at once.
Both converters resume an interrupted job from their work directory, which is kept in the cache beside the
output until the job finishes: exllamav2 0.3.2's `convert_exl2` resumes by itself when the work directory
holds `job_new.json`; exllamav3 1.6.5's `convert_model` resumes with `-w WORK -r` (its `args.json`).
Neither reports failure in its exit status (both print "## Error"/"!! Error" and exit 0), so a run counts
as done only when the output's config.json names the format.
EXL2 spends most of a conversion measuring how much each layer suffers at each setting, which does not depend
on the target bits: the first EXL2 conversion of a model keeps its `measurement.json` in the cache and later
ones, at other bit widths, reuse it (`convert_exl2 -m`).
"""

from __future__ import annotations

import collections
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock
from tqdm.auto import tqdm

from exlnb.engines.formats import model_format
from exlnb.engines.registry import engines_loading
from exlnb.models import BUNDLED_MODEL, cache_root, resolve_model

QUANT_FORMATS = ("exl2", "exl3")
DEFAULT_FORMAT = "exl3"
DEFAULT_BITS = 4.0
DEFAULT_HEAD_BITS = 6  # both converters' default for the output layer
EXL2_HEAD_BITS = (2, 3, 4, 5, 6, 8)  # exllamav2 0.3.2 conversion/qparams.py: qparams_headoptions
EXL3_CONVERTER = "exlnb.engines.exllamav3.compat"  # exllamav3's convert_model, with exlnb's fix for padded MLPs
EXL3_HEAD_BITS = (1, 2, 3, 4, 5, 6, 7, 8, 16)  # exllamav3 1.6.5 convert_model.prepare: 1-8, or 16 unquantized
BITS_RANGE = {
    "exl2": (2.0, 8.0),
    "exl3": (1.0, 8.0),
}  # convert_exl2 warns outside 2-8; convert_model refuses outside 1-8
ERROR_LINE = re.compile(r"^\s*(##|!! Error|\*\* Error)")
EXL2_STATUS = re.compile(r"\[STATUS\](.*)\[/STATUS\]")  # convert_exl2 -so (bot_status.print_stage)
EXL3_MODULE = re.compile(r"Loading unquantized module: \S*layers\.(\d+)")
EXL3_COMPILING = re.compile(r"-- (Creating directory|Writing into) ")  # exllamav3 conversion/compile.py


@dataclass(frozen=True)
class QuantizedModel:
    """Where one quantization of one model lives in the cache."""

    source: Path
    format: str
    bits: float
    head_bits: int

    @property
    def folder(self) -> Path:
        return self._source_stem.with_name(f"{self._source_stem.name}-{self.format}-{self.bits:g}bpw-h{self.head_bits}")

    @property
    def measurement(self) -> Path:
        """exllamav2's per-layer measurement of the source model, shared by its EXL2 conversions at any bits."""
        return self._source_stem.with_name(f"{self._source_stem.name}-exl2-measurement.json")

    @property
    def _source_stem(self) -> Path:
        digest = hashlib.sha256(str(self.source.resolve()).encode()).hexdigest()[:8]
        return cache_root() / "quantized" / f"{self.source.name}-{digest}"

    @property
    def output(self) -> Path:
        return self.folder / "model"

    @property
    def work(self) -> Path:
        return self.folder / "work"

    @property
    def partial(self) -> Path:
        """The converter writes here; renamed to `output` once finished, so `output` is always whole."""
        return self.folder / "model.partial"


def check_arguments(format: str, bits: float, head_bits: int | None) -> int:
    """Refuse what the chosen converter would refuse, before anything starts; returns the head bits."""
    if format not in QUANT_FORMATS:
        raise ValueError(f"format={format!r}: choose one of {', '.join(QUANT_FORMATS)}")
    low, high = BITS_RANGE[format]
    if not low <= bits <= high:
        raise ValueError(f"bits={bits} is out of range for {format.upper()}: give {low:g} to {high:g} bits per weight")
    head = DEFAULT_HEAD_BITS if head_bits is None else head_bits
    allowed = EXL2_HEAD_BITS if format == "exl2" else EXL3_HEAD_BITS
    if head not in allowed:
        raise ValueError(
            f"head_bits={head} is not one {format.upper()} offers: choose one of {', '.join(map(str, allowed))}"
        )
    return head


def quantize(
    model: str | os.PathLike = BUNDLED_MODEL,
    format: str = DEFAULT_FORMAT,
    bits: float = DEFAULT_BITS,
    head_bits: int | None = None,
    *,
    progress: bool = True,
) -> Path:
    """Quantize an unquantized model to EXL2 or EXL3 at `bits` per weight and return the quantized folder.

    A finished quantization is returned from the cache at once; an interrupted one resumes. Load the result
    with `get_session().load(folder)` or `%exl_load FOLDER`: `engine="auto"` picks the matching engine.
    """
    head = check_arguments(format, bits, head_bits)
    source = resolve_model(model, progress=progress)
    if (fmt := model_format(source)) != "hf":
        raise ValueError(f"{source} is already {fmt.upper()}: quantize the unquantized (fp16) model instead")
    target = QuantizedModel(source, format, float(bits), head)
    if _finished(target.output, format):
        return target.output
    _check_converter(format)
    target.folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.folder) + ".lock"):  # two kernels asking at once convert once
        if not _finished(target.output, format):
            _convert(target, progress=progress)
    return target.output


def _finished(folder: Path, format: str) -> bool:
    config = folder / "config.json"
    if not config.is_file():
        return False
    return (json.loads(config.read_text()).get("quantization_config") or {}).get("quant_method") == format


def _check_converter(format: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("quantizing needs CUDA: the converters run on the GPU; quantize on a GPU machine")
    # the converter is the library of the engine that loads the format (registry.py)
    library = next(spec.library for spec in engines_loading(format) if spec.library)
    needed = [library] + (["fastparquet"] if format == "exl2" else [])  # convert_exl2 imports fastparquet
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(
            f"quantizing to {format.upper()} needs {' and '.join(missing)}: pip install {' '.join(missing)}"
        )


def converter_command(target: QuantizedModel) -> list[str]:
    """The converter's command line; a work directory that holds a started job resumes it."""
    if target.format == "exl2":
        reuse = ["-m", str(target.measurement)] if target.measurement.is_file() else []
        return [
            sys.executable,
            "-m",
            "exllamav2.conversion.convert_exl2",
            "-i",
            str(target.source),
            "-o",
            str(target.work),
            "-cf",
            str(target.partial),
            "-b",
            f"{target.bits:g}",
            "-hb",
            str(target.head_bits),
            "-so",
            *reuse,
        ]
    if (target.work / "args.json").is_file():
        return [sys.executable, "-m", EXL3_CONVERTER, "-w", str(target.work), "-r"]
    return [
        sys.executable,
        "-m",
        EXL3_CONVERTER,
        "-i",
        str(target.source),
        "-o",
        str(target.partial),
        "-w",
        str(target.work),
        "-b",
        f"{target.bits:g}",
        "-hb",
        str(target.head_bits),
    ]


def progress_of(line: str, format: str, num_layers: int) -> tuple[str, float] | None:
    """(stage, fraction of it done) from one converter output line, or None for a line that says neither."""
    if format == "exl2":
        if match := EXL2_STATUS.search(line):
            status = json.loads(match.group(1))
            return status["stage"], float(status["completion"])
        return None
    if match := EXL3_MODULE.search(line):
        return "Quantizing", min(1.0, (int(match.group(1)) + 1) / num_layers)
    if EXL3_COMPILING.search(line):
        return "Compiling", 0.0
    return None


def _convert(target: QuantizedModel, *, progress: bool) -> None:
    if not _finished(target.partial, target.format):  # finished before a crash that came before the rename
        _run_converter(target, progress=progress)
    shutil.rmtree(target.output, ignore_errors=True)
    target.partial.rename(target.output)
    measured = target.work / "measurement.json"  # exllamav2 writes it there after measuring
    if target.format == "exl2" and measured.is_file() and not target.measurement.is_file():
        # EXL2 conversions at other bits may finish at the same time, each with a measurement: a temporary name
        # of this folder's own, then an atomic replace, so that none of them can take another's half-copied file
        partial = target.measurement.with_name(f"{target.folder.name}.measurement.partial")
        shutil.copyfile(measured, partial)
        os.replace(partial, target.measurement)
    shutil.rmtree(target.work, ignore_errors=True)  # as large as the model; the finished output no longer needs it


def _run_converter(target: QuantizedModel, *, progress: bool) -> None:
    num_layers = json.loads((target.source / "config.json").read_text()).get("num_hidden_layers", 1)
    command = converter_command(target)
    bar = tqdm(total=100, desc=f"exlnb: {target.format.upper()} {target.bits:g} bpw", unit="%", disable=not progress)
    tail: collections.deque[str] = collections.deque(maxlen=30)
    errors = []
    log_path = target.folder / "convert.log"
    with (
        log_path.open("a") as log,
        subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        ) as process,
    ):
        for line in process.stdout:
            log.write(line)
            tail.append(line.rstrip())
            if ERROR_LINE.match(line):
                errors.append(line.strip())
            if (state := progress_of(line, target.format, num_layers)) is not None:
                stage, fraction = state
                bar.set_postfix_str(stage)
                bar.n = round(100 * fraction)
                bar.refresh()
    bar.close()
    if process.returncode != 0 or errors or not _finished(target.partial, target.format):
        reason = errors[-1] if errors else f"exit status {process.returncode}"
        raise RuntimeError(
            f"the {target.format.upper()} converter stopped without finishing ({reason}); the full output is in "
            f"{log_path}. Run the same quantize() again to resume. Last lines:\n" + "\n".join(tail)
        )
