"""The widgets without a browser: what they show, when they redraw, what their buttons do, and the static
record they leave in the notebook.

The front end's messages are delivered as the comm would deliver them (tests/test_browser.py covers the
real front end).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
import time

import pytest
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from exlnb import EosReason
from exlnb.engines.base import DecodeSpan
from exlnb.generation import start
from exlnb.widgets.cache import CacheInspector, JobTable, jobs_html, jobs_summary
from exlnb.widgets.figures import generation_text
from exlnb.widgets.loadtest import abench
from exlnb.widgets.stream import StreamView

PROMPT = "Tell me a very long story about a dragon who learns to bake bread."
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


@pytest.fixture
def idle(cpu_session):
    assert cpu_session.jobs() == []
    yield cpu_session
    cpu_session.cancel_all()


@pytest.fixture(scope="module")
def shell():
    return InteractiveShell.instance()


def send(view, content: dict) -> None:
    view.handle(content)


def settle(condition, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.01)


def test_a_finished_generation_leaves_its_answer_and_statistics_as_static_output(idle, shell):
    with capture_output(stdout=False, stderr=False) as captured:
        generation = start("What is the capital of France?", max_new_tokens=4, temperature=0)
        view = StreamView(generation, max_new_tokens=4)
        view.show()
        generation.wait(60)
        settle(lambda: view.settled)

    shown, record = captured.outputs[0], captured.outputs[-1]
    assert WIDGET_MIME in shown.data  # live while it ran
    assert WIDGET_MIME not in record.data and record.update  # then replaced in place by plain HTML and text
    answer = generation.samples[0].text
    assert answer and answer.strip() in record.data["text/plain"]
    assert "TTFT" in record.data["text/plain"] and "ended: max new tokens reached" in record.data["text/plain"]
    assert "4/4 tokens" in record.data["text/html"] and "<style>" in record.data["text/html"]
    assert view.controls == [] and view.comm is None  # no Stop button left behind, the widget closed


def test_a_finished_bench_leaves_its_progress_as_static_output(idle, shell):
    with capture_output(stdout=False, stderr=False) as captured:
        result = asyncio.run(abench([math.inf, 40], num_requests=2, prompt_len=8, output_len=3, display="widget"))

    shown, record = captured.outputs[0], captured.outputs[-1]
    assert WIDGET_MIME in shown.data  # live while it ran
    assert WIDGET_MIME not in record.data and record.update  # then replaced in place by plain HTML and text
    lines = record.data["text/plain"].splitlines()
    assert lines[0] == "load test: 2 requests at inf, 40 req/s"
    for line, run in zip(lines[1:], result.runs):
        assert line.startswith(f"{run.request_rate:g} req/s · done · 2 of 2 requests finished · TTFT median ")
        assert f"p99 {run.metrics.ttft_ms.p99:.0f} ms · TPOT median {run.metrics.tpot_ms.median:.1f} ms" in line
    assert record.data["text/html"].count('class="exlnb-sample exlnb-done"') == 2
    assert 'style="width:100.0%"' in record.data["text/html"]


def test_stop_cancels_every_sample_and_removes_the_button(idle):
    generation = start(PROMPT, n=2, max_new_tokens=400, temperature=1.0)
    view = StreamView(generation, max_new_tokens=400)
    settle(lambda: all(s.token_ids for s in generation.samples))
    send(view, {"type": "stop"})
    results = generation.wait(30)
    settle(lambda: view.settled)

    assert all(r.eos_reason is EosReason.CANCELLED for r in results)
    assert all(s.stopped_by == "stop button" for s in generation.samples)
    assert view.html.count('class="exlnb-sample exlnb-stopped"') == 2 and view.controls == []
    assert idle.jobs() == []


def test_a_wrong_template_is_one_warning_above_the_answer(idle):
    generation = start("Hi", template="llama3", max_new_tokens=1)
    generation.wait(60)
    view = StreamView(generation, max_new_tokens=1)

    assert view.html.count("exlnb-warning") == 1
    assert view.html.index("exlnb-warning") < view.html.index("exlnb-text")
    assert f"{len(generation.prompt_findings)} findings" in view.html
    assert view.text().startswith("warning: the prompt does not follow the template")


def test_cached_prefill_says_what_was_computed(idle):
    notes = " ".join(f"Line {i}: the oven is at {i * 10} degrees." for i in range(60))
    start(notes, max_new_tokens=1, temperature=0).wait(60)
    generation = start(notes, max_new_tokens=1, temperature=0)
    generation.wait(60)
    event = generation.samples[0].last
    view = StreamView(generation, max_new_tokens=1)

    assert event.cached_tokens > 0
    assert f"cached <b>{event.cached_tokens}</b>" in view.html
    assert f"prefill <b>{event.computed_prompt_tokens} tokens in " in view.html


def test_an_interrupted_cell_prints_one_line_and_no_traceback(idle, shell, capsys):
    async def interrupt_cell():
        code = (
            f"from exlnb import agenerate_live\nawait agenerate_live({PROMPT!r}, max_new_tokens=400, display='widget')"
        )
        task = asyncio.ensure_future(
            shell.run_cell_async(code, store_history=False, transformed_cell=shell.transform_cell(code))
        )
        while not any(row.info.new_tokens for row in idle.jobs()):
            assert not task.done(), task.result().error_in_exec
            await asyncio.sleep(0.01)
        task.cancel()  # what ipykernel does on an interrupt while a cell awaits
        return await task

    with capture_output(stdout=False, stderr=False):
        result = asyncio.run(interrupt_cell())
    lines = capsys.readouterr().out.strip().splitlines()

    assert len(lines) == 1 and re.fullmatch(r"interrupted: job \d+ cancelled after \d+ tokens", lines[0]), lines
    assert type(result.error_in_exec).__name__ == "Interrupted"
    settle(lambda: idle.jobs() == [])


def test_inspector_redraws_while_visible_and_jobs_run_and_sleeps_when_hidden_or_idle(idle):
    inspector = CacheInspector(idle, interval=0.02, idle_check=0.02, retire_after=60)
    try:
        generation = start(PROMPT, max_new_tokens=2000, temperature=1.0)
        send(inspector, {"type": "visible", "view": "a", "visible": True})
        settle(lambda: inspector.refreshing)
        before = inspector.refresh_count
        settle(lambda: inspector.refresh_count >= before + 3)
        assert f"job {generation.samples[0].stream.job_id}" in inspector.html
        assert "exlnb-page exlnb-used" in inspector.html

        send(inspector, {"type": "visible", "view": "a", "visible": False})
        settle(lambda: not inspector.refreshing)
        hidden_at = inspector.refresh_count
        time.sleep(0.5)  # 25 redraw intervals
        assert inspector.refresh_count == hidden_at, "redrew while hidden"

        generation.cancel()
        generation.wait(30)
        send(inspector, {"type": "visible", "view": "a", "visible": True})
        settle(lambda: "idle" in inspector.html)
        idle_at = inspector.refresh_count
        time.sleep(0.5)
        assert inspector.refresh_count == idle_at, "redrew with no job running"
        assert "0 of" in inspector.html
    finally:
        inspector.close()


def test_inspector_settles_into_its_last_state_with_jobs_once_they_have_ended(idle, shell):
    with capture_output(stdout=False, stderr=False) as captured:
        inspector = CacheInspector(idle, interval=0.02, idle_check=0.02, retire_after=0.2)
        inspector.show()
        generation = start(PROMPT, max_new_tokens=2000, temperature=1.0)
        send(inspector, {"type": "visible", "view": "a", "visible": True})
        settle(lambda: inspector.refreshing)
        generation.cancel()
        settle(lambda: inspector.settled)

    record = captured.outputs[-1]
    assert record.update and WIDGET_MIME not in record.data
    assert f"job {generation.samples[0].stream.job_id}" in record.data["text/html"]
    assert "had ended by" in record.data["text/plain"] and "had ended by" in record.data["text/html"]
    shown = record.data["text/html"].split("</style>", 1)[1]
    assert not re.search(r"\blive\b", shown)  # a record is not live, whatever it recorded


def test_job_table_cancel_and_cancel_all_end_the_jobs(idle):
    table = JobTable(idle, interval=0.02)
    try:
        generation = start(PROMPT, n=3, max_new_tokens=2000, temperature=1.0)
        job_ids = [s.stream.job_id for s in generation.samples]
        table.refresh()
        assert all(f'data-job="{j}"' in table.html for j in job_ids)

        send(table, {"type": "cancel", "job": str(job_ids[0])})  # queued: a button never waits for a step
        settle(lambda: f'data-job="{job_ids[0]}"' not in table.html)
        assert all(f'data-job="{j}"' in table.html for j in job_ids[1:])
        send(table, {"type": "cancel_all"})
        settle(lambda: "no pending or active jobs" in table.html)
        assert "Cancel all" not in table.html
        generation.wait(30)
        assert idle.jobs() == []
    finally:
        table.close()


class EndingAsRead:
    """The session as a live view sees it when its jobs end between two reads of the job table."""

    def __init__(self, session, rows):
        self.session, self.rows = session, rows

    def jobs(self):
        rows, self.rows = self.rows, []
        return rows

    def __getattr__(self, name):
        return getattr(self.session, name)


def test_a_state_recorded_as_running_shows_the_jobs_that_made_it_running(idle):
    generation = start(PROMPT, n=2, max_new_tokens=2000, temperature=1.0)
    try:
        rows = idle.jobs()
        assert len(rows) == 2
        for view_type in (JobTable, CacheInspector):
            view = view_type(EndingAsRead(idle, rows), interval=0.02)
            view.close()
            view.retire()  # what it settles into once every job has ended
            assert all(f"job {row.info.job_id}" in view.text() for row in rows), view.text()
            assert "had ended by" in view.text()
    finally:
        generation.cancel()
        generation.wait(30)


def test_only_a_job_that_nobody_reads_is_marked_unread(idle):
    long = dict(max_new_tokens=2000, min_new_tokens=2000)  # none ends on its own during the test
    generation = start(PROMPT, n=2, temperature=1.0, **long)  # read by its generation, as a widget shows it
    leaked = idle.generate(PROMPT, **long)  # held and never read: what the mark exists to catch
    try:
        settle(lambda: len(idle.jobs()) == 3)
        table, inspector = JobTable(idle, interval=0.02), CacheInspector(idle, interval=0.02)
        table.close()
        inspector.close()
        read = {int(line.split()[1]): line.split()[-1] for line in table.text().splitlines()[1:]}

        assert read == {**{s.stream.job_id: "yes" for s in generation.samples}, leaked.job_id: "no"}
        assert "3 jobs, 1 with nobody reading" in table.html
        unread = set(re.findall(r"job (\d+) \([^)]*nobody reading\)", inspector.html))  # legend text and tooltip
        assert unread == {str(leaked.job_id)}
    finally:
        leaked.cancel()
        generation.cancel()
        generation.wait(30)


def test_a_stopped_run_reads_stopped_with_its_reason_in_words_everywhere(idle):
    generation = start(PROMPT, max_new_tokens=2000, min_new_tokens=2000, temperature=1.0)
    settle(lambda: generation.samples[0].token_ids)
    generation.cancel("stop button")
    generation.wait(30)
    view = StreamView(generation, max_new_tokens=2000)
    status = view.text().splitlines()[-1]

    assert status.startswith("[stopped · ") and "done" not in status  # the plain-text record, as nbconvert shows it
    assert status.endswith("ended: cancelled (stop button)]") and "exlnb-stopped" in view.html
    assert "eos:" not in view.text() + view.html


def test_end_reasons_are_plain_words_not_the_libraries_names(idle):
    generation = start("What is the capital of France?", max_new_tokens=30, temperature=0)
    generation.wait(60)
    reason = generation.samples[0].eos_reason
    view = StreamView(generation, max_new_tokens=30)

    assert reason is EosReason.STOP_TOKEN
    assert "ended: end of turn" in view.text() and "ended: end of turn" in view.html
    assert reason.value not in view.text() + view.html


def test_the_settings_in_effect_are_shown_with_the_answer(idle):
    generation = start(
        "Name a fruit.",
        max_new_tokens=3,
        dry_multiplier=0.8,
        xtc_probability=0.5,
        xtc_threshold=0.2,
        banned_strings=["apple"],
        stop=["\n\n"],
        seed=1,
    )
    generation.wait(60)
    view = StreamView(generation, max_new_tokens=3)
    line = view.text().splitlines()[0]

    assert line.startswith("sampler: temperature 0.8, top_k 50, top_p 0.8, rep_penalty 1.025, ")  # defaults too
    assert "dry_multiplier 0.8, xtc_probability 0.5, xtc_threshold 0.2" in line
    assert "banned: 'apple'" in line and "stop: '\\n\\n'" in line
    assert "banned: &#x27;apple&#x27;" in view.html
    constrained = start("Name a fruit.", max_new_tokens=3, temperature=0, regex="[a-z]+")
    constrained.wait(60)
    assert "sampler: greedy, rep_penalty 1.025 · answer constrained by a regex '[a-z]+'" in generation_text(constrained)


def test_samples_that_did_different_prompt_work_show_their_own_ttft(idle):
    generation = start(PROMPT, n=2, max_new_tokens=2, temperature=0)
    generation.wait(60)
    shared = StreamView(generation, max_new_tokens=2).html
    head = re.search(r'<div class="exlnb-head">(.*?)</div>', shared).group(1)
    assert "TTFT" in head and shared.count("TTFT") == 1  # the same prompt work: one TTFT, in the head

    # the second sample found the prompt cached, as a sample started after the first one's prefill does
    first = generation.samples[0].last
    generation.samples[1].last = dataclasses.replace(
        first,
        job_id=generation.samples[1].last.job_id,
        cached_tokens=first.prompt_tokens - 1,
        time_to_first_token_s=first.time_to_first_token_s / 10,
    )
    apart = StreamView(generation, max_new_tokens=2).html
    head = re.search(r'<div class="exlnb-head">(.*?)</div>', apart).group(1)
    statuses = re.findall(r'<div class="exlnb-status">(.*?)</div>', apart)
    assert "TTFT" not in head and len(statuses) == 2
    assert all(status.count("TTFT") == 1 and "prefill" in status for status in statuses)


def test_the_status_says_when_a_ban_took_text_back(idle):
    plain = start("The capital of France is", max_new_tokens=4, temperature=0, min_new_tokens=4)
    plain.wait(60)
    banned = plain.samples[0].text.split()[0]  # the word the model says first, then banned
    generation = start(
        "The capital of France is", max_new_tokens=4, temperature=0, min_new_tokens=4, banned_strings=[banned]
    )
    generation.wait(60)
    view = StreamView(generation, max_new_tokens=4)

    assert banned.lower() not in generation.samples[0].text.lower()
    assert "a banned string was taken back once" in view.text() and "a banned string was taken back once" in view.html
    assert "taken back" not in StreamView(plain, max_new_tokens=4).text()


def serial_events(generation, starts_s: list[float], tokens: int, decode_s: float) -> None:
    """Each sample's last event as a server that runs one request at a time would give it: sample i's first token
    at `starts_s[i]`, then `tokens - 1` more over `decode_s`."""
    for sample, start_s in zip(generation.samples, starts_s):
        enqueued = sample.last.time_enqueued
        sample.last = dataclasses.replace(
            sample.last,
            new_tokens=tokens,
            time_to_first_token_s=start_s,
            time_produced=enqueued + start_s + decode_s,
            decode_tokens_per_s=(tokens - 1) / decode_s,
        )


def test_several_samples_decode_rate_is_their_tokens_over_the_time_any_was_decoding(idle):
    """llama-cpp-python served four samples one after another, and the header said "decode 65.8 tok/s (4 samples
    together)" for 104 tokens in 7.8 s: the sum of each sample's own rate."""
    generation = start(PROMPT, n=4, max_new_tokens=2, temperature=0)
    generation.wait(60)
    serial_events(generation, [0.2, 2.2, 4.2, 6.2], tokens=26, decode_s=1.95)
    view = StreamView(generation, max_new_tokens=26)
    head = re.search(r'<div class="exlnb-head">(.*?)</div>', view.html).group(1)

    assert DecodeSpan.of([s.last for s in generation.samples]) == DecodeSpan(100, pytest.approx(7.8), 4)
    assert "decode <b>12.8 tok/s</b>" in head  # 100 tokens / 7.8 s, not 4 x 12.8
    assert "(4 samples together: 100 tokens over the 7.8 s while any was decoding)" in head
    assert "decode 12.8 tok/s (4 samples together: 100 tokens over the 7.8 s" in view.text()  # and the plain record

    overlapping = [(0.2, 3.0), (1.0, 2.0), (2.5, 4.0)]  # one interval inside another, one running past the first
    events = [
        dataclasses.replace(
            generation.samples[0].last, time_enqueued=0.0, time_to_first_token_s=first, time_produced=end, new_tokens=11
        )
        for first, end in overlapping
    ]
    assert DecodeSpan.of(events) == DecodeSpan(30, pytest.approx(3.8), 3)


def test_samples_decoding_side_by_side_share_the_time_their_rate_is_taken_over(idle):
    generation = start(PROMPT, n=3, max_new_tokens=12, min_new_tokens=12, temperature=1.0, seed=4)
    generation.wait(60)
    events = [s.last for s in generation.samples]
    span = DecodeSpan.of(events)
    head = re.search(r'<div class="exlnb-head">(.*?)</div>', StreamView(generation, max_new_tokens=12).html).group(1)

    assert span.tokens == 33 and span.seconds < sum(
        e.time_produced - e.time_enqueued - e.time_to_first_token_s for e in events
    )
    assert f"decode <b>{span.tokens_per_s:.1f} tok/s</b>" in head
    # decoded in one batch, they share the time: together about the three rates summed (in turn, it was not)
    assert span.tokens_per_s == pytest.approx(sum(e.decode_tokens_per_s for e in events), rel=0.15)


def test_a_sample_that_waited_for_another_samples_prefill_says_so_not_a_prefill_rate(idle):
    """Samples started together share the prompt's pages: sample 0 computes them while the others wait, and their
    "prefill 76 tokens in 3153 ms (24 tok/s)" was that wait."""
    notes = " ".join(f"Entry {i}: the lighthouse keeper logs ship number {i * 7} at dusk." for i in range(40))
    generation = start(notes, n=2, max_new_tokens=2, temperature=0)
    generation.wait(120)
    first, second = (s.last for s in generation.samples)
    view = StreamView(generation, max_new_tokens=2)
    computed, waited = (line for line in view.text().splitlines() if line.startswith("["))

    shared = second.cached_tokens - first.cached_tokens
    assert shared >= 256 and first.cached_tokens == 0  # a page or more that sample 0 computed
    assert f"prefill {first.computed_prompt_tokens} tokens in " in computed and "waited" not in computed
    assert (
        f"waited for sample 0's prefill of {shared} prompt tokens · prefill {second.computed_prompt_tokens} tokens ·"
        in waited
    )
    assert "tok/s) ·" not in waited.split("decode")[0]  # no prefill rate: the time was mostly the wait
    assert f"waited for <b>sample 0&#x27;s prefill of {shared} prompt tokens</b>" in view.html


def test_a_ttft_says_how_long_its_job_waited_before_its_prefill(idle):
    """TTFT 1196 ms beside a 216 ms prefill read as a contradiction: the rest was the wait before the prefill."""
    generation = start("What is the capital of France?", max_new_tokens=2, temperature=0)
    generation.wait(60)
    last = generation.samples[0].last
    generation.samples[0].last = dataclasses.replace(
        last, time_to_first_token_s=1.196, prefill_tokens_per_s=last.computed_prompt_tokens / 0.216
    )
    status = StreamView(generation, max_new_tokens=2).text().splitlines()[-1]
    assert (
        f"TTFT 1196 ms (980 ms before its prefill began) · prefill {last.computed_prompt_tokens} tokens in 216 ms"
        in status
    )


def test_another_templates_tags_are_one_finding_naming_the_models_own_template(idle):
    generation = start("Hi", template="llama3", max_new_tokens=1)
    generation.wait(60)
    view = StreamView(generation, max_new_tokens=1)
    items = re.findall(r"<li>(.*?)</li>", view.html)

    tags = sum(f.kind.value == "special_as_text" for f in generation.prompt_findings)
    assert tags >= 4 and len(items) == 1 + len(generation.prompt_findings) - tags
    assert items[0].startswith(f"{tags} llama3 tags are plain text here (&lt;|begin_of_text|&gt;, ")
    assert items[0].endswith("this model&#x27;s template is chatml (--template chatml, or auto)")
    assert "and " not in view.html.split("exlnb-warning")[1].split("</ul>")[0]  # nothing left uncounted


def test_a_settled_job_table_shows_each_job_as_it_ended(idle, shell):
    """A settled table kept "decode 395/400" for jobs that ended at 400/400: its last drawing while they ran."""
    with capture_output(stdout=False, stderr=False) as captured:
        table = JobTable(idle, interval=0.02, idle_check=0.02, retire_after=0.2)
        table.show()
        generation = start(PROMPT, max_new_tokens=24, min_new_tokens=24, temperature=1.0)
        send(table, {"type": "visible", "view": "a", "visible": True})
        settle(lambda: table.refreshing)
        generation.wait(60)
        settle(lambda: table.settled)

    job = generation.samples[0].stream.job_id
    record = captured.outputs[-1].data
    row = next(line for line in record["text/plain"].splitlines() if line.startswith(f"job {job} "))
    assert "ended: max new tokens reached" in row and "24 / 24" in row and "freed" in row
    assert "ended: max new tokens reached</td>" in record["text/html"] and "decode</td>" not in record["text/html"]


def test_the_job_table_says_what_its_stream_read_column_means(idle):
    generation = start(PROMPT, max_new_tokens=2000, min_new_tokens=2000, temperature=1.0)
    try:
        settle(lambda: len(idle.jobs()) == 1)
        rows = idle.jobs()
        page = jobs_html(rows, time.perf_counter())
        assert jobs_summary(rows) == "1 job, read by its stream"
        assert '<th title="whether something still reads the job&#x27;s stream' in page
        assert "stream read: whether something still reads the job&#x27;s answer as it comes" in page
        unread = [dataclasses.replace(row, consumed=False) for row in rows * 2]
        assert jobs_summary(unread) == (
            "2 jobs, 2 with nobody reading its stream (they still hold cache pages and a batch slot)"
        )
    finally:
        generation.cancel()
        generation.wait(30)
