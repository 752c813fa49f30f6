"""The disconnect notebook under papermill: exlnb's own engine (the control) beside a real `transformers serve`."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import papermill
import pytest

from exlnb.experiments.disconnect import PHASES

pytest_plugins = ["tests.servers"]
pytestmark = pytest.mark.slow  # starts real servers

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "disconnect.ipynb"


def test_the_disconnect_notebook_measures_a_server_beside_the_control(transformers_server, tmp_path):
    papermill.execute_notebook(
        str(NOTEBOOK),
        str(tmp_path / "disconnect.ipynb"),
        kernel_name="python3",
        progress_bar=False,
        parameters=dict(
            engine="cpu",
            cache_tokens=2048,
            output_dir=str(tmp_path),
            url=transformers_server,
            abandoned=1,
            probes=1,
            max_new_tokens=48,
            prefill_prompt_tokens=256,
            settle_timeout_s=20.0,
        ),
    )
    phases = pd.read_csv(tmp_path / "disconnect-phases.csv")
    targets = ["exlnb cpu", "transformers server"]
    assert sorted(zip(phases.target, phases.phase)) == sorted((t, p) for t in targets for p in PHASES)
    assert (phases.probe_ttft_s > 0).all() and (phases.idle_ttft_s > 0).all()
    summary = json.loads((tmp_path / "disconnect.json").read_text())
    for target in targets:
        for phase in PHASES:
            assert any(f.startswith(f"{target}, abandoned while {phase}: ") for f in summary["findings"])
    assert (tmp_path / "disconnect.png").stat().st_size > 0
