"""docs/bad-inputs.md is what the code does: every row is run again and the table must come out the same, each
row a one-line message, and the session still answering after each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_bad_input_table_matches_the_code_and_every_row_is_one_line_and_harmless():
    table = (ROOT / "docs" / "bad-inputs.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| `")]

    assert len(rows) >= 25
    assert all(line.endswith("| yes |") or line.endswith("| yes (nothing was loaded) |") for line in rows), rows
    assert "TRACEBACK" not in table and "(no error)" not in table

    checked = subprocess.run([sys.executable, "docs/bad_inputs.py", "--check"], cwd=ROOT, capture_output=True,
                             text=True, timeout=600)
    assert checked.returncode == 0, checked.stderr[-2000:]
