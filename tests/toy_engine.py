"""A toy engine written by following docs/architecture.md's "A new engine" recipe, step by step.

It "generates" by echoing its prompt's tokens, over and over, one token per job per step: deterministic, so the
tests can say what every answer is, and real enough to run through the session, the magics and the widgets.
It honours what every engine must (max_new_tokens, stop tokens and strings, cancel, a batch limit, timings made
by `job_event`) and refuses, by name, what it cannot (sampling, constraints, token records, banned strings).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from exlnb.engines.base import (
    CacheView,
    Engine,
    EngineStatus,
    EosReason,
    JobClock,
    JobInfo,
    JobSpec,
    Stage,
    StreamEvent,
    job_event,
    wall_clock,
)
from exlnb.engines.options import EngineOptions
from exlnb.engines.registry import EngineSpec
from exlnb.engines.text import IncrementalDecoder, StopStringFilter
from exlnb.engines.tokenizer import HfTokenizer

# Recipe step 1: the declaration (registered by the tests' fixture with `register_engine`).
TOY_SPEC = EngineSpec(
    name="toy",
    summary="echoes its prompt, token by token: the engine recipe's worked example (tests only)",
    loads=("hf",),
    capabilities=frozenset(),
    engine_class="tests.toy_engine:ToyEngine",
    library="tokenizers",  # what it runs on: Hugging Face's tokenizers, to read and echo the prompt
)


@dataclass
class ToyJob:
    job_id: int
    spec: JobSpec
    clock: JobClock
    decoder: IncrementalDecoder
    stop_filter: StopStringFilter
    new_tokens: int = 0
    stage: Stage = Stage.PENDING

    def next_token(self) -> int:
        return self.spec.input_ids[self.new_tokens % len(self.spec.input_ids)]


class ToyEngine(Engine):
    """Recipe step 2: a subclass of `Engine`, built from `EngineOptions` (here: only the tokenizer of the folder)."""

    name = "toy"

    def __init__(self, options: EngineOptions, *, progress: bool = True) -> None:
        self.options = options
        self.tokenizer = HfTokenizer(options.model_dir)
        self.max_seq_len = options.cache_tokens
        self._ids = itertools.count(1)
        self._jobs: dict[int, ToyJob] = {}  # insertion order is age: the oldest jobs run first

    def enqueue(self, spec: JobSpec) -> int:
        self.refuse_unsupported(spec)
        if not spec.input_ids:
            raise ValueError("the toy engine echoes its prompt: give it a prompt of at least one token")
        job_id = next(self._ids)
        self._jobs[job_id] = ToyJob(
            job_id,
            spec,
            JobClock(enqueued=wall_clock()),
            IncrementalDecoder(self.tokenizer),
            StopStringFilter(spec.stop_strings),
        )
        return job_id

    def unsupported(self, spec: JobSpec) -> list[str]:
        refused = {
            "constraint": spec.constraint,
            "top_tokens": spec.top_tokens,
            "banned_strings": spec.banned_strings,
            "stop_on_loop": spec.stop_on_loop,
            "min_new_tokens": spec.min_new_tokens,
        }
        missing = [f"{name}={value!r}" for name, value in refused.items() if value]
        if spec.sampler.temperature >= 0.01:
            missing.append(f"temperature={spec.sampler.temperature!r} (the toy engine only echoes: pass temperature=0)")
        return missing

    def cancel(self, job_id: int) -> bool:
        return self._jobs.pop(job_id, None) is not None

    def step(self) -> list[StreamEvent]:
        """Admit up to max_batch_size jobs, then give each running job its next token."""
        events = []
        for job in list(self._jobs.values())[: self.options.max_batch_size]:
            if job.stage is Stage.PENDING:
                job.clock.admitted, job.stage = wall_clock(), Stage.DECODE
            events.append(self._advance(job))
        return events

    def _advance(self, job: ToyJob) -> StreamEvent:
        token = job.next_token()
        now = wall_clock()
        job.clock.token_arrived(now)
        job.new_tokens += 1
        if token in job.spec.stop_token_ids:
            return self._end(job, now, "", (token,), EosReason.STOP_TOKEN)
        text, stopped = job.stop_filter.feed(job.decoder.push(token))
        if stopped:
            return self._end(job, now, text, (token,), EosReason.STOP_STRING)
        if job.new_tokens >= job.spec.max_new_tokens or len(job.spec.input_ids) + job.new_tokens >= self.max_seq_len:
            reason = EosReason.MAX_NEW_TOKENS if job.new_tokens >= job.spec.max_new_tokens else EosReason.END_OF_CACHE
            return self._end(job, now, text + job.stop_filter.flush(), (token,), reason)
        return self._event(job, now, text, (token,))

    def _end(self, job: ToyJob, now: float, text: str, tokens: tuple[int, ...], reason: EosReason) -> StreamEvent:
        del self._jobs[job.job_id]
        job.stage = Stage.DONE
        return self._event(job, now, text, tokens, reason)

    def _event(
        self, job: ToyJob, now: float, text: str, tokens: tuple[int, ...], reason: EosReason | None = None
    ) -> StreamEvent:
        """Recipe step 3: every event from `job_event` over the job's `JobClock`, so timings mean what they mean
        on every engine."""
        return job_event(
            job.job_id,
            job.stage,
            job.clock,
            now,
            prompt_tokens=len(job.spec.input_ids),
            cached_tokens=0,
            new_tokens=job.new_tokens,
            text=text,
            token_ids=tokens,
            eos_reason=reason,
        )

    def jobs(self) -> list[JobInfo]:
        return [
            JobInfo(
                job_id=job.job_id,
                identifier=job.spec.identifier,
                stage=job.stage,
                prompt_tokens=len(job.spec.input_ids),
                new_tokens=job.new_tokens,
                max_new_tokens=job.spec.max_new_tokens,
                time_enqueued=job.clock.enqueued,
                pages=0,
            )
            for job in self._jobs.values()
        ]

    def cache_view(self) -> CacheView:
        """No cache at all: no pages to show, which the cache inspector must take in its stride."""
        return CacheView(paged=False, page_size=0, pages=(), max_tokens=self.max_seq_len)

    def status(self) -> EngineStatus:
        return EngineStatus(
            engine=self.name,
            model=self.options.model_dir.name,
            device="cpu",
            paged=False,
            attention="none (echo)",
            cache_tokens=self.max_seq_len,
            cache_dtype=self.options.cache_dtype,
            max_batch_size=self.options.max_batch_size,
        )
