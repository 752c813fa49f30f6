"""benchmarks/gpu_acceptance.sh's `collect` stage, run as a GPU session runs it, on folders made here: on a machine
lent afresh it says so in a line at once instead of waiting out its time; on the machine that ran setup it waits for
the run's end and packs the results, leaving the JUnit XML and pip lists out."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "gpu_acceptance.sh"


def collect(work: Path, dest: Path, seconds: int = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, EXLNB_GPU_WORK=str(work))
    return subprocess.run(
        ["bash", str(SCRIPT), "collect", str(seconds), str(dest)], capture_output=True, text=True, env=env, timeout=30
    )


def test_collect_on_a_machine_lent_afresh_says_so_at_once(tmp_path):
    done = collect(tmp_path / "work", tmp_path / "dest")
    assert done.returncode == 3
    assert done.stdout.strip().splitlines() == [
        f"nothing of a run is here ({tmp_path / 'work' / 'out' / 'progress.txt'} is missing): "
        "this is not the machine that ran setup"
    ]
    assert not (tmp_path / "dest").exists()


def test_collect_packs_a_finished_run_without_its_xml_and_pip_lists(tmp_path):
    out = tmp_path / "work" / "out"
    (out / "speed").mkdir(parents=True)
    (out / "progress.txt").write_text("07:39:10 setup done\n")
    (out / "speed" / "speed.json").write_text("{}")
    (out / "pytest-gpu-exllamav2.xml").write_text("<testsuite/>")
    (out / "pip-list.txt").write_text("torch 2.11.0\n")
    (out / "DONE").write_text("")

    done = collect(tmp_path / "work", tmp_path / "dest")

    assert done.returncode == 0 and "setup done" in done.stdout
    with tarfile.open(tmp_path / "dest" / "results.tar.gz") as packed:
        names = {Path(name).as_posix().removeprefix("./") for name in packed.getnames()}
    assert {"progress.txt", "speed/speed.json", "DONE"} <= names
    assert not any(name.endswith(".xml") or name.startswith("pip-list") for name in names)
