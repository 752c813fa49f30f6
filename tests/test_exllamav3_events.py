"""exllamav3's result dicts become exlnb events, checked on the CPU with a scripted generator.

The dicts have the shapes exllamav3 1.6.5 emits (`Generator.iterate`, `Job.receive_sample`'s `emit`,
`Generator.reap_failed_job`); the GPU tests run the same engine over the real library.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from exlnb.engines.base import EosReason, JobFailed, JobSpec, Stage
from exlnb.engines.exllamav3 import ExLlamaV3Engine

IM_END = 2


@dataclass
class ScriptedJob:
    identifier: int
    new_tokens: int = 0
    cached_pages: int = 0
    cached_tokens: int = 0
    sequences: list = field(default_factory=list)


class ScriptedPageTable:
    last_defrag_serial = 0

    def defrag(self):
        self.last_defrag_serial += 1


class ScriptedGenerator:
    def __init__(self):
        self.steps: list[list[dict]] = []
        self.pending_jobs: list = []
        self.pagetable = ScriptedPageTable()
        self.cancelled: list = []

    def iterate(self):
        return self.steps.pop(0)

    def cancel(self, job):
        self.cancelled.append(job)
        self.pagetable.defrag()


@pytest.fixture
def engine(monkeypatch):
    engine = object.__new__(ExLlamaV3Engine)  # no exllamav3 here: the parts __init__ would load are scripted
    engine.generator = ScriptedGenerator()
    engine._start_tracking()
    engine._count_defrags(engine.generator.pagetable, "defrag")
    engine._failed_step_events = []
    monkeypatch.setattr(engine, "synchronize", lambda: None)
    return engine


def track(engine, prompt=(1, 2, 3), max_new=10, asked=10) -> tuple[int, ScriptedJob]:
    job_id = engine._new_job_id()
    job = ScriptedJob(job_id)
    engine._track(job_id, job, JobSpec(prompt, max_new_tokens=asked), max_new)
    return job_id, job


def streaming(job, text="", ids=(), **extra) -> dict:
    result = {"job": job, "stage": "streaming", "serial": 0, "eos": "eos_reason" in extra, "identifier": job.identifier}
    if text:
        result["text"] = text
    if ids:
        result["token_ids"] = torch.tensor([ids])
    return result | extra


def test_a_stop_token_is_reported_and_its_text_left_out(engine):
    job_id, job = track(engine)
    engine.generator.steps = [
        [{"job": job, "stage": "started", "eos": False, "serial": 0, "identifier": job_id}],
        [streaming(job, " Paris", (7,))],
        [streaming(job, eos_reason="stop_token", eos_triggering_token_id=IM_END, eos_triggering_token_str="<|im_end|>",
                   held={"text": ".<|im_end|>", "token_ids": torch.tensor([[8, IM_END]])})],
    ]
    started = engine.step()
    job.new_tokens = 1
    middle = engine.step()
    job.new_tokens = 3
    last = engine.step()

    assert [e.stage for e in started + middle + last] == [Stage.PREFILL, Stage.DECODE, Stage.DONE]
    assert "".join(e.text for e in middle + last) == " Paris."
    assert [t for e in middle + last for t in e.token_ids] == [7, 8, IM_END]
    assert last[0].eos_reason is EosReason.STOP_TOKEN and last[0].new_tokens == 3
    assert not engine.has_work()


@pytest.mark.parametrize(
    "reason, max_new, asked, expected",
    [("loop_detected", 10, 10, EosReason.LOOP_DETECTED), ("max_new_tokens", 10, 10, EosReason.MAX_NEW_TOKENS),
     ("max_new_tokens", 6, 10, EosReason.END_OF_CACHE), ("stop_string", 10, 10, EosReason.STOP_STRING)],
)
def test_the_end_is_named_in_exlnb_terms(engine, reason, max_new, asked, expected):
    _, job = track(engine, max_new=max_new, asked=asked)
    engine.generator.steps = [[streaming(job, "x", (5,), eos_reason=reason)]]
    assert engine.step()[0].eos_reason is expected


def test_a_job_exllamav3_reaps_fails_alone_and_the_others_events_arrive_next_step(engine):
    failing_id, failing = track(engine)
    other_id, other = track(engine)
    engine.generator.steps = [
        [streaming(other, "a", (4,)), {"job": failing, "serial": 1, "stage": "error", "eos": True, "error": RuntimeError("nan")}],
        [streaming(other, "b", (5,), eos_reason="max_new_tokens")],
    ]
    with pytest.raises(JobFailed) as failed:
        engine.step()
    assert failed.value.job_ids == (failing_id,) and engine.has_work()

    events = engine.step()
    assert [(e.job_id, e.text) for e in events] == [(other_id, "a"), (other_id, "b")]
    assert not engine.has_work()


def test_cancel_releases_the_job_and_counts_a_real_defragmentation(engine):
    job_id, job = track(engine)
    assert engine.cancel(job_id) and not engine.cancel(job_id)
    assert engine.generator.cancelled == [job] and engine.defrag_count == 1
    assert engine.jobs() == []
