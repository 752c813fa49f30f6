"""Which jobs run in the next forward pass, and with how many tokens each.

Continuous batching: every step, newly admitted jobs join the jobs already running. Decoding jobs add one
token each; jobs still ingesting their prompt take chunks from what is left of the step's token budget,
so a long prompt never freezes everyone else's decoding for its whole prefill.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from exlnb.engines.base import JobClock, JobSpec, Stage
from exlnb.engines.cpu.pages import PagePool, Reservation
from exlnb.engines.cpu.runner import SequenceChunk
from exlnb.engines.cpu.sampler import SamplerState, TokenClasses
from exlnb.engines.grammar import GrammarMatcher
from exlnb.engines.text import BannedStrings, IncrementalDecoder, StopStringFilter
from exlnb.engines.token_info import TokenInfo


@dataclass
class CpuJob:
    job_id: int
    spec: JobSpec
    max_total_tokens: int  # prompt + new tokens this job may reach (capped by the cache)
    decoder: IncrementalDecoder
    stop_filter: StopStringFilter
    generator: torch.Generator
    clock: JobClock
    classes: TokenClasses
    banned: BannedStrings
    grammar: GrammarMatcher | None = None  # the job's constraint, if it has one
    sampler_state: SamplerState = field(default_factory=SamplerState)
    sequence: list[int] = field(default_factory=list)
    reservation: Reservation | None = None
    computed: int = 0  # leading tokens whose keys and values are in the cache
    cached_tokens: int = 0  # prompt tokens another job computed (shared pages this job skipped)
    stage: Stage = Stage.PENDING
    held_info: list[TokenInfo] = field(default_factory=list)  # records of sampled tokens not yet released
    taken_back: int = 0  # banned strings spelled and taken back so far (StreamEvent.taken_back)

    @property
    def prompt_tokens(self) -> int:
        return len(self.spec.input_ids)

    @property
    def new_tokens(self) -> int:
        return len(self.sequence) - self.prompt_tokens


class Scheduler:
    def __init__(self, pool: PagePool, max_batch_size: int, max_step_tokens: int) -> None:
        self.pool = pool
        self.max_batch_size = max_batch_size
        self.max_step_tokens = max_step_tokens
        self.pending: deque[CpuJob] = deque()
        self.active: list[CpuJob] = []

    def admit(self, now: float) -> list[CpuJob]:
        """Move pending jobs in arrival order into the batch while slots and pages allow."""
        admitted = []
        while self.pending and len(self.active) < self.max_batch_size:
            job = self.pending[0]
            reservation = self.pool.reserve(job.job_id, job.spec.input_ids, job.max_total_tokens)
            if reservation is None:
                break  # first come, first served: a big job is not overtaken forever by small ones
            self.pending.popleft()
            job.reservation = reservation
            job.stage = Stage.PREFILL
            job.clock.admitted = now
            self.active.append(job)
            admitted.append(job)
        return admitted

    def plan(self) -> list[tuple[CpuJob, SequenceChunk]]:
        """This step's work: one token per decoding job, then prompt chunks within the token budget."""
        decoding = [j for j in self.active if j.stage is Stage.DECODE]
        prefilling = [j for j in self.active if j.stage is Stage.PREFILL]
        budget = max(self.max_step_tokens - len(decoding), 1)
        work = []
        for job in decoding + prefilling:
            if job.stage is Stage.DECODE:
                take = 1
            else:
                take = min(self._prefill_take(job), budget)
                budget -= max(take, 0)
            if take <= 0:
                continue
            chunk = SequenceChunk(
                token_ids=tuple(job.sequence[job.computed : job.computed + take]),
                start=job.computed,
                page_table=job.reservation.page_table,
            )
            work.append((job, chunk))
        return work

    def _prefill_take(self, job: CpuJob) -> int:
        """How many prompt tokens the job may compute now, after skipping shared pages others computed."""
        start, stop = self.pool.prefill_span(job.job_id, job.reservation, job.computed)
        job.cached_tokens += start - job.computed
        job.computed = start
        return (len(job.sequence) if stop is None else stop) - start

    def remove(self, job_id: int) -> CpuJob | None:
        """Take a job out of the queue or the batch, returning its pages to the pool."""
        for job in self.pending:
            if job.job_id == job_id:
                self.pending.remove(job)
                return job
        for job in self.active:
            if job.job_id == job_id:
                self.active.remove(job)
                self.pool.release(job_id, job.reservation.page_table)
                return job
        return None
