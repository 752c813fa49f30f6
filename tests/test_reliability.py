"""Abuse, on the real bundled model and CPU engine: streams abandoned in every way, concurrent jobs against solo
ones, reloads under load, bad jobs among good ones, failed loads, long prefills under an event loop, views read
mid-step, and a real kernel interrupted in either display. Whatever happens, every stream ends, no job or page is
left behind, other jobs carry on, and the kernel's event loop is never held for a step."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time

import pytest

import exlnb.engines.cpu.engine as cpu_engine
from exlnb import EosReason, SamplerSettings
from exlnb.generation import start
from exlnb.near_ties import margin
from exlnb.noise_floor import ALTERNATIVES, record_steps, shifts
from exlnb.session import LoadFailed, NoModelLoaded, Session
from exlnb.streaming import JobError, ModelUnloaded
from exlnb.templates import chatml

PROMPT = chatml("Count to one hundred.")
QUESTIONS = [
    chatml(q)
    for q in (
        "What is the capital of France?",
        "Name three primary colours.",
        "Write a haiku about the sea.",
        "What is 12 times 12?",
        "Who wrote Romeo and Juliet?",
        "Give me a synonym for happy.",
        "What do bees make?",
        "Translate 'good morning' into Spanish.",
        "What is the largest planet?",
        "Name a mammal that can fly.",
        "What colour is the sky?",
        "How many legs does a spider have?",
        "What is the boiling point of water?",
        "Who painted the Mona Lisa?",
        "What is the opposite of cold?",
        "Spell the word cat backwards.",
    )
]


def settle(session: Session, timeout: float = 10.0) -> None:
    """Cancels asked for by finalisers and event loops are queued; let the engine thread run them. An engine
    command runs after every command queued before it, where a view may be one published before them."""
    deadline = time.monotonic() + timeout
    while session.run_on_engine(lambda engine: engine.jobs()) and time.monotonic() < deadline:
        time.sleep(0.01)


def nothing_left(session: Session) -> tuple[int, int]:
    """Jobs and used pages left, read by an engine command: after every cancel queued before it."""
    return session.run_on_engine(
        lambda engine: (len(engine.jobs()), sum(1 for p in engine.cache_view().pages if p.ref_count > 0))
    )


# -- every way a consumer can walk away ---------------------------------------------------------------------


def _break_early(session):
    for event in session.generate(PROMPT, max_new_tokens=40):
        if event.new_tokens >= 1:
            break


def _raise_in_loop(session):
    try:
        for event in session.generate(PROMPT, max_new_tokens=40):
            if event.new_tokens >= 1:
                raise RuntimeError("consumer bug")
    except RuntimeError:
        pass


def _drop_unread(session):
    session.generate(PROMPT, max_new_tokens=40)
    gc.collect()


def _drop_half_read(session):
    stream = session.generate(PROMPT, max_new_tokens=40)
    next(iter(stream))
    del stream
    gc.collect()


def _cancel_by_handle(session):
    session.generate(PROMPT, max_new_tokens=40).cancel()


def _cancel_by_id(session):
    session.cancel(session.generate(PROMPT, max_new_tokens=40).job_id)


def _request_cancel(session):
    session.generate(PROMPT, max_new_tokens=40).request_cancel()


def _close_the_iterator(session):
    iterator = iter(session.generate(PROMPT, max_new_tokens=40))
    next(iterator)
    iterator.close()


def _async_break(session):
    async def consume():
        async for event in await session.agenerate(PROMPT, max_new_tokens=40):
            if event.new_tokens >= 1:
                break

    asyncio.run(consume())


def _async_task_cancelled(session):
    async def consume(reading: asyncio.Event):
        async for _ in await session.agenerate(PROMPT, max_new_tokens=40):
            reading.set()
            await asyncio.sleep(3600)  # still reading when its task is cancelled, however fast the engine

    async def main():
        reading = asyncio.Event()
        task = asyncio.create_task(consume(reading))
        await reading.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def _async_loop_closed(session):
    async def read_one():
        stream = await session.agenerate(PROMPT, max_new_tokens=40)
        await anext(aiter(stream))
        return stream

    stream = asyncio.run(read_one())  # the loop is gone; the stream still holds the job
    del stream
    gc.collect()


def _generation_cancelled(session):
    start(PROMPT, template="raw", n=2, max_new_tokens=40, session=session).cancel("test", wait=False)


ABANDONMENTS = [
    _break_early,
    _raise_in_loop,
    _drop_unread,
    _drop_half_read,
    _cancel_by_handle,
    _cancel_by_id,
    _request_cancel,
    _close_the_iterator,
    _async_break,
    _async_task_cancelled,
    _async_loop_closed,
    _generation_cancelled,
]


@pytest.mark.slow  # two hundred streams
def test_two_hundred_abandoned_streams_leave_no_job_page_or_thread(idle_session):
    threads_before = threading.active_count()
    rounds = -(-200 // len(ABANDONMENTS))  # every way, at least 200 streams in all
    for _ in range(rounds):
        for abandon in ABANDONMENTS:
            abandon(idle_session)
    settle(idle_session)
    gc.collect()
    time.sleep(0.2)  # generation threads end after their last event

    assert rounds * len(ABANDONMENTS) >= 200
    assert nothing_left(idle_session) == (0, 0)
    assert threading.active_count() == threads_before


# A batch's rounding moves a margin by far less than this on every engine: the largest shift the near-tie record
# measured between two ways of running the same steps on a GPU engine (0.297 nats, an fp16 cache against a q8 one;
# batches against alone moved none; benchmarks/results/near-ties-nvidia-h100-80gb-hbm3-2026-11-28). A job that read
# another's keys or rows would move its margins by whole nats. The two partings an H200 showed here were at margins of
# 0.011 and 0.00014 nats (benchmarks/results/speed-nvidia-h200-2026-11-29-e).
ROUNDING_SHIFT = 0.3


@pytest.mark.slow  # sixteen answers twice
def test_sixteen_concurrent_greedy_jobs_equal_their_solo_outputs_up_to_a_near_tie(idle_session, greedy):
    """Jobs run side by side give the tokens each gives alone, with the same margins up to rounding. On a GPU
    engine rows of differently shaped batches round differently (fp16), so an answer may part from its solo run
    at a near tie (the near-tie record: 6 of 196 answers parted between alone and a batch of 16): compared up to
    and including its first parting, no margin moved by more than rounding moves one, the parting included."""
    job = {"max_new_tokens": 16, "sampler": greedy, "top_tokens": ALTERNATIVES}
    solo = [idle_session.complete(q, **job) for q in QUESTIONS]
    streams = [idle_session.generate(q, **job) for q in QUESTIONS]
    together = [s.result() for s in streams]

    for question, (alone, beside) in enumerate(zip(solo, together, strict=True)):
        moved, parted = shifts(alone, record_steps(beside))  # up to and including the first parting
        last = alone.token_records[len(moved) - 1].info
        why = f", parting at token {len(moved) - 1}, where alone it led by {margin(last):.3g}" if parted else ""
        assert max(moved) <= ROUNDING_SHIFT, (
            f"question {question}: a margin moved {max(moved):.3g} nats beside others{why}"
        )
        if not parted:
            assert beside.token_ids == alone.token_ids


# -- unload and reload under load (a consumer once waited for ever) -------------------------------------------


@pytest.mark.slow  # ten loads under load
def test_unload_and_reload_under_load_ends_every_stream(engine_name):
    session = Session()
    session.load("smollm2-135m-instruct", engine=engine_name, progress=False, cache_tokens=1024)
    outcomes: list[str] = []
    stop = threading.Event()

    def hammer():
        while not stop.is_set():
            try:
                session.complete(PROMPT, max_new_tokens=3)
                outcomes.append("result")
            except (ModelUnloaded, NoModelLoaded):
                outcomes.append("unloaded")
                time.sleep(0.01)  # as a user's retry loop would; spinning starves the loading thread of the GIL

    workers = [threading.Thread(target=hammer, daemon=True) for _ in range(3)]
    for worker in workers:
        worker.start()
    for _ in range(10):
        answered = outcomes.count("result")
        deadline = time.monotonic() + 30
        while outcomes.count("result") == answered and time.monotonic() < deadline:
            time.sleep(0.05)  # unload only once this model has answered: a busy machine is slow, not stuck
        session.unload()
        time.sleep(0.05)
        session.load("smollm2-135m-instruct", engine=engine_name, progress=False, cache_tokens=1024)
    stop.set()
    for worker in workers:
        worker.join(timeout=30)

    assert not any(worker.is_alive() for worker in workers), "a stream never ended"
    assert "result" in outcomes and "unloaded" in outcomes
    assert nothing_left(session) == (0, 0)
    session.unload()


def test_a_stream_of_an_unloaded_model_says_so(engine_name):
    session = Session()
    session.load("smollm2-135m-instruct", engine=engine_name, progress=False, cache_tokens=512)
    stream = session.generate(PROMPT, max_new_tokens=200)
    reading = iter(stream)
    next(reading)  # a consumer in the middle of the answer
    session.unload()

    with pytest.raises(ModelUnloaded, match=r"job \d+ ended: the model was unloaded after \d+ new tokens"):
        stream.result()
    assert stream.cancel() is False  # an ended stream never cancels by a stale id


# -- one bad job among good ones -----------------------------------------------------------------------------


def test_wrong_types_are_refused_where_the_user_passes_them(idle_session):
    for options, message in [
        (dict(max_new_tokens=1.5), "max_new_tokens=1.5 has the wrong type: it must be an integer"),
        (dict(top_k=2.5), "top_k=2.5 has the wrong type: it must be an integer"),
        (dict(max_new_tokens="abc"), "max_new_tokens='abc' has the wrong type"),
        (dict(temperature="hot"), "temperature='hot' has the wrong type: it must be a number"),
        (dict(seed=2**64), "seed=18446744073709551616 is out of range"),
    ]:
        with pytest.raises((TypeError, ValueError), match=message):
            idle_session.generate(PROMPT, **options)
    assert idle_session.jobs() == []


def test_an_error_inside_one_jobs_step_fails_that_job_only(cpu_session, greedy, monkeypatch):
    """The CPU engine samples each job on its own and so can tell whose step failed; the ExLlama engines run
    one library call for the whole batch, where a failure fails every job (and the session carries on)."""
    idle_session = cpu_session
    assert idle_session.jobs() == []
    real = cpu_engine.draw_token
    poisoned = SamplerSettings.greedy(min_p=0.123)  # marks the job whose sampling will fail

    def failing_for_one(logits, sequence, settings, generator, **options):
        if settings.min_p == 0.123 and len(sequence) > 40:
            raise RuntimeError("boom in one job")
        return real(logits, sequence, settings, generator, **options)

    monkeypatch.setattr(cpu_engine, "draw_token", failing_for_one)
    good = [idle_session.generate(q, max_new_tokens=12, sampler=greedy) for q in QUESTIONS[:3]]
    bad = idle_session.generate(PROMPT, max_new_tokens=40, sampler=poisoned)

    with pytest.raises(JobError, match="boom in one job") as raised:
        bad.result()
    assert isinstance(raised.value.__cause__, RuntimeError)  # the engine's own error, with its traceback, beneath
    assert raised.value.__cause__.__traceback__ is not None
    assert all(s.result().new_tokens > 0 and s.error is None for s in good)
    assert nothing_left(idle_session) == (0, 0)


def test_a_failed_sample_says_why_in_its_result(cpu_session, monkeypatch):
    real = cpu_engine.draw_token

    def failing_for_the_second_sample(logits, sequence, settings, generator, **options):
        if settings.min_p == 0.123 and generator.initial_seed() == 8:  # the sample seeded 7 + 1
            raise RuntimeError("boom in sample 1")
        return real(logits, sequence, settings, generator, **options)

    monkeypatch.setattr(cpu_engine, "draw_token", failing_for_the_second_sample)
    results = start(PROMPT, n=3, seed=7, min_p=0.123, max_new_tokens=6, session=cpu_session).wait(120)

    assert [r.eos_reason is EosReason.FAILED for r in results] == [False, True, False]
    assert "boom in sample 1" in results[1].error and results[0].error is None and results[2].error is None
    assert nothing_left(cpu_session) == (0, 0)


# -- limits ---------------------------------------------------------------------------------------------------


def test_limits_are_refused_with_the_limit_and_why(idle_session):
    threads_before = threading.active_count()
    with pytest.raises(ValueError, match=r"max_new_tokens=1000000000 .* does not fit the cache .* at most \d+"):
        idle_session.generate(PROMPT, max_new_tokens=10**9)
    with pytest.raises(ValueError, match=r"n=10000 is more than the engine decodes at once \(max_batch_size 16\)"):
        start(PROMPT, n=10000, session=idle_session)
    assert idle_session.jobs() == []
    assert threading.active_count() == threads_before


def test_samples_are_consumed_on_one_thread_not_one_each(idle_session):
    threads_before = threading.active_count()
    generation = start(PROMPT, template="raw", n=8, max_new_tokens=40, session=idle_session)
    during = threading.active_count()
    generation.cancel()
    generation.wait(30)

    assert during - threads_before == 1


# -- loading ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["garbage config", "config only", "huge cache", "broken weights"])
def test_a_failed_load_keeps_the_model_that_was_loaded(tmp_path, damage, engine_name):
    session = Session()
    session.load("smollm2-135m-instruct", engine=engine_name, progress=False, cache_tokens=512)
    model_dir = session.options.model_dir
    folder = tmp_path / "model"
    folder.mkdir()
    options = dict(engine=engine_name, progress=False)
    if damage == "garbage config":
        (folder / "config.json").write_text("{not json")
    elif damage == "config only":
        (folder / "config.json").write_text((model_dir / "config.json").read_text())
    elif damage == "huge cache":
        folder, options = model_dir, dict(options, cache_tokens=10**12)
    else:
        for item in model_dir.iterdir():
            (folder / item.name).write_bytes(item.read_bytes())
        (folder / "model.safetensors").write_bytes(b"\0" * 1024)

    with pytest.raises((ValueError, FileNotFoundError, LoadFailed)) as refused:
        session.load(str(folder), **options)

    assert "\n" not in str(refused.value)
    assert session.options.model_dir == model_dir
    if damage == "broken weights":
        assert "is loaded again" in str(refused.value)
    assert (
        "Paris"
        in session.complete(
            chatml("What is the capital of France?"), max_new_tokens=12, sampler=SamplerSettings.greedy()
        ).text
    )
    session.unload()


def test_loading_another_model_while_jobs_run_needs_reload(engine_name):
    session = Session()
    session.load("smollm2-135m-instruct", engine=engine_name, progress=False, cache_tokens=512)
    stream = session.generate(PROMPT, max_new_tokens=200)

    with pytest.raises(ValueError, match=r"1 job\(s\) are running .* Pass reload=True"):
        session.load("smollm2-135m-instruct", engine=engine_name, progress=False, cache_tokens=1024)
    assert not stream.done and session.options.cache_tokens == 512

    session.load("smollm2-135m-instruct", engine=engine_name, progress=False, cache_tokens=1024, reload=True)
    with pytest.raises(ModelUnloaded):
        stream.result()
    assert session.options.cache_tokens == 1024
    session.unload()


# -- the event loop is never held for an engine step ----------------------------------------------------------


@pytest.mark.slow  # a 5,000-token prefill
def test_async_calls_during_a_long_prefill_never_block_the_event_loop(idle_session):
    """Field report-style abuse: a 5,000-token prompt prefills in steps of about a second on two cores.
    Calls made from the event loop queue their command and await the answer; the loop keeps ticking."""
    long_prompt = chatml(" ".join(f"Note {i}: the baker counts loaves." for i in range(600)))
    blocking_waits, lags = [], []

    async def ticker(stop: asyncio.Event):
        while not stop.is_set():
            before = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append(time.perf_counter() - before - 0.01)

    async def abuse():
        stop = asyncio.Event()
        ticking = asyncio.create_task(ticker(stop))
        prefill = await idle_session.agenerate(long_prompt, max_new_tokens=4)
        for _ in range(3):
            idle_session.jobs()  # a view: never waits for the step in progress
            short = await idle_session.agenerate(PROMPT, max_new_tokens=30)
            async for _ in short:  # leaving the loop cancels without waiting
                break
            await idle_session.acancel(short.job_id)
            await asyncio.sleep(0.2)
        started = time.perf_counter()
        await asyncio.to_thread(idle_session.jobs)  # a blocking call, off the loop: how long a step holds it
        blocking_waits.append(time.perf_counter() - started)
        prefill.request_cancel()
        stop.set()
        await ticking

    asyncio.run(abuse())
    settle(idle_session)
    worst = max(lags)
    record = {"worst_loop_lag_s": worst, "blocking_call_s": blocking_waits[0], "ticks": len(lags)}
    print(json.dumps(record))

    assert worst < 0.5, record  # before: 1.3 to 6 s, a whole prefill step
    assert nothing_left(idle_session) == (0, 0)


def test_the_cache_and_job_views_come_back_while_a_step_is_still_running(idle_session, shell, monkeypatch, capsys):
    """A long prefill step held `%exl_cache` 3-5 s: a view used to be a command, which waits for the step. The
    step here is held open until the views have come back (20 s at most); before, they came back after it."""
    engine = idle_session.engine
    real_step, in_step, release, steps_ended = engine.step, threading.Event(), threading.Event(), []

    def held_step():
        in_step.set()
        release.wait(20)
        events = real_step()
        steps_ended.append(True)
        return events

    monkeypatch.setattr(engine, "step", held_step)
    stream = idle_session.generate(PROMPT, max_new_tokens=4)
    try:
        assert in_step.wait(20)
        rows, view = idle_session.jobs(), idle_session.cache_view()
        shell.run_line_magic("exl_cache", "--display text")
        ended_before_the_views_came_back = bool(steps_ended)
    finally:
        release.set()

    assert not ended_before_the_views_came_back
    assert [row.info.job_id for row in rows] == [stream.job_id]  # as published when the job was queued
    assert view.total_pages > 0 and f"{view.free_pages} free" in capsys.readouterr().out
    assert stream.result().new_tokens == 4
    assert nothing_left(idle_session) == (0, 0)


# -- a real kernel, interrupted as JupyterLab interrupts it, in either display --------------------------------
# (bad inputs through the magics in a real kernel: tests/test_bad_inputs.py, which docs/bad-inputs.md is made from)

INTERRUPTED_CELLS = {
    "generate": "%%exl_generate --display {display} --max-new-tokens 400 --min-new-tokens 400 --seed 1\n"
    "Tell me a very long story about a dragon who learns to bake bread.",
    "bench": "%exl_bench --display {display} --num-requests 4 --prompt-len 8 --output-len 400",
}


@pytest.fixture(scope="module")
def kernel():
    """A kernel without a widget front end (as papermill and nbclient start one), the bundled model loaded."""
    pytest.importorskip("jupyter_client", reason="the kernel tests need the notebook stack: pip install -e '.[test]'")
    from docs.bad_inputs import Kernel

    started = Kernel()
    try:
        reply = started.execute("%load_ext exlnb\n%exl_load --engine cpu\nfrom exlnb import get_session")
        assert reply.error is None, reply.seen()
        yield started
    finally:
        started.close()


@pytest.mark.slow
@pytest.mark.parametrize("display", ["text", "widget"])
@pytest.mark.parametrize("magic", sorted(INTERRUPTED_CELLS))
def test_a_kernel_interrupt_stops_the_cell_in_either_display_with_one_line_and_no_job_left(kernel, magic, display):
    def tokens_flow(reply) -> bool:  # the cell has shown something: its jobs are queued or running
        return bool(reply.stdout or reply.stderr or reply.widget_html or reply.widgets)

    reply = kernel.execute(INTERRUPTED_CELLS[magic].format(display=display), interrupt_when=tokens_flow)
    left = kernel.execute("print(len(get_session().run_on_engine(lambda engine: engine.jobs())))")

    assert reply.error is not None, "the cell ran to its end: the interrupt was not heard while it ran"
    assert reply.error["ename"] == "Interrupted" and len(reply.error["traceback"]) == 1, reply.error
    assert left.stdout.strip() == "0"


@pytest.mark.gpu
def test_twenty_reloads_return_device_memory_to_its_first_level():
    """On the GPU: after 20 unload/load cycles the device holds what it held after the first load (within 1%)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    session = Session()
    session.load("smollm2-135m-instruct", engine="exllamav2", progress=False, cache_tokens=4096)
    session.complete(PROMPT, max_new_tokens=8)
    first = torch.cuda.memory_allocated()
    levels = []
    for _ in range(20):
        session.unload()
        session.load("smollm2-135m-instruct", engine="exllamav2", progress=False, cache_tokens=4096)
        session.complete(PROMPT, max_new_tokens=8)
        levels.append(torch.cuda.memory_allocated())
    session.unload()
    print(json.dumps({"first_load_bytes": first, "after_each_reload_bytes": levels}))

    assert max(abs(level - first) for level in levels) <= 0.01 * first, (first, levels)
