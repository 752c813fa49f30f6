"""The openai engine against a stand-in server's failures: each one a line naming the server's own words, failing
only its job, the session usable after it (issue 34's bad inputs; the real servers' cases are in test_remote_engine)."""

from __future__ import annotations

import socket
import time

import pytest

from exlnb import generation
from exlnb.engines.base import EosReason, SamplerSettings
from exlnb.engines.remote import client
from exlnb.session import LoadFailed, Session

pytest_plugins = ["tests.servers"]

WAIT_S = 30


def run(session: Session, prompt: str) -> generation.Generation:
    gen = generation.start(prompt, session=session, max_new_tokens=16)
    assert gen.wait_done(WAIT_S), f"{prompt!r} did not end within {WAIT_S} s"
    return gen


def test_a_server_is_loaded_by_its_url_and_streams(fake_session):
    status = fake_session.status()
    assert (status.engine, status.model, status.library) == ("openai", "fake-model", "vllm")
    gen = run(fake_session, "one two three")
    assert gen.errors == [] and gen.texts == ["Hello one two three"]
    assert len(gen.samples[0].events) >= 4  # word by word, not in one piece


@pytest.mark.parametrize(
    "prompt, words",
    [
        ("malformed", "sent a malformed event (not a JSON object): {not json"),
        ("429", "429 Too Many Requests: Too many requests: rate limit of 2 per second"),
        ("503", "503 Service Unavailable: Server overloaded, retry later"),
        ("die", "closed the connection mid-answer"),
    ],
)
def test_a_bad_answer_fails_its_job_in_one_line_naming_the_server(fake_session, prompt, words):
    gen = run(fake_session, prompt)
    [error] = gen.errors
    assert words in str(error) and "\n" not in str(error)
    assert run(fake_session, "still here").texts == ["Hello still here"]


def test_a_stalled_stream_fails_at_the_read_timeout(fake_session, monkeypatch):
    monkeypatch.setattr(client, "READ_TIMEOUT_S", 1.0)
    gen = run(fake_session, "stall")
    [error] = gen.errors
    assert "sent nothing for 1 s (read timeout)" in str(error)
    assert fake_session.jobs() == []


def test_stop_closes_the_connection_and_the_server_sees_the_client_leave(fake_session, fake_server):
    fake_server.client_left.clear()
    gen = generation.start("slow", session=fake_session, max_new_tokens=200)
    deadline = time.monotonic() + WAIT_S
    while not gen.samples[0].text and time.monotonic() < deadline:
        time.sleep(0.01)
    gen.cancel("stop button")
    assert fake_server.client_left.wait(5), "the server still had the client 5 s after Stop"
    assert gen.wait_done(WAIT_S) and gen.samples[0].eos_reason is EosReason.CANCELLED


def test_one_failing_job_leaves_the_others_running(fake_session):
    words = " ".join(f"w{i}" for i in range(30))
    long_one = generation.start(words, session=fake_session, max_new_tokens=100)  # its answer is 81 tokens
    failing = run(fake_session, "die")
    assert long_one.wait_done(WAIT_S)
    assert failing.errors and long_one.errors == [] and long_one.texts == ["Hello " + words]


def test_a_setting_the_server_cannot_take_is_refused_by_name(fake_session):
    with pytest.raises(ValueError, match=r"dry_multiplier=0\.8 \(no field for it on a vllm server\)"):
        fake_session.generate("hi", sampler=SamplerSettings(dry_multiplier=0.8))


def test_a_servers_status_line_says_what_a_server_has(fake_session, fake_server):
    """The status line was the local engines' template: "unpaged (llama.cpp dialect (returns logprobs)) | cache
    8192 tokens server's | batch 16 | decode: prompts: ..."."""
    assert fake_session.status().line() == (
        f"openai engine | fake-model | server {fake_server.url}, vllm dialect "
        "| API /v1/chat/completions (the server's chat template) | logprobs yes | context 2048 tokens"
    )


def test_branching_on_a_chat_server_is_refused_saying_it_needs_completions(fake_session):
    """On a chat server a branch was refused with advice that could not work ("use template='auto'", in use)."""
    from exlnb.widgets.branches import BranchChoices

    gen = run(fake_session, "one two three")
    [result] = gen.results
    with pytest.raises(
        ValueError,
        match=r"^branching on a server needs --api completions: with api='chat' the server "
        r"applies its own chat template .* --api completions \(api='completions'\)",
    ):
        result.branch(at=1, token=result.token_ids[1])
    viewed = generation.start("one two", session=fake_session, max_new_tokens=4, tokens=2)
    assert BranchChoices.offer(viewed) is None and viewed.branch_refusal.startswith("branching on a server needs")
    assert viewed.wait_done(WAIT_S)


def test_the_server_view_reads_its_metrics(fake_session):
    metrics = fake_session.run_on_engine(lambda engine: engine.server_metrics())
    assert (metrics.running, metrics.waiting, metrics.kv_cache_usage) == (3, 2, 0.25)
    assert metrics.line() == "server: 3 running, 2 waiting, KV cache 25%"


def test_a_wrong_key_fails_the_load_with_the_servers_message(fake_server, monkeypatch):
    monkeypatch.setenv("EXLNB_WRONG_KEY", "not-the-key")
    with pytest.raises(LoadFailed, match=r"401 Unauthorized: Incorrect API key provided \(check --api-key-env\)"):
        Session().load(url=fake_server.url, api_key_env="EXLNB_WRONG_KEY", progress=False)


def test_a_wrong_model_name_fails_the_load_naming_what_the_server_serves(fake_server, monkeypatch_module):
    monkeypatch_module.setenv("EXLNB_FAKE_KEY", fake_server.key)
    with pytest.raises(LoadFailed, match=r"serves no model 'gpt-9': it lists 'fake-model'"):
        Session().load(url=fake_server.url, served_model="gpt-9", api_key_env="EXLNB_FAKE_KEY", progress=False)


def test_a_refused_connection_fails_the_load_in_one_line(refusing_url):
    with pytest.raises(LoadFailed, match=rf"cannot connect to the server at {refusing_url}: .*is it running"):
        Session().load(url=refusing_url, progress=False)


def test_a_server_that_never_answers_fails_the_load_in_one_line(monkeypatch):
    monkeypatch.setattr(client, "READ_TIMEOUT_S", 0.5)
    with socket.socket() as silent:  # accepts connections, answers nothing
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        with pytest.raises(LoadFailed, match=r"did not answer in time \(ReadTimeout\)"):
            Session().load(url=url, progress=False)


def test_a_url_that_is_not_http_is_refused_before_anything_loads(fake_session):
    before = fake_session.status()
    with pytest.raises(ValueError, match=r"url='127.0.0.1:8000' is not an http\(s\) address"):
        fake_session.load(url="127.0.0.1:8000", progress=False)
    assert fake_session.status() == before and run(fake_session, "still here").texts == ["Hello still here"]


def test_the_server_view_shows_the_servers_gauges_over_this_kernels_jobs(fake_session):
    from exlnb.widgets.server import ServerView

    gen = generation.start("slow", session=fake_session, max_new_tokens=200)
    view = ServerView(fake_session)
    try:
        deadline = time.monotonic() + WAIT_S
        while not fake_session.jobs() and time.monotonic() < deadline:
            time.sleep(0.01)
        view.refresh()
        assert "server: 3 running, 2 waiting, KV cache 25%" in view.html
        assert f"job {gen.samples[0].stream.job_id}" in view.text() and "Cancel" in view.html
        assert "1 job, read by its stream" in view.html  # not "1 jobs"
    finally:
        view.close()
        gen.cancel()
