"""The core suite runs in quick mode and writes a complete, valid record (no timing assertions); every suite is
reached through one entry, and a GPU suite refuses cleanly where it cannot run; results stay light."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.__main__ import SUITES
from benchmarks.core import main
from benchmarks.table import full_runs, markdown


def _reject_non_json(name: str):
    raise ValueError(f"{name} in the record: Python writes it, strict JSON readers refuse it")


@pytest.mark.slow  # every benchmark in quick mode, the Hugging Face reference model too
def test_quick_benchmarks_write_valid_json_with_raw_samples(cpu_session, tmp_path):
    path = main(["--quick", "--out", str(tmp_path)])
    record = json.loads(path.read_text(), parse_constant=_reject_non_json)

    env = record["environment"]
    assert env["versions"]["torch"] and env["device"].startswith("cpu") and env["date"]
    assert set(record["benchmarks"]) == {"kit", "peer", "context", "concurrency"}
    assert record["skipped"] == {"hardware": "needs the ExLlamaV2 engine on CUDA"}
    plan = record["plan"]
    kit = record["benchmarks"]["kit"]
    for side in ("session", "raw"):
        stats = kit[side]["decode_tokens_per_s"]
        assert len(stats["samples"]) == plan["repeats"]
        assert all(math.isfinite(s) and s > 0 for s in stats["samples"])
        assert stats["min"] <= stats["median"] <= stats["max"]
    assert "skipped" in kit["magic"] or len(kit["magic"]["magic_cell_s"]["samples"]) == plan["repeats"]
    peer = record["benchmarks"]["peer"]
    assert math.isfinite(peer["ratio_decode_engine_over_hf"]) and math.isfinite(peer["ratio_prefill_engine_over_hf"])
    assert peer["engine_profile"]["top_operators"], "the profiler saw no operator in a decode step"
    assert [row["context_tokens"] for row in record["benchmarks"]["context"]["rows"]] == plan["context_lengths"]
    assert set(record["benchmarks"]["concurrency"]["aggregate_tokens_per_s"]) == {str(n) for n in plan["concurrency"]}
    assert all(b["elapsed_s"] > 0 for b in record["benchmarks"].values())
    assert (tmp_path / f"{path.stem}-context.png").stat().st_size > 1000


def test_the_kit_overhead_benchmark_writes_per_token_times_of_both_sides(tmp_path):
    from benchmarks.kit_overhead import main as kit_overhead

    path = kit_overhead(["--step-ms", "0", "2", "--tokens", "12", "--repeats", "2", "--out", str(tmp_path)])
    record = json.loads(path.read_text(), parse_constant=_reject_non_json)

    assert [r["step_ms"] for r in record["results"]] == [0, 2]
    for result in record["results"]:
        times = result["ms_per_token"]
        assert all(len(times[side]["samples"]) == 2 for side in ("session", "by_hand"))
        # by hand, on the engine thread, each token is one step: a step that holds the GIL for 2 ms takes 2 ms at least
        assert all(t >= 0.99 * result["step_ms"] for t in times["by_hand"]["samples"])
        assert all(math.isfinite(t) and t > 0 for t in times["session"]["samples"])
        assert times["session_cost_per_token_ms"] == times["session"]["median"] - times["by_hand"]["median"]


def test_a_second_run_of_the_same_day_keeps_the_first_runs_file(tmp_path):
    from benchmarks.kit_overhead import main as kit_overhead

    arguments = ["--step-ms", "0", "--tokens", "4", "--repeats", "1", "--out", str(tmp_path)]
    first = kit_overhead(arguments)
    written = first.read_bytes()
    second = kit_overhead(arguments)

    assert second != first and second.name == f"{first.stem}-2.json"
    assert first.read_bytes() == written
    assert json.loads(second.read_text())["results"]


def test_performance_table_reads_every_full_run_ratios_first(tmp_path):
    committed = full_runs()
    assert committed, "benchmarks/results holds no full run"
    table = markdown(committed)
    assert table.startswith("| ratio")
    for run in committed:
        assert run["file"] in table


def _benchmarks(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *arguments],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
        timeout=120,
    )


def test_one_entry_names_every_suite_and_refuses_an_unknown_one_in_one_line():
    listed = _benchmarks("--help")
    refused = _benchmarks("graph_probe")

    assert listed.returncode == 0 and all(f"  {suite} " in listed.stdout for suite in SUITES)
    assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [
        f"python -m benchmarks: no suite 'graph_probe'; choose one of {', '.join(SUITES)}"
    ]


def test_the_gemv_sweep_refuses_an_unknown_part_and_a_decode_option_it_sets_itself(tmp_path, monkeypatch):
    """`--only` names the sweeps to run; a name not among them, and an environment that would stand in for the
    options the sweep sets, are refused in one line before any GPU work."""
    unknown = _benchmarks("gemv-sweep", "--only", "attention,graphs", "--out", str(tmp_path / "out"))
    assert unknown.returncode == 2 and "--only attention,graphs: each must be one of products, attention, batched" in (
        unknown.stderr
    )
    if torch.cuda.is_available():
        monkeypatch.setenv("EXLNB_DECODE_FRESH_APART", "1")
        set_here = _benchmarks("gemv-sweep", "--only", "attention", "--out", str(tmp_path / "out"))
        assert set_here.returncode == 2 and "unset EXLNB_DECODE_FRESH_APART" in set_here.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the suite runs instead of refusing")
@pytest.mark.parametrize(
    ("suite", "says"),
    [
        ("graphs", "needs a CUDA GPU and exllamav2 and exllamav3"),
        ("gemv-sweep", "needs a CUDA GPU"),
        ("norm-product-sweep", "needs a CUDA GPU"),
    ],
)
def test_a_gpu_suite_refuses_in_one_line_without_cuda_and_writes_nothing(tmp_path, suite, says):
    done = _benchmarks(suite, "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert says in done.stderr
    assert done.stdout == ""
    assert not (tmp_path / "out").exists()


def test_the_graph_benchmark_judges_each_goal_of_issue_17_by_its_own_threshold():
    from benchmarks.graphs import goals

    def rows(over_floor, speedup, over_transformers):
        return {
            "7b-shaped": {"exllamav2": {"graphs_over_floor": over_floor}},
            "bundled": {"exllamav2": {"speedup_batch_1": speedup, "graphs_over_transformers_best": over_transformers}},
        }

    met = goals(rows(1.5, 3.0, 2.0))
    missed = goals(rows(1.51, 2.99, 1.99))
    assert (
        set(met)
        == set(missed)
        == {
            "7b_batch_1_over_floor_at_most_1.5",
            "bundled_batch_1_speedup_at_least_3",
            "engine_over_transformers_best_at_least_2",
        }
    )
    assert all(goal["met"] for goal in met.values())
    assert not any(goal["met"] for goal in missed.values())
    assert missed["7b_batch_1_over_floor_at_most_1.5"]["ratio"] == 1.51
    assert "engine_over_transformers_best_at_least_2" not in goals({"bundled": {"exllamav2": {"speedup_batch_1": 4.0}}})


RESULTS_BUDGET_BYTES = 3 * 1024 * 1024  # what a clone carries; raw logs and notebooks stay on the measuring machine


def test_the_results_git_carries_stay_under_3_mb():
    root = Path(__file__).parent.parent
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "benchmarks/results"],
        capture_output=True,
        text=True,
        cwd=root,
        check=True,
        timeout=60,
    ).stdout.splitlines()
    files = [root / name for name in listed if (root / name).is_file()]
    assert files, "benchmarks/results holds no result"
    sizes = sorted(((f.stat().st_size, f) for f in files), reverse=True)
    total = sum(size for size, _ in sizes)
    assert total <= RESULTS_BUDGET_BYTES, f"{total / 2**20:.1f} MB tracked; largest: {sizes[:5]}"


def test_the_tensor_parallel_check_predicts_from_the_all_reduce_and_reads_the_all_reduce_off_a_measured_split():
    from benchmarks import allreduce
    from benchmarks.multigpu import cards_of, layouts

    # 10 ms on one card, two cards, 64 all-reduces of 25 us: 5 ms of work + 1.6 ms of all-reduces
    assert allreduce.predicted_speedup(10.0, 2, 25.0, 64) == pytest.approx(10 / 6.6)
    assert allreduce.implied_allreduce_us(10.0, 6.6, 2, 64) == pytest.approx(25.0)
    ways = layouts(4, 80, 13.5, ("native", "nccl"))
    assert list(ways) == ["one_card", "split2", "tp2", "tp2-nccl", "tp4", "tp4-nccl"]
    assert ways["tp4-nccl"] == dict(ways["tp4"], tp_backend="nccl") and "tp_backend" not in ways["tp2"]
    assert [cards_of(name) for name in ways] == [None, None, 2, 2, 4, 4]
    measured = {
        "one_card": {"batch1_tokens_per_s": 100.0, "batch8_tokens_per_s": 500.0},
        "tp2-nccl": {"batch1_tokens_per_s": 1000 / 6.6, "batch8_tokens_per_s": 600.0},
        "split2": {"batch1_tokens_per_s": 90.0},
    }
    check = allreduce.check(measured, layers=32, cards_of={"tp2-nccl": 2}, nccl_us={2: {"batch1": 25.0}})
    assert list(check) == ["tp2-nccl"]
    row = check["tp2-nccl"]
    assert row["measured_speedup_batch1"] == pytest.approx(10 / 6.6) == row["predicted_speedup_batch1"]
    assert row["implied_allreduce_us"] == pytest.approx(25.0) and row["measured_speedup_batch8"] == pytest.approx(1.2)
