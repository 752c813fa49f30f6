"""The cache inspector and job table without a browser: when they redraw, and what their buttons do.

The front end's messages are delivered as the comm would deliver them (tests/test_browser.py covers the
real front end).
"""

from __future__ import annotations

import time

import pytest

from exlnb.generation import start
from exlnb.widgets.cache import CacheInspector, JobTable

PROMPT = "Tell me a very long story about a dragon who learns to bake bread."


@pytest.fixture
def idle(cpu_session):
    assert cpu_session.jobs() == []
    yield cpu_session
    cpu_session.cancel_all()


def send(view, content: dict) -> None:
    view._on_front_end_message(view, content, [])


def settle(condition, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.01)


def test_inspector_redraws_while_visible_and_jobs_run_and_sleeps_when_hidden_or_idle(idle):
    inspector = CacheInspector(idle, interval=0.02, idle_check=0.02)
    try:
        generation = start(PROMPT, max_new_tokens=2000, temperature=1.0)
        send(inspector, {"type": "visible", "view": "a", "visible": True})
        settle(lambda: inspector.refreshing)
        before = inspector.refresh_count
        settle(lambda: inspector.refresh_count >= before + 3)
        assert f"job {generation.samples[0].stream.job_id}" in inspector.legend
        assert any(kind == "used" for _background, _title, kind in inspector.cells)

        send(inspector, {"type": "visible", "view": "a", "visible": False})
        settle(lambda: not inspector.refreshing)
        hidden_at = inspector.refresh_count
        time.sleep(0.5)  # 25 redraw intervals
        assert inspector.refresh_count == hidden_at, "redrew while hidden"

        generation.cancel()
        generation.wait(30)
        send(inspector, {"type": "visible", "view": "a", "visible": True})
        settle(lambda: "idle" in inspector.summary)
        idle_at = inspector.refresh_count
        time.sleep(0.5)
        assert inspector.refresh_count == idle_at, "redrew with no job running"
        assert "0 of" in inspector.summary
    finally:
        inspector.close()


def test_job_table_cancel_and_cancel_all_end_the_jobs(idle):
    table = JobTable(idle, interval=0.02)
    try:
        generation = start(PROMPT, n=3, max_new_tokens=2000, temperature=1.0)
        job_ids = [s.stream.job_id for s in generation.samples]
        table.refresh()
        assert sorted(row["job_id"] for row in table.rows) == sorted(job_ids)

        send(table, {"type": "cancel", "job_id": job_ids[0]})
        assert sorted(row["job_id"] for row in table.rows) == sorted(job_ids[1:])
        send(table, {"type": "cancel_all"})
        assert table.rows == [] and table.summary == "no pending or active jobs"
        generation.wait(30)
        assert idle.jobs() == []
    finally:
        table.close()
