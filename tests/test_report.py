"""The main command's options: presets, overrides, the summary of failed runs, publishing results.

Running the notebooks themselves is tests/test_notebooks.py's job (once per test session).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exlnb import report
from exlnb.experiments.notebooks import NOTEBOOKS, notebook_parameters
from exlnb.report import NotebookRun, _overrides, earlier_runs, main, publish, summary_markdown

nbformat = pytest.importorskip(
    "nbformat", reason="the notebook tests need the notebook stack: pip install -e '.[test]'"
)

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"


def test_set_overrides_a_preset_with_python_literals():
    overrides = _overrides("full", ["latency.requests=3", "concurrency.concurrency=[2, 4]"], ["latency", "concurrency"])

    assert overrides["latency"]["requests"] == 3
    assert overrides["latency"]["max_new_tokens"] == 200  # from the preset
    assert overrides["concurrency"]["concurrency"] == [2, 4]


@pytest.mark.parametrize(
    "assignment, message",
    [
        ("latency.requests", "NAME.PARAMETER=VALUE"),
        ("nosuch.x=1", "NAME.PARAMETER=VALUE"),
        ("context.turns=3", "--only"),
    ],
)
def test_a_malformed_or_unused_override_says_what_to_write(assignment, message):
    with pytest.raises(SystemExit, match=message):
        _overrides(None, [assignment], ["latency"])


def test_an_unknown_parameter_is_refused_naming_the_valid_ones(tmp_path, capsys):
    with pytest.raises(SystemExit, match="latency notebook has no parameter 'nonsense'") as refused:
        main(["--out", str(tmp_path), "--only", "latency", "--set", "latency.nonsense=3"])

    valid = "its parameters are engine, cache_tokens, output_dir, requests, tokens_read, max_new_tokens"
    assert valid in str(refused.value)
    assert list(tmp_path.iterdir()) == []  # refused before anything ran


def test_an_unknown_notebook_is_refused_naming_the_valid_ones():
    with pytest.raises(SystemExit, match="NAME one of latency, repetition, prompt_format, concurrency"):
        _overrides(None, ["nonsense.requests=3"], ["latency"])


def test_every_preset_parameter_is_one_its_notebook_takes(monkeypatch):
    assert _overrides("full", [], list(NOTEBOOKS)).keys() == report.PRESETS["full"].keys()

    monkeypatch.setitem(report.PRESETS, "full", {"concurrency": {"prompt": 16}})
    with pytest.raises(SystemExit, match="--preset full: the concurrency notebook has no parameter 'prompt'"):
        _overrides("full", [], list(NOTEBOOKS))


def test_notebook_parameters_are_the_run_signature_after_engine_cache_and_output():
    assert notebook_parameters("concurrency") == {
        "engine": "auto",
        "cache_tokens": 8192,
        "output_dir": "results",
        "prompts": 8,
        "max_new_tokens": 32,
        "concurrency": (2, 4, 8),
    }
    assert notebook_parameters("latency")["cache_tokens"] == 1024


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_each_notebook_declares_exactly_its_parameters_with_their_defaults(name):
    notebook = nbformat.read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)
    cell = next(c for c in notebook.cells if "parameters" in c.metadata.get("tags", []))
    declared: dict = {}
    exec(cell.source, {}, declared)

    assert declared == notebook_parameters(name), "rebuild the notebooks: python notebooks/build_notebooks.py"


def test_a_failed_notebook_is_reported_in_the_summary_not_hidden():
    text = summary_markdown([NotebookRun("latency", 12.0, None, "ValueError: boom (see x.ipynb)")])

    assert "## latency (12 s)" in text
    assert "FAILED: ValueError: boom" in text


def test_publish_copies_summaries_tables_and_figures_but_not_notebooks(tmp_path):
    out = tmp_path / "reports"
    (out / "latency").mkdir(parents=True)
    summary = {"environment": {"engine": "cpu"}, "effects": [], "findings": [], "field_reports": [1]}
    for name in ("latency.json", "latency-requests.csv", "latency.png", "latency.ipynb", "latency.html"):
        (out / "latency" / name).write_text(json.dumps(summary))

    target = publish([NotebookRun("latency", 1.0, summary)], out, tmp_path / "results")

    assert sorted(p.name for p in target.iterdir()) == ["latency-requests.csv", "latency.json", "latency.png"]


def test_runs_split_with_only_add_up_to_one_summary(tmp_path):
    summary = {
        "environment": {
            "engine": "cpu",
            "model": "m",
            "device": "cpu",
            "paged": True,
            "attention": "a",
            "versions": {},
        },
        "effects": [{"line": "next job: 17.9 s -> 1.33 s"}],
        "findings": [],
        "field_reports": [1],
    }
    (tmp_path / "latency").mkdir()
    (tmp_path / "latency" / "latency.json").write_text(json.dumps(summary))

    earlier = earlier_runs(tmp_path, skip=["context"])
    text = summary_markdown([NotebookRun("context", 5.0, None, "boom"), *earlier])

    assert [run.name for run in earlier] == ["latency"]
    assert text.index("## latency (from an earlier run)") < text.index("## context (5 s)")
    assert "- next job: 17.9 s -> 1.33 s" in text


def test_a_notebook_that_answers_no_field_report_names_none():
    summary = {
        "environment": {
            "engine": "cpu",
            "model": "m",
            "device": "cpu",
            "paged": True,
            "attention": "a",
            "versions": {},
        },
        "effects": [],
        "findings": ["fp16: perplexity 3.04"],
        "field_reports": [],
    }
    text = summary_markdown([NotebookRun("quantization", 73.0, summary)])

    assert "Field report" not in text and "- fp16: perplexity 3.04" in text


def _tiny_notebook(folder: Path, name: str) -> None:
    """A notebook with the report's parameters that writes its summary, then fails where told to: a run that
    dies half-way, as one killed or crashed mid-notebook does."""
    from nbformat.v4 import new_code_cell, new_notebook

    parameters = new_code_cell('engine = "auto"\noutput_dir = "results"\nmark = "first"\nfail = False')
    parameters.metadata["tags"] = ["parameters"]
    body = new_code_cell(
        "import json, pathlib\n"
        f"pathlib.Path(output_dir, '{name}.json').write_text(json.dumps({{'mark': mark, 'environment': {{}}}}))\n"
        "assert not fail, 'stopped half-way'"
    )
    notebook = new_notebook(cells=[parameters, body])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, folder / f"{name}.ipynb")


def test_a_run_that_fails_half_way_keeps_the_last_complete_result(tmp_path, monkeypatch):
    notebooks, out = tmp_path / "notebooks", tmp_path / "reports"
    notebooks.mkdir()
    _tiny_notebook(notebooks, "latency")
    monkeypatch.setattr(report, "NOTEBOOK_DIR", notebooks)

    good = report.run_notebook("latency", out, engine="cpu", parameters={"mark": "complete"})
    bad = report.run_notebook("latency", out, engine="cpu", parameters={"mark": "partial", "fail": True})

    assert good.error is None and good.summary["mark"] == "complete"
    assert "stopped half-way" in bad.error and f"the last complete run is still in {out / 'latency'}" in bad.error
    assert json.loads((out / "latency" / "latency.json").read_text())["mark"] == "complete"
    kept = (out / "latency" / "latency.ipynb").read_text()
    assert '"complete"' in kept and "AssertionError" not in kept
    assert (out / "latency" / "latency.html").exists()
    assert "AssertionError" in (out / "failed" / "latency" / "latency.ipynb").read_text()


def test_an_executed_notebook_records_no_path_of_the_machine_that_ran_it(tmp_path, monkeypatch):
    notebooks, out = tmp_path / "notebooks", tmp_path / "reports"
    notebooks.mkdir()
    _tiny_notebook(notebooks, "latency")
    monkeypatch.setattr(report, "NOTEBOOK_DIR", notebooks)

    assert report.run_notebook("latency", out, engine="cpu", parameters={}).error is None
    executed = (out / "latency" / "latency.ipynb").read_text()
    assert str(tmp_path) not in executed
    assert "running over TCP without encryption" not in executed


def test_a_truncated_earlier_summary_is_skipped_with_one_line_naming_it(tmp_path, capsys):
    for name, text in (
        ("latency", '{"environment": {"engine": "cp'),
        (
            "streaming",
            json.dumps(
                {
                    "environment": {
                        "engine": "cpu",
                        "model": "m",
                        "device": "cpu",
                        "paged": True,
                        "attention": "a",
                        "versions": {},
                        "date": "2026-11-20T10:00:00+00:00",
                    },
                    "effects": [],
                    "findings": [],
                    "field_reports": [3],
                }
            ),
        ),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.json").write_text(text)

    earlier = earlier_runs(tmp_path, skip=[])

    assert [run.name for run in earlier] == ["streaming"]
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "latency" in line and "latency.json is not valid JSON" in line
    assert "## streaming (from an earlier run, 2026-11-20T10:00:00+00:00)" in summary_markdown(earlier)


def test_a_figure_that_fails_mid_write_leaves_the_previous_files_whole(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from exlnb.experiments.record import ExperimentResult

    figure = plt.figure()
    figure.add_subplot().plot([1, 2], [3, 4])
    result = ExperimentResult(
        name="latency",
        tables={"requests": pd.DataFrame({"a": [1]})},
        effects=[],
        findings=["first"],
        parameters={},
        environment={},
        field_reports=[1],
    )
    result.save(tmp_path, figure)
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}

    class CutShort:
        def savefig(self, target, **_):
            target.write(b"\x89PNG half")
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        result.save(tmp_path, CutShort())

    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before
