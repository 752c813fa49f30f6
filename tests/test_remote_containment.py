"""A server's bad answers contained, against the stand-in server: a badly shaped event fails only its job, a stream
that stops before its answer does is an error, the client bounds what it reads, a key never rides in the url, and
the delivery audit says how answers arrived (the field reports' server faults; the real servers' side is in
test_remote_engine)."""

from __future__ import annotations

import threading
import time

import pytest

from exlnb import SamplerSettings, generation
from exlnb.engine_thread import EngineThread
from exlnb.engines.base import EosReason
from exlnb.engines.delivery import DeliveryAudit
from exlnb.engines.remote.answer import MAX_EVENT_BYTES, EventReader
from exlnb.engines.remote.client import ServerError
from exlnb.loadtest import bench
from exlnb.session import LoadFailed, Session
from exlnb.streaming import JobError
from exlnb.widgets.stream import generate_live

pytest_plugins = ["tests.servers"]

WAIT_S = 30
SHAPE_WORDS = {  # what each bad shape's one line says was wrong
    "choices-text": "choices is 'abc' (str), not a list",
    "choice-number": "choices[0] is 5 (int), not an object",
    "content-number": "choices[0].delta.content is 42 (int), not a string",
    "usage-words": "usage.completion_tokens is 'lots' (str), not a count",
    "finish-list": 'choices[0].finish_reason is ["stop"] (list), not a string',
    "logprob-text": "choices[0].logprobs.content[0].logprob is 'abc' (str), not a log-probability",
}


def run(session: Session, prompt: str, max_new_tokens: int = 16, **options) -> generation.Generation:
    gen = generation.start(prompt, session=session, max_new_tokens=max_new_tokens, **options)
    assert gen.wait_done(WAIT_S), f"{prompt!r} did not end within {WAIT_S} s"
    return gen


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {WAIT_S} s"
        time.sleep(0.01)


def the_error(gen: generation.Generation) -> str:
    [error] = gen.errors
    assert "\n" not in str(error) and gen.samples[0].eos_reason is EosReason.FAILED
    return str(error)


@pytest.mark.parametrize("shape", sorted(SHAPE_WORDS))
def test_a_badly_shaped_event_fails_its_job_alone_naming_the_server_endpoint_and_field(
    fake_session, fake_server, shape
):
    assert set(SHAPE_WORDS) == set(fake_server.bad_shapes)
    bystander = generation.start("slow", session=fake_session, max_new_tokens=400)

    def ticks() -> int:
        return len(bystander.samples[0].token_ids)

    wait_for(ticks, "the bystander's first token")
    error = the_error(run(fake_session, f"shape:{shape}"))
    assert f"the server at {fake_server.url}/chat/completions sent an event of the wrong shape: " in error
    assert SHAPE_WORDS[shape] in error
    seen = ticks()
    wait_for(lambda: ticks() > seen, "a token for the bystander after the failure")
    bystander.cancel("stop button")
    assert bystander.wait_done(WAIT_S) and bystander.errors == []
    assert bystander.samples[0].eos_reason is EosReason.CANCELLED


def test_events_are_read_across_pieces_and_one_past_its_limit_is_refused_however_it_comes():
    reader = EventReader("http://127.0.0.1:9/v1/completions", limit=10 * MAX_EVENT_BYTES)
    assert reader.feed(b'data: {"a": 1}\r') == []  # a \r may be half of a \r\n
    assert reader.feed(b"\n\r\n: a comment\ndata: [DONE]\n\n") == [b'{"a": 1}', b"[DONE]"]
    whole = b"data: " + b"x" * (MAX_EVENT_BYTES + 1) + b"\n\n"
    for pieces in ([whole], [whole[:1000], whole[1000:]]):
        reader = EventReader("http://127.0.0.1:9/v1/completions", limit=10 * MAX_EVENT_BYTES)
        with pytest.raises(ServerError, match="sent an event over 1 MiB"):
            for piece in pieces:
                reader.feed(piece)


@pytest.mark.parametrize(
    "prompt, words",
    [
        ("cut", "ended the stream without finishing the answer (no finish_reason in "),
        ("no-finish", "ended the stream without finishing the answer (no finish_reason in "),
        ("no-choices", "sent an event of the wrong shape: choices is missing"),
    ],
)
def test_a_stream_that_stops_before_its_answer_ends_is_an_error_not_an_end_of_turn(
    fake_session, fake_server, prompt, words, capsys
):
    with pytest.raises(JobError, match=f"the server at {fake_server.url}/chat/completions "):
        generate_live(prompt, session=fake_session, max_new_tokens=16, display="text")
    printed = capsys.readouterr().out
    assert "error" in printed and "end of turn" not in printed
    gen = run(fake_session, prompt)
    assert words in the_error(gen)
    [result] = gen.results
    assert result.eos_reason is EosReason.FAILED and words in result.error


def test_a_load_test_counts_a_bad_answer_as_failed_and_goes_on(fake_session, fake_server):
    fake_server.faults[:] = ["shape:content-number", "cut"]
    result = bench(
        request_rate=[float("inf"), float("inf")],
        num_requests=4,
        prompt_len=8,
        output_len=4,
        seed=1,
        progress=False,
        session=fake_session,
    )
    first, second = result.runs
    assert (first.metrics.successful_requests, first.metrics.failed_requests) == (2, 2)
    assert first.count_words() == "2 of 4 requests finished, 2 failed"
    table = result.table()
    assert "choices[0].delta.content is 42 (int), not a string" in table
    assert "ended the stream without finishing the answer" in table
    assert result.requests.error.str.contains(f"the server at {fake_server.url}", regex=False).sum() == 2
    assert second.metrics.successful_requests == 4 and [r.output_tokens for r in second.records] == [4] * 4


def test_a_server_that_keeps_streaming_is_cut_at_max_new_tokens_by_the_clients_count(fake_session, fake_server):
    fake_server.client_left.clear()
    gen = run(fake_session, "endless", max_new_tokens=4)
    assert (
        "sent more than max_new_tokens=4 tokens (5 by the local tokenizer's count): exlnb kept the first 4 and "
        "closed the stream" in the_error(gen)
    )
    assert len(gen.samples[0].token_ids) == 4 and gen.results[0].text == "Hello more more more"
    assert fake_server.client_left.wait(5), "the server still had the client 5 s after the cut"


@pytest.mark.parametrize("prompt", ["big-event", "long-line"])
def test_an_event_past_its_size_limit_is_refused_in_one_line(fake_session, fake_server, prompt):
    error = the_error(run(fake_session, prompt))
    assert (
        f"sent an event over {MAX_EVENT_BYTES >> 20} MiB (or a line that does not end): exlnb read no further" in error
    )
    if prompt == "long-line":  # the client stopped reading: the server could not pour its 200 MB
        assert fake_server.written < fake_server.huge_bytes / 2


def test_an_error_body_past_its_size_limit_is_not_read_further(fake_session, fake_server):
    error = the_error(run(fake_session, "big-error"))
    assert (
        'answered 500 Internal Server Error with a body over 1 MiB, read no further: {"error": {"message": "xxx'
        in error
    )
    assert fake_server.written < fake_server.huge_bytes / 2


def test_an_answer_past_its_size_limit_is_refused(fake_session):
    error = the_error(run(fake_session, "chatter", max_new_tokens=4))
    assert "bytes for one answer (the limit for its max_new_tokens): exlnb closed the stream" in error
    assert run(fake_session, "still here").texts == ["Hello still here"]


def test_streamed_text_is_tokenised_off_the_engine_thread(fake_session, monkeypatch):
    threads = []
    encode = fake_session.tokenizer.encode

    def recording(text, **kwargs):
        threads.append(threading.current_thread())
        return encode(text, **kwargs)

    monkeypatch.setattr(fake_session.tokenizer, "encode", recording)
    gen = run(fake_session, "one two three")
    assert gen.errors == [] and gen.texts == ["Hello one two three"]
    names = {thread.name for thread in threads}
    assert any(name.startswith("exlnb-openai-tokens") for name in names), names
    assert not any(isinstance(thread, EngineThread) for thread in threads)


def test_the_delivery_audit_counts_frames_and_tokens_apart(fake_session, fake_server):
    gen = run(fake_session, "packed", max_new_tokens=32)
    [sample] = gen.samples
    delivery = sample.last.delivery
    words = len(fake_server.packed_words.split())
    frames_with_tokens = (words + 1) // 2
    assert gen.errors == [] and sample.text == fake_server.packed_words
    # a role-only frame, two words a frame, a finish frame and a usage frame
    assert (delivery.frames, len(delivery.arrivals)) == (frames_with_tokens + 3, frames_with_tokens)
    assert delivery.received_tokens == delivery.server_tokens == words
    assert delivery.first_frame < delivery.arrivals[0][0]  # the role-only frame came first ...
    assert sample.last.time_to_first_token_s == pytest.approx(delivery.arrivals[0][0] - delivery.sent)  # ... left out
    gaps = delivery.itl_per_token_s()
    assert len(gaps) == words - 2 and sum(gaps) == pytest.approx(delivery.arrivals[-1][0] - delivery.arrivals[0][0])
    audit = DeliveryAudit.of([delivery])
    assert audit.chunks_per_token == pytest.approx(frames_with_tokens / words)
    assert audit.frames_per_s == pytest.approx(audit.tokens_per_s * (frames_with_tokens + 3) / words)
    assert f"delivery of 1 answer: {words} tokens received, {words} by the server's count; " in audit.line()


def test_the_load_test_and_the_server_view_show_the_delivery_audit(fake_session):
    from exlnb.widgets.server import server_text

    result = bench(
        request_rate=[float("inf")],
        num_requests=3,
        prompt_len=8,
        output_len=4,
        seed=1,
        progress=False,
        session=fake_session,
    )
    [rate] = result.runs
    audit = rate.delivery
    assert (audit.answers, audit.received_tokens, audit.server_tokens, audit.chunks_per_token) == (3, 12, 12, 1.0)
    assert audit.line() in result.table()
    assert result.summary.chunks_per_token.tolist() == [1.0]
    assert result.as_dict()["runs"][0]["delivery"]["frames"] == audit.frames
    assert "delivery of " in server_text(fake_session, fake_session.jobs())


@pytest.mark.parametrize("url", ["http://someone:hunter2@{host}/v1", "{base}?key=hunter2", "{base}#hunter2"])
def test_a_url_carrying_a_key_is_refused_without_showing_it_and_the_loaded_server_stays(fake_session, fake_server, url):
    before = fake_session.status()
    given = url.format(host=fake_server.url.removeprefix("http://").removesuffix("/v1"), base=fake_server.url)
    with pytest.raises(ValueError, match="carries credentials or a query") as refused:
        fake_session.load(url=given, api_key_env="EXLNB_FAKE_KEY", progress=False)
    assert "hunter2" not in str(refused.value) and "--api-key-env" in str(refused.value)
    assert fake_session.status() == before and run(fake_session, "still here").texts == ["Hello still here"]


def test_a_redirect_is_named_as_such_and_not_followed(fake_server, monkeypatch):
    monkeypatch.setenv("EXLNB_FAKE_KEY", fake_server.key)
    root = fake_server.url.removesuffix("/v1")
    with pytest.raises(
        LoadFailed,
        match=rf"answered 307 Temporary Redirect, a redirect to {root}/v1/models: exlnb "
        "follows no redirect",
    ) as refused:
        Session().load(url=f"{root}/moved/v1", api_key_env="EXLNB_FAKE_KEY", progress=False)
    assert "hunter2" not in str(refused.value)


def load_under(session: Session, server, prefix: str, **options) -> None:
    """Load the stand-in server's API under `/prefix/v1`, where it answers its models listing another way."""
    url = f"{server.url.removesuffix('/v1')}/{prefix}/v1"
    session.load(url=url, api_key_env="EXLNB_FAKE_KEY", progress=False, **options)


def test_a_server_that_lists_no_model_asks_for_its_name_and_serves_the_name_given(fake_session, fake_server):
    with pytest.raises(
        LoadFailed,
        match=r"the server at http://127\.0\.0\.1:\d+/unlisted/v1 lists no models: give the name it answers to "
        r"with served_model= \(for transformers serve started on a folder, that folder's path, and "
        r"dialect='transformers'\)",
    ):
        load_under(fake_session, fake_server, "unlisted")
    load_under(fake_session, fake_server, "unlisted", served_model="fake-model")
    status = fake_session.status()
    assert (status.cache_tokens, status.library) == (8192, "openai")  # no entry: the local config's, OpenAI's fields
    assert run(fake_session, "named").texts == ["Hello named"]
    # greedy asks nothing OpenAI's fields cannot say (temperature 0; a repetition penalty of 1.0 is none)
    greedy = generation.start("greedy", session=fake_session, sampler=SamplerSettings.greedy(), max_new_tokens=4)
    assert greedy.wait_done(WAIT_S) and greedy.texts == ["Hello greedy"]
    with pytest.raises(ValueError, match=r"top_k=40 \(no field for it on an openai server\)"):
        generation.start("no", session=fake_session, top_k=40)
    load_under(fake_session, fake_server, "unlisted", served_model="fake-model", dialect="vllm")  # named: vLLM's
    assert fake_session.status().library == "vllm" and run(fake_session, "top-k", top_k=40).texts == ["Hello top-k"]
    fake_session.load(url=fake_server.url, api_key_env="EXLNB_FAKE_KEY", progress=False)


def test_a_context_length_that_makes_no_sense_is_refused_at_load(fake_session, fake_server):
    with pytest.raises(
        LoadFailed,
        match=r"reports max_model_len=-5 for 'fake-model', which is not a positive number "
        r"of tokens.*is loaded again",
    ):
        load_under(fake_session, fake_server, "len-5")
    assert fake_session.status().cache_tokens == 2048
    assert run(fake_session, "still here").texts == ["Hello still here"]
