"""Wheels for a CUDA machine with no package index: what exlnb's GPU runs import, for CPython 3.12 on manylinux
x86_64, less what that machine already has.

    python -m benchmarks.gpu_wheels --have HAVE --out DIR

HAVE lists the packages the GPU machine holds, a name first on each line (`python3 -m pip list` or `pip freeze`
there, or a list of names). exlnb's own requirements come from pyproject.toml (its dependencies and the extras
`GPU_EXTRAS`), less `NOT_ON_THE_GPU`; each wheel's own requirements are followed the same way. One wheel a
package, so that `pip install --no-index --no-deps --target` takes them all (two of one package stop it). The
directory then goes to `benchmarks/gpu_acceptance.sh setup` (docs/gpu.md, "Running the GPU acceptance").
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
GPU_EXTRAS = ("test", "exllamav3", "quantize-exl2")  # the GPU suites, exllamav3, EXL2 conversion
# never imported on the GPU machine: torch is there already; the browser test, the linter and the llama.cpp and
# transformers servers of the remote engine's tests run on CPU hosts; JupyterLab serves only the browser test
NOT_ON_THE_GPU = {"torch", "playwright", "ruff", "llama-cpp-python", "jupyterlab"}
TARGET = {  # the GPU machine's interpreter, for requirement markers
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
}
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64"]


def name_of(text: str) -> str:
    """A package's name as pip compares them."""
    return re.sub(r"[-_.]+", "-", text.strip().lower())


def names_in(listing: str) -> set[str]:
    """The package names of a `pip list` / `pip freeze` / one-name-a-line listing."""
    names = set()
    for line in listing.splitlines():
        first = re.split(r"[\s=<>@;\[]", line.strip(), maxsplit=1)[0]
        if first and not set(first) <= {"-"} and first.lower() != "package":
            names.add(name_of(first))
    return names


def applies(requirement: Requirement, extras: set[str]) -> bool:
    """Whether a requirement holds on the GPU machine, for a package asked for with these extras."""
    if requirement.marker is None:
        return True
    environment = default_environment() | TARGET
    return any(requirement.marker.evaluate(environment | {"extra": extra}) for extra in extras or {""})


def exlnb_requirements(pyproject: str, have: set[str]) -> list[Requirement]:
    """exlnb's dependencies and its GPU extras, less what the machine has and what the GPU runs never import."""
    import tomllib

    project = tomllib.loads(pyproject)["project"]
    lines = project["dependencies"] + [line for extra in GPU_EXTRAS for line in project["optional-dependencies"][extra]]
    skipped = have | NOT_ON_THE_GPU
    return [r for r in map(Requirement, lines) if name_of(r.name) not in skipped and applies(r, set())]


def download(requirement: Requirement, out: Path) -> Path:
    """The one wheel pip picks for the GPU machine, without its dependencies."""
    spec = f"{requirement.name}{requirement.specifier}"
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(out)]
    command += ["--python-version", "3.12", "--implementation", "cp", *platforms, spec]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return next(w for w in out.glob("*.whl") if name_of(w.name.split("-")[0]) == name_of(requirement.name))


def requirements_of(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(metadata).decode()
    return [Requirement(line.split(":", 1)[1]) for line in text.splitlines() if line.startswith("Requires-Dist:")]


def gather(wanted: list[Requirement], have: set[str], out: Path) -> dict[str, Path]:
    """Every wheel the wanted packages need on the GPU machine, followed down, one per package."""
    out.mkdir(parents=True, exist_ok=True)
    got: dict[str, Path] = {}
    queue = list(wanted)
    while queue:
        requirement = queue.pop(0)
        name = name_of(requirement.name)
        if name in got or name in have or name in NOT_ON_THE_GPU:
            continue
        got[name] = download(requirement, out)
        print(f"{got[name].name}", flush=True)
        queue += [r for r in requirements_of(got[name]) if applies(r, set(requirement.extras))]
    return got


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_wheels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--have", type=Path, required=True, help="the GPU machine's package list (pip list)")
    parser.add_argument("--out", type=Path, required=True, help="the directory the wheels go to")
    args = parser.parse_args(argv)
    have = names_in(args.have.read_text())
    got = gather(exlnb_requirements(PYPROJECT.read_text(), have), have, args.out)
    size = sum(wheel.stat().st_size for wheel in got.values())
    print(f"{len(got)} wheels, {size / 1e6:.1f} MB, in {args.out}")


if __name__ == "__main__":
    main()
