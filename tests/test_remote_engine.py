"""The openai engine against real servers started by the tests: `transformers serve` (no logprobs) and
llama-cpp-python's server (logprobs with top_logprobs), both on the bundled model (issue 34's acceptance)."""

from __future__ import annotations

import _thread
import json
import threading
import time

import pytest

from exlnb import generation
from exlnb.engines.base import EosReason
from exlnb.loadtest import bench
from exlnb.models import BUNDLED_MODEL
from exlnb.session import Session, get_session
from tests.helpers import wait_until_idle

pytest_plugins = ["tests.servers"]
pytestmark = pytest.mark.slow  # starts real servers

WAIT_S = 120  # two busy cores: a server's answer of a few tokens can take a while


@pytest.fixture(scope="module")
def transformers_session(transformers_server_process) -> Session:
    session = Session()
    server = transformers_server_process  # named: transformers serve before 5.24 lists no model it serves
    session.load(url=server.url, served_model=server.served_model, dialect=server.dialect, progress=False)
    yield session
    session.unload()


def finished(gen: generation.Generation) -> generation.Generation:
    assert gen.wait_done(WAIT_S), f"not done within {WAIT_S} s"
    return gen


def test_a_chat_answer_streams_from_transformers_serve(transformers_session):
    status = transformers_session.status()
    assert status.library == "transformers" and "/v1/chat/completions" in status.api and not status.logprobs
    gen = finished(
        generation.start("Name three colours.", session=transformers_session, max_new_tokens=12, temperature=0)
    )
    [sample] = gen.samples
    assert gen.errors == [] and sample.text.strip()
    assert sum(bool(e.text) for e in sample.events) > 1  # in pieces as they came
    assert sample.eos_reason in (EosReason.STOP_TOKEN, EosReason.MAX_NEW_TOKENS)
    assert sample.last.time_to_first_token_s > 0


def test_stop_closes_the_stream_at_once(transformers_session):
    gen = generation.start(
        "Write a long story about a lighthouse.", session=transformers_session, max_new_tokens=400, temperature=0
    )
    deadline = time.monotonic() + WAIT_S
    while not gen.samples[0].token_ids and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gen.samples[0].token_ids, "no token arrived"
    gen.cancel("stop button")
    finished(gen)
    assert gen.samples[0].eos_reason is EosReason.CANCELLED and gen.samples[0].stopped_by == "stop button"
    assert transformers_session.jobs() == []


def test_a_real_answer_passes_every_check_and_its_role_only_first_frame_is_left_out_of_ttft(transformers_session):
    gen = finished(
        generation.start(
            "Write a long story about a lighthouse.", session=transformers_session, max_new_tokens=6, temperature=0
        )
    )
    [sample] = gen.samples
    delivery = sample.last.delivery
    assert gen.errors == [] and sample.eos_reason is EosReason.MAX_NEW_TOKENS and len(sample.token_ids) <= 6
    assert delivery.received_tokens == len(sample.token_ids)
    assert delivery.frames > len(delivery.arrivals)  # the role-only first frame and the finish frame hold no token
    assert delivery.first_frame <= delivery.arrivals[0][0]
    assert sample.last.time_to_first_token_s == pytest.approx(delivery.arrivals[0][0] - delivery.sent)


def test_a_key_in_a_real_servers_url_is_refused_and_the_session_stays(transformers_session, transformers_server):
    before = transformers_session.status()
    with pytest.raises(ValueError, match="carries credentials or a query") as refused:
        transformers_session.load(url=transformers_server.replace("http://", "http://me:hunter2@"), progress=False)
    assert "hunter2" not in str(refused.value) and transformers_session.status() == before


def test_the_token_view_says_plainly_a_server_returns_no_logprobs(transformers_session):
    with pytest.raises(
        ValueError, match=r"tokens=3 \(a transformers server returns no logprobs, so there is no token view"
    ):
        generation.start("Hi", session=transformers_session, tokens=3)


def test_chat_history_goes_to_the_server_as_messages(transformers_session):
    first = finished(
        generation.start(
            "My name is Ada.",
            chat="remote",
            amnesia=True,
            session=transformers_session,
            max_new_tokens=8,
            temperature=0,
        )
    )
    second = finished(
        generation.start(
            "What is my name?", chat="remote", session=transformers_session, max_new_tokens=8, temperature=0
        )
    )
    assert first.errors == second.errors == []
    sent = transformers_session.tokenizer.messages_for(tuple(second.prompt_ids))
    assert [m["role"] for m in sent][-3:] == ["user", "assistant", "user"]
    assert sent[-3]["content"] == "My name is Ada." and sent[-2]["content"] == first.texts[0]


def test_a_prompt_in_exlnbs_template_is_refused_by_a_chat_server(transformers_session):
    with pytest.raises(
        ValueError,
        match=r"already rendered with a template .* use template='auto', or load with "
        r"api='completions'",
    ):
        generation.start("Hi", template="chatml", session=transformers_session)


def test_completions_send_exlnbs_own_template(llama_cpp_session):
    assert "/v1/completions (exlnb's templates)" in llama_cpp_session.status().api
    gen = finished(
        generation.start("Name a fruit.", template="chatml", session=llama_cpp_session, max_new_tokens=8, temperature=0)
    )
    assert gen.errors == [] and gen.texts[0].strip()


def test_the_token_view_reads_the_servers_logprobs(llama_cpp_session):
    gen = finished(
        generation.start("Name a fruit.", session=llama_cpp_session, max_new_tokens=6, temperature=0, tokens=3)
    )
    records = gen.results[0].tokens()
    assert len(records) >= 1 and gen.errors == []
    for _, row in records.iterrows():
        assert 0 < row.probability <= 1 and 1 <= len(row.alternatives) <= 3
        # greedy: the token drawn is the likeliest the server listed
        assert row.probability == pytest.approx(max(p for _, _, p in row.alternatives), rel=1e-6)
    assert "".join(records.text) == gen.texts[0]


def test_n_samples_each_stream_their_own_answer(llama_cpp_session):
    gen = finished(generation.start("Say a number.", n=2, seed=3, session=llama_cpp_session, max_new_tokens=6))
    assert gen.errors == [] and len(gen.texts) == 2 and all(t.strip() for t in gen.texts)


@pytest.fixture(scope="module")
def llama_cpp_bench(llama_cpp_session):
    """One load test of three requests against the llama.cpp server, read by the tests of what it measured."""
    return bench(
        request_rate=[4.0],
        num_requests=3,
        prompt_len=16,
        output_len=4,
        seed=1,
        progress=False,
        session=llama_cpp_session,
    )


def test_bench_measures_a_server_with_vllms_metrics(llama_cpp_bench):
    [run] = llama_cpp_bench.runs
    assert len(run.records) == 3 and all(r.succeeded for r in run.records)
    assert [r.output_tokens for r in run.records] == [4, 4, 4]  # exact lengths: the server was told min_tokens
    assert run.metrics.successful_requests == 3 and run.metrics.ttft_ms.mean > 0


def test_bench_and_the_server_view_audit_how_the_server_delivered(llama_cpp_session, llama_cpp_bench):
    from exlnb.widgets.server import server_text

    result = llama_cpp_bench
    audit = result.runs[0].delivery
    assert (audit.answers, audit.received_tokens) == (3, 12) and audit.server_tokens in (12, None)
    assert audit.chunks_per_token == 1.0  # llama.cpp streams a token a frame
    assert audit.line() in result.table()
    assert "delivery of " in server_text(llama_cpp_session, llama_cpp_session.jobs())


@pytest.fixture
def llama_cpp_in_the_kernel(llama_cpp_server):
    """The kernel's own session on the llama.cpp server, for the magics; the CPU engine again afterwards."""
    from IPython.core.interactiveshell import InteractiveShell

    import exlnb

    shell = InteractiveShell.instance()
    exlnb.load_ipython_extension(shell)
    yield shell
    get_session().load(BUNDLED_MODEL, engine="cpu", progress=False)


def test_the_magics_drive_a_server(llama_cpp_in_the_kernel, llama_cpp_server, capsys):
    shell = llama_cpp_in_the_kernel
    shell.run_line_magic(
        "exl_load", f"--engine openai --url {llama_cpp_server} --served-model {BUNDLED_MODEL} --api completions"
    )
    # the server's own status line: the server and its dialect, the API, whether it returns logprobs
    status = get_session().status()
    assert (
        f"openai engine | {BUNDLED_MODEL} | server {llama_cpp_server}, llama.cpp dialect | API /v1/completions "
        f"(exlnb's templates) | logprobs yes | context {status.cache_tokens} tokens\n"
    ) in capsys.readouterr().out
    shell.run_cell_magic(
        "exl_generate",
        "--max-new-tokens 200 --background --out gen --display text",
        "Write a long story about a lighthouse keeper.",
    )
    gen = shell.user_ns["gen"]
    shell.run_line_magic("exl_cache", "--display text")
    view = capsys.readouterr().out
    assert f"{BUNDLED_MODEL} at {llama_cpp_server}" in view
    assert "no /metrics page" in view
    shell.run_line_magic("exl_jobs", "--display text")
    shell.run_line_magic("exl_cancel", "--all")
    finished(gen)
    assert get_session().jobs() == []


def test_a_kernel_interrupt_closes_the_stream(llama_cpp_in_the_kernel, llama_cpp_server, ctrl_c):
    session = get_session()
    session.load(url=llama_cpp_server, api="completions", progress=False)
    started = threading.Event()

    def interrupt_once_tokens_flow():
        deadline = time.monotonic() + WAIT_S
        while not any(r.info.new_tokens for r in session.jobs()) and time.monotonic() < deadline:
            time.sleep(0.01)
        started.set()
        _thread.interrupt_main()  # Ctrl-C while the cell waits for its answer

    threading.Thread(target=interrupt_once_tokens_flow, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        llama_cpp_in_the_kernel.run_cell_magic(
            "exl_generate", "--max-new-tokens 400 --display text", "Write a long story about a lighthouse keeper."
        )
    assert started.is_set()
    wait_until_idle(session)
    assert session.jobs() == []


def test_the_serving_suite_sweeps_a_server_given_its_url(llama_cpp_in_the_kernel, llama_cpp_server, tmp_path):
    from benchmarks.serving import main

    path = main(
        [
            "--url",
            llama_cpp_server,
            "--api",
            "completions",
            "--quick",
            "--requests",
            "2",
            "--output-len",
            "3",
            "--out",
            str(tmp_path),
        ]
    )
    [setup] = json.loads(path.read_text())["setups"]
    assert setup["setup"] == f"openai at {llama_cpp_server}" and setup["stopped"] is None
    assert path.name.startswith("serving-openai-")
    for run in setup["runs"]:
        assert run["metrics"]["successful_requests"] == 2 and run["metrics"]["total_output_tokens"] == 6


@pytest.mark.parametrize("argv", [["--engine", "openai"], ["--engine", "cpu", "--url", "http://127.0.0.1:9/v1"]])
def test_the_serving_suite_takes_the_openai_engine_and_a_url_together(argv, capsys):
    from benchmarks.serving import main

    with pytest.raises(SystemExit):
        main(argv)
    assert "--engine openai and --url go together" in capsys.readouterr().err
