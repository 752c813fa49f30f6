"""`python -m exlnb.spread`: effects across runs, over the committed CPU results and copies of them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from exlnb.experiments.notebooks import NOTEBOOKS
from exlnb.spread import VERDICTS, effect_key, spread, verdict

REPOSITORY = Path(__file__).parent.parent
CPU_RESULTS = REPOSITORY / "data" / "results" / "cpu"


def runs_with_one_disagreeing(tmp_path: Path) -> tuple[list[Path], str, str]:
    """Three runs: the committed CPU results twice, and a third whose first latency effect was measured with
    the fix's interval moved onto the symptom's (a run that cannot tell them apart)."""
    runs = [tmp_path / f"run{i}" for i in range(3)]
    for run in runs:
        shutil.copytree(CPU_RESULTS, run)
    summary = json.loads((runs[2] / "latency.json").read_text())
    effect = summary["effects"][0]
    effect["fix"]["ci95"] = effect["symptom"]["ci95"]
    effect["fix"]["value"] = effect["symptom"]["value"] * 0.99
    (runs[2] / "latency.json").write_text(json.dumps(summary))
    return runs, "latency", effect_key(effect)


def test_every_effect_gets_its_range_and_the_runs_verdicts(tmp_path):
    runs, notebook, changed = runs_with_one_disagreeing(tmp_path)
    rows = spread(runs)

    committed = {  # each notebook's summary, as spread reads them (a spread-*.json beside them is none)
        (name, effect_key(e)): e
        for name in NOTEBOOKS
        if (CPU_RESULTS / f"{name}.json").exists()
        for e in json.loads((CPU_RESULTS / f"{name}.json").read_text())["effects"]
    }
    assert {(r["notebook"], r["effect"]) for r in rows} == set(committed)
    for row in rows:
        effect = committed[(row["notebook"], row["effect"])]
        assert row["runs"] == 3 and set(row["verdicts"]) <= set(VERDICTS)
        if (row["notebook"], row["effect"]) == (notebook, changed):
            assert row["agree"] is False and row["verdicts"][2] == "overlap"
            assert row["fix"] == sorted([effect["symptom"]["value"] * 0.99, effect["fix"]["value"]])
        else:
            assert row["agree"] is True and row["verdicts"] == [verdict(effect)] * 3
            assert row["symptom"] == [effect["symptom"]["value"]] * 2
        assert row["mixed_setups"] is False


def test_the_command_writes_the_table_and_refuses_in_one_line(tmp_path):
    runs, _, changed = runs_with_one_disagreeing(tmp_path)
    out = tmp_path / "spread.md"
    done = subprocess.run(
        [sys.executable, "-m", "exlnb.spread", *map(str, runs), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=REPOSITORY,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"| latency | {changed} | 3 |" in out.read_text() and "**no**" in out.read_text()
    assert len(json.loads(out.with_suffix(".json").read_text())) == out.read_text().count("\n") - 2

    empty = tmp_path / "empty"
    empty.mkdir()
    refused = subprocess.run(
        [sys.executable, "-m", "exlnb.spread", str(runs[0]), str(empty)],
        capture_output=True,
        text=True,
        cwd=REPOSITORY,
        timeout=120,
    )
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "holds no investigation summary" in refused.stderr


def test_a_truncated_summary_is_skipped_with_one_line_not_a_crash(tmp_path, capsys):
    runs = [tmp_path / f"run{i}" for i in range(2)]
    for run in runs:
        shutil.copytree(CPU_RESULTS, run)
    (runs[1] / "latency.json").write_text('{"effects": [')

    rows = spread(runs)

    assert rows and "latency" not in {row["notebook"] for row in rows}
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "skipping latency" in line and "latency.json is not valid JSON" in line
