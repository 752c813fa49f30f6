"""The disconnect investigation: its verdict from every signal, non-streaming requests left by a client timeout,
the run against a stand-in server that works on for nobody (and one that stops), and the notebook under
papermill with exlnb's own engine (the control) beside real servers in each mode."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pandas as pd
import papermill
import pytest

from benchmarks.disconnect import verdicts as benchmark_verdicts
from benchmarks.local_servers import LocalServer, free_port, server_process
from exlnb.datasets import filler_ids
from exlnb.engines.job_options import JobOptions
from exlnb.experiments import disconnect, whole_answers
from exlnb.experiments.disconnect import PHASES, REQUESTS
from exlnb.experiments.disconnect_signals import ABORT_WAIT_S, STOPPED, UNAVAILABLE, WORKED, finding, verdict
from exlnb.experiments.server_cpu import process_cpu_s
from exlnb.models import BUNDLED_MODEL, resolve_model
from exlnb.session import Session
from tests.fake_llm_server import MODEL as FAKE_MODEL

pytest_plugins = ["tests.servers"]

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "disconnect.ipynb"
FAKE_SERVER = Path(__file__).with_name("fake_llm_server.py")
WAIT_S = 30  # every wait on the stand-in server is bounded
CONTROL = "exlnb cpu"
SMALL = dict(abandoned=1, probes=2, max_new_tokens=64, prefill_prompt_tokens=256, settle_timeout_s=20.0)


def stopped_row(**changes) -> dict:
    """A row in which every signal saw the server stop; `changes` make one signal see otherwise."""
    return {
        "target": "transformers server",
        "mode": "transformers serve --continuous-batching",
        "request": "non-streaming",
        "phase": "decode",
        "abandoned": 2,
        "answered_before_leaving": 0,
        "quiet_before": True,
        "left_after_s": 1.0,
        "idle_ttft_s": 0.16,
        "probe_ttft_s": 0.18,
        "probe_error": None,
        "slowdown": 1.1,
        "idle_again_after_s": 0.1,
        "server_running_after": None,
        "server_running_after_wait": None,
        "server_cpu_after_left_s": 0.1,
        "server_quiet_after_s": 3.0,
    } | changes


def test_a_server_busy_behind_a_fast_probe_kept_working():
    row = stopped_row(server_cpu_after_left_s=9.2, server_quiet_after_s=None)
    said = verdict(row)
    assert said["probe_says"] == STOPPED and said["cpu_says"] == WORKED and said["metrics_says"] == UNAVAILABLE
    assert said["verdict"] == ("kept working (9.2 s of CPU after the client left and still busy at the settle timeout)")


def test_the_verdict_is_stopped_only_where_every_available_signal_agrees():
    assert verdict(stopped_row())["verdict"] == "stopped"
    assert verdict(stopped_row(server_running_after_wait=0.0))["verdict"] == "stopped"
    assert verdict(stopped_row(server_running_after_wait=2.0))["verdict"] == (
        f"kept working (/metrics counted 2 running {ABORT_WAIT_S:g} s after it left)"
    )
    assert verdict(stopped_row(slowdown=9.6))["verdict"] == "kept working (the next request waited 9.6x its idle time)"
    both = verdict(stopped_row(slowdown=9.6, server_cpu_after_left_s=1.3, server_quiet_after_s=6.2))["verdict"]
    assert (
        both == "kept working (the next request waited 9.6x its idle time; 1.3 s of CPU after the client left, "
        "busy for about 6 s)"
    )
    unclear = verdict(stopped_row(slowdown=1.8, idle_again_after_s=None, server_cpu_after_left_s=None))
    assert unclear["verdict"].startswith("unclear")


def test_a_probe_that_failed_behind_the_work_for_nobody_says_the_server_kept_working():
    stalled = "job failed inside the engine: ServerError: the server sent nothing for 60 s (read timeout)"
    said = verdict(stopped_row(probe_ttft_s=60.2, slowdown=376.2, idle_again_after_s=None, probe_error=stalled))
    assert said["probe_says"] == WORKED
    assert said["verdict"] == f"kept working (the next request waited 376.2x its idle time and failed ({stalled}))"


def test_the_runs_verdict_is_stated_only_where_every_run_gives_it():
    def run(*texts: str) -> dict:
        rows = [
            stopped_row(phase=phase, abandoned=0 if text.startswith("nothing") else 2)
            for phase, text in zip(PHASES, texts)
        ]
        return {"phases": [row | verdict(row) | {"verdict": text} for row, text in zip(rows, texts)]}

    nothing = "nothing abandoned: every request was answered before its client left"
    runs = {
        "transformers-cb": [
            run("stopped", "kept working (1.3 s of CPU after the client left)", "stopped"),
            run("stopped", "stopped", "unclear: the probes stayed slow"),
            run(nothing, "stopped", nothing),
        ]
    }
    table = {entry["phase"]: entry for entry in benchmark_verdicts(runs)}
    assert {phase: entry["verdict"] for phase, entry in table.items()} == {
        "queued": "stopped",
        "prefill": "runs disagree",
        "decode": "runs disagree",
    }
    assert [r["verdict"] for r in table["prefill"]["runs"]] == [
        "kept working (1.3 s of CPU after the client left)",
        "stopped",
        "stopped",
    ]
    assert table["queued"]["runs_abandoning"] == 2  # the run that abandoned nothing has no say


def test_a_row_in_which_every_request_was_answered_says_nothing_was_abandoned():
    said = verdict(stopped_row(abandoned=0, answered_before_leaving=2, server_cpu_after_left_s=9.0))
    assert said["cpu_says"] == WORKED  # the CPU went to requests whose clients were still there
    assert said["verdict"] == "nothing abandoned: every request was answered before its client left"


def test_each_row_says_which_signals_it_could_not_read():
    row = stopped_row(server_cpu_after_left_s=None, server_quiet_after_s=None)
    row |= verdict(row)
    assert row["cpu_says"] == UNAVAILABLE and row["verdict"] == "stopped"
    line = finding(row)
    assert line.startswith(
        "transformers server (transformers serve --continuous-batching), non-streaming request "
        "abandoned while decode: stopped ("
    )
    assert "/metrics: not available" in line and "server CPU: not available" in line


def test_the_cpu_time_of_a_process_that_is_not_here_is_refused_by_its_pid():
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(finished.stdout)
    with pytest.raises(ValueError, match=rf"server_pid={pid}: no such process on this machine"):
        process_cpu_s(pid)
    with pytest.raises(ValueError, match="server_pid and server_mode describe the server at url"):
        disconnect.run(None, server_pid=pid)


# -- against a stand-in server, its own process ---------------------------------------------------------------


def fake_server(after_leaving: str, log_dir: Path):
    port = free_port()
    argv = [sys.executable, str(FAKE_SERVER), "--port", str(port), "--after-leaving", after_leaving]
    mode = f"fake LLM server, --after-leaving {after_leaving}"
    return server_process(argv, port, log_dir / "server.log", mode, FAKE_MODEL)


@pytest.fixture(scope="module")
def stopping_server(tmp_path_factory) -> Iterator[LocalServer]:
    """A stand-in that stops as soon as its client leaves."""
    with fake_server("stop", tmp_path_factory.mktemp("fake-stop")) as server:
        yield server


@pytest.fixture(scope="module")
def working_server(tmp_path_factory) -> Iterator[LocalServer]:
    """A stand-in that runs every request to its max_tokens, whether its client is there or not."""
    with fake_server("work-on", tmp_path_factory.mktemp("fake-work-on")) as server:
        yield server


@pytest.fixture(scope="module")
def stopping_session(stopping_server) -> Iterator[Session]:
    session = Session()
    session.load(resolve_model(BUNDLED_MODEL, progress=False), url=stopping_server.url, progress=False)
    yield session
    session.unload()


def fake_log(server: LocalServer, until=lambda log: True) -> list[dict]:
    """What the stand-in saw of each request, once `until` holds of it (bounded)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        log = httpx.get(server.url.removesuffix("/v1") + "/fake/log", timeout=5).json()
        if until(log) or time.monotonic() > deadline:
            return log


@pytest.mark.slow  # starts a server
def test_a_non_streaming_request_is_left_when_its_client_times_out(stopping_server, stopping_session):
    ids = filler_ids(stopping_session.tokenizer, 32, label="left by its timeout")
    long = stopping_session.spec_for(ids, JobOptions(max_new_tokens=2000, stop_at_eos=False))
    [request] = whole_answers.whole_answer_requests(stopping_session, [long])
    assert request.body["stream"] is False and "stream_options" not in request.body
    assert whole_answers.abandon([request], leave_after_s=0.3) == 0
    log = fake_log(stopping_server, until=lambda log: log[-1]["finished"])
    entry = log[-1]
    assert (entry["stream"], entry["max_tokens"], entry["client_left"], entry["finished"]) == (False, 2000, True, True)
    assert entry["tokens"] < 2000  # it stopped when its client left
    short = stopping_session.spec_for(ids, JobOptions(max_new_tokens=2))
    assert (
        whole_answers.abandon(whole_answers.whole_answer_requests(stopping_session, [short]), leave_after_s=WAIT_S) == 1
    )


def run_against(server: LocalServer, session: Session) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The run on `server` beside the control, its PID and mode given: its rows on the control and on the
    server, checked for what every run must have (each request kind and phase once on the server, each row its
    mode, its CPU signal and its finding)."""
    result = disconnect.run(
        session,
        url=server.url,
        served_model=server.served_model,
        dialect=server.dialect,
        server_pid=server.pid,
        server_mode=server.mode,
        **SMALL,
    )
    phases = result.tables["phases"]
    control, on_server = phases[phases.target == CONTROL], phases[phases.target != CONTROL]
    assert sorted(zip(on_server.request, on_server.phase)) == sorted((r, p) for r in REQUESTS for p in PHASES)
    assert (on_server["mode"] == server.mode).all() and on_server.server_cpu_after_left_s.notna().all()
    assert list(control.request) == ["streaming"] * len(PHASES) and control.server_cpu_after_left_s.isna().all()
    assert (control["mode"] == "exlnb's cpu engine in the kernel").all()
    assert (phases.abandoned + phases.answered_before_leaving == SMALL["abandoned"]).all()
    assert len(result.findings) == len(phases)
    return control, on_server


@pytest.mark.slow  # starts a server
@pytest.mark.parametrize("server_fixture", ["stopping_server", "working_server"])
def test_the_run_reads_the_servers_cpu_and_names_its_mode_on_every_row(server_fixture, request, cpu_session):
    server: LocalServer = request.getfixturevalue(server_fixture)
    _, on_server = run_against(server, cpu_session)
    assert (on_server.target == "vllm server").all()
    assert (on_server.metrics_says != UNAVAILABLE).all()  # the stand-in has /metrics
    whole = on_server[on_server.request == "non-streaming"]
    assert (whole.abandoned == 1).all()
    if "work-on" in server.mode:
        assert (whole.cpu_says == WORKED).all(), whole.verdict.tolist()
        assert all(v.startswith("kept working (") and "s of CPU after the client left" in v for v in whole.verdict)
        left = fake_log(server, until=lambda log: all(e["finished"] for e in log))
        assert any(e["client_left"] and e["tokens"] == e["max_tokens"] for e in left)  # it did run on for nobody
    else:
        assert (on_server.cpu_says == STOPPED).all(), on_server.verdict.tolist()
        assert (on_server.metrics_says == STOPPED).all()


# -- against the real servers the suite starts -------------------------------------------------------------------


@pytest.mark.slow  # starts real servers and a kernel
def test_the_disconnect_notebook_measures_a_server_beside_the_control(transformers_server_process, tmp_path):
    server = transformers_server_process
    papermill.execute_notebook(
        str(NOTEBOOK),
        str(tmp_path / "disconnect.ipynb"),
        kernel_name="python3",
        progress_bar=False,
        parameters=dict(
            engine="cpu",
            cache_tokens=2048,
            output_dir=str(tmp_path),
            url=server.url,
            served_model=server.served_model,
            dialect=server.dialect,
            server_pid=server.pid,
            server_mode=server.mode,
            abandoned=1,
            probes=1,
            max_new_tokens=48,
            prefill_prompt_tokens=256,
            settle_timeout_s=20.0,
        ),
    )
    phases = pd.read_csv(tmp_path / "disconnect-phases.csv")
    expected = [(CONTROL, "streaming", p) for p in PHASES] + [
        ("transformers server", r, p) for r in REQUESTS for p in PHASES
    ]
    assert sorted(zip(phases.target, phases.request, phases.phase)) == sorted(expected)
    assert (phases.probe_ttft_s > 0).all() and (phases.idle_ttft_s > 0).all()
    on_server = phases[phases.target == "transformers server"]
    assert (on_server["mode"] == "transformers serve").all() and on_server.server_cpu_after_left_s.notna().all()
    assert set(on_server.cpu_says) <= {WORKED, STOPPED}
    summary = json.loads((tmp_path / "disconnect.json").read_text())
    for target, request, phase in expected:
        assert any(
            f.startswith(f"{target} (") and f", {request} request abandoned while {phase}: " in f
            for f in summary["findings"]
        )
    assert summary["parameters"]["server_mode"] == "transformers serve"
    assert (tmp_path / "disconnect.png").stat().st_size > 0


@pytest.mark.slow  # starts real servers
@pytest.mark.parametrize("server_fixture", ["transformers_batching_server_process", "llama_cpp_server_process"])
def test_each_real_server_mode_gets_every_row_with_its_cpu(server_fixture, request, cpu_session):
    _, on_server = run_against(request.getfixturevalue(server_fixture), cpu_session)
    assert set(on_server.cpu_says) <= {WORKED, STOPPED}
    assert all(v == "stopped" or v.startswith(("kept working (", "unclear")) for v in on_server.verdict)
