"""The CPU engine: a transformers model on PyTorch CPU behind the same interface as the ExLlamaV2 engine.

Small and honest rather than a stand-in: a real paged KV cache with prefix sharing, continuous batching,
and exllamav2's sampler semantics, so the kit, its notebooks and its tests run without a GPU.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from exlnb.engines import vocab
from exlnb.engines.base import (
    CacheView,
    Engine,
    EngineStatus,
    EosReason,
    JobClock,
    JobFailed,
    JobInfo,
    JobSpec,
    Stage,
    StreamEvent,
    job_event,
    wall_clock,
)
from exlnb.engines.checks import check_prompt_fits
from exlnb.engines.cpu.loops import only_repeats
from exlnb.engines.cpu.pages import PagePool
from exlnb.engines.cpu.runner import PagedRunner
from exlnb.engines.cpu.sampler import Draw, TokenClasses, draw_token
from exlnb.engines.cpu.scheduler import CpuJob, Scheduler
from exlnb.engines.cpu.weights import keep_fp16_weights
from exlnb.engines.grammar import GrammarMatcher
from exlnb.engines.options import PAGE_TOKENS, EngineOptions
from exlnb.engines.text import BannedStrings, IncrementalDecoder, Rewind, StopStringFilter
from exlnb.engines.token_info import TokenInfo, token_info
from exlnb.engines.tokenizer import HfTokenizer
from exlnb.engines.views import PageInfo

PAGE_SIZE = PAGE_TOKENS
MAX_STEP_TOKENS = 512  # prompt tokens per forward pass: bounds how long decoding jobs wait for a prefill


@dataclass(frozen=True)
class _Outcome:
    text: str
    eos_reason: EosReason | None
    token_ids: tuple[int, ...] = ()


def _multiplicative_noise(eps: float, generator: torch.Generator):
    """A forward hook multiplying a decoder layer's hidden state by 1 + eps * N(0, 1): ExLlamaV3's
    eval/qbench/engines.py `apply_mult_noise`, drawn from one generator seeded 1 per pass, as there."""

    def hook(module, inputs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        noisy = hidden * (1.0 + eps * torch.randn(hidden.shape, generator=generator, dtype=hidden.dtype))
        return (noisy, *output[1:]) if isinstance(output, tuple) else noisy

    return hook


class CpuEngine(Engine):
    name = "cpu"
    scores_with_noise = True
    separate_generators_note = (
        "The CPU engine has no ExLlamaV2DynamicGenerator to create twice, so it cannot express the reporter's code "
        "as such. It approximates it with copies of the engine that share the model and its KV storage but keep their "
        "own page pools and schedulers: independent page tables over one cache, the collision separate exllamav2 "
        "generators have. Run this notebook on the ExLlamaV2 engine for the reporter's exact pattern."
    )

    def __init__(self, options: EngineOptions, *, progress: bool = True) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        if not progress:
            hf_logging.disable_progress_bar()
        self.options = options
        self.tokenizer = HfTokenizer(options.model_dir)
        model = AutoModelForCausalLM.from_pretrained(options.model_dir, dtype=torch.float32)
        model.eval()
        self._half_weight_projections = keep_fp16_weights(model)  # fp32 arithmetic either way (weights.py)
        num_pages = options.cache_tokens // PAGE_SIZE
        self.max_seq_len = num_pages * PAGE_SIZE
        self._vocab_size = model.config.vocab_size
        self._runner = PagedRunner(model, num_pages, PAGE_SIZE)
        self._pool = PagePool(num_pages, PAGE_SIZE)
        self._scheduler = Scheduler(self._pool, options.max_batch_size, MAX_STEP_TOKENS)
        self._ids = itertools.count(1)

    # -- jobs ----------------------------------------------------------------------------------------------

    def enqueue(self, spec: JobSpec) -> int:
        prompt = len(spec.input_ids)
        check_prompt_fits(prompt, spec.max_new_tokens, self.max_seq_len)
        spec.check_vocabulary(self._vocab_size)
        self.refuse_unsupported(spec)
        job_id = next(self._ids)
        generator = torch.Generator()
        generator.manual_seed(spec.seed if spec.seed is not None else torch.seed())
        job = CpuJob(
            job_id=job_id,
            spec=spec,
            max_total_tokens=min(prompt + spec.max_new_tokens, self.max_seq_len),
            decoder=IncrementalDecoder(self.tokenizer),
            stop_filter=StopStringFilter(spec.stop_strings),
            generator=generator,
            clock=JobClock(enqueued=wall_clock()),
            classes=self._token_classes(spec),
            banned=BannedStrings(spec.banned_strings),
            grammar=GrammarMatcher(spec.constraint, self.tokenizer, self._vocab_size, spec.stop_token_ids)
            if spec.constraint
            else None,
            sequence=list(spec.input_ids),
        )
        self._scheduler.pending.append(job)
        return job_id

    def unsupported(self, spec: JobSpec) -> list[str]:
        if spec.constraint and spec.banned_strings:
            # taking back a banned string where the grammar allows nothing else could repeat for ever
            return [
                f"banned_strings={spec.banned_strings!r} with a {spec.constraint.describe()} (write the exclusion "
                "into the schema or pattern)"
            ]
        return []

    def _token_classes(self, spec: JobSpec) -> TokenClasses:
        s = spec.sampler
        return TokenClasses(
            dry_breakers=vocab.dry_breakers(self.tokenizer, s.dry_sequence_breakers, self._vocab_size)
            if s.dry_multiplier
            else None,
            xtc_excludable=vocab.xtc_excludable(self.tokenizer, self._vocab_size) if s.xtc_probability else None,
        )

    def cancel(self, job_id: int) -> bool:
        return self._scheduler.remove(job_id) is not None

    def has_work(self) -> bool:
        return bool(self._scheduler.pending or self._scheduler.active)

    def step(self) -> list[StreamEvent]:
        events = [self._event(job, Stage.PREFILL) for job in self._scheduler.admit(wall_clock())]
        work = self._scheduler.plan()
        if not work:
            return events
        logits = self._runner.forward([chunk for _, chunk in work])
        now = wall_clock()
        failed: dict[int, BaseException] = {}
        for row, (job, chunk) in enumerate(work):
            job.computed = chunk.start + len(chunk.token_ids)
            self._pool.mark_filled(job.reservation.page_table, job.computed)
            if job.computed < len(job.sequence):
                continue  # prompt not finished: these logits are not for sampling
            try:
                events.append(self._advance(job, logits[row], now))
            except Exception as error:  # noqa: BLE001 - this job's sampling or decoding: fail it alone
                self._scheduler.remove(job.job_id)
                failed[job.job_id] = error
        if failed:
            raise JobFailed(list(failed), next(iter(failed.values())), events)
        return events

    def _advance(self, job: CpuJob, logits: torch.Tensor, now: float) -> StreamEvent:
        draw = draw_token(
            logits,
            torch.tensor(job.sequence),
            job.spec.sampler,
            job.generator,
            blocked=self._blocked(job),
            classes=job.classes,
            state=job.sampler_state,
            top_tokens=job.spec.top_tokens,
            allowed=job.grammar.allowed() if job.grammar else None,
        )
        token = draw.token
        if job.grammar:
            job.grammar.consume(token)
        if job.spec.top_tokens:
            job.held_info.append(self._token_info(draw))
        job.sequence.append(token)
        job.clock.token_arrived(now)
        job.stage = Stage.DECODE
        outcome = self._outcome(job, token)
        if outcome.eos_reason is not None:
            self._scheduler.remove(job.job_id)
            job.stage = Stage.DONE
        info = self._release_info(job, len(outcome.token_ids)) if job.spec.top_tokens else ()
        return self._event(
            job,
            job.stage,
            text=outcome.text,
            token_ids=outcome.token_ids,
            token_info=info,
            eos_reason=outcome.eos_reason,
        )

    def _token_info(self, draw: Draw) -> TokenInfo:
        return token_info(
            self.tokenizer, draw.token, draw.probability, draw.top_ids, draw.top_probs, draw.sampled_probability
        )

    @staticmethod
    def _release_info(job: CpuJob, count: int) -> tuple[TokenInfo, ...]:
        """The records of the `count` tokens an event releases: the oldest held ones, as tokens leave in order
        (a banned string's start is held back, then released or taken back by `_rewind`)."""
        released = tuple(job.held_info[:count])
        del job.held_info[:count]
        return released

    def _blocked(self, job: CpuJob) -> list[int]:
        """Tokens banned here: the starts of banned strings tried at this position, and stop tokens until
        min_new_tokens (exllamav2's dynamic job passes both to its sampler as blocked_tokens)."""
        blocked = job.banned.blocked(len(job.sequence))
        if job.new_tokens < job.spec.min_new_tokens:
            blocked = [*blocked, *job.spec.stop_token_ids]
        return blocked

    def _outcome(self, job: CpuJob, token: int) -> _Outcome:
        if token in job.spec.stop_token_ids:
            text, tokens = self._drain(job)
            return _Outcome(text, EosReason.STOP_TOKEN, (*tokens, token))
        before = job.decoder.state()
        released = job.banned.feed(token, job.decoder.push(token), len(job.sequence) - 1, before)
        if isinstance(released, Rewind):
            self._rewind(job, released)
            return _Outcome("", None)
        # banned strings are checked before the length limits, unlike exllamav2's job, so none ever slips out
        text, tokens = released
        text, stopped = job.stop_filter.feed(text)
        tokens = tuple(tokens)
        if stopped:
            return _Outcome(text, EosReason.STOP_STRING, tokens)
        reason = self._limit_reached(job)
        if reason is not None:
            more_text, more_tokens = self._drain(job)
            return _Outcome(text + more_text, reason, (*tokens, *more_tokens))
        return _Outcome(text, None, tokens)

    def _drain(self, job: CpuJob) -> tuple[str, tuple[int, ...]]:
        """What is still held back when a job ends: the start of a banned string or of a stop string."""
        held, tokens = job.banned.flush()
        return job.stop_filter.feed(held)[0] + job.stop_filter.flush(), tuple(tokens)

    def _limit_reached(self, job: CpuJob) -> EosReason | None:
        if job.grammar and job.grammar.complete:  # as exllamav3 ends a filter's job: without sampling the stop token
            return EosReason.END_FILTER
        if job.new_tokens >= job.spec.max_new_tokens:
            return EosReason.MAX_NEW_TOKENS
        if len(job.sequence) >= job.max_total_tokens:
            return EosReason.END_OF_CACHE
        loop = job.spec.stop_on_loop
        if loop and only_repeats(job.sequence[job.prompt_tokens :], *loop):
            return EosReason.LOOP_DETECTED
        return None

    def _rewind(self, job: CpuJob, to: Rewind) -> None:
        """Take back the tokens that spelled a banned string; the last kept token runs again for fresh logits."""
        del job.held_info[len(job.held_info) - (len(job.sequence) - to.length) :]
        del job.sequence[to.length :]
        job.decoder.restore(to.decoder_state)
        job.computed = to.length - 1
        job.taken_back += 1

    def _event(
        self,
        job: CpuJob,
        stage: Stage,
        *,
        text: str = "",
        token_ids: tuple[int, ...] = (),
        token_info: tuple[TokenInfo, ...] = (),
        eos_reason: EosReason | None = None,
    ) -> StreamEvent:
        return job_event(
            job.job_id,
            stage,
            job.clock,
            wall_clock(),
            prompt_tokens=job.prompt_tokens,
            cached_tokens=job.cached_tokens,
            new_tokens=job.new_tokens,
            text=text,
            token_ids=token_ids,
            token_info=token_info,
            eos_reason=eos_reason,
            taken_back=job.taken_back,
        )

    # -- field report 2's mistake, on purpose --------------------------------------------------------------

    def _separate_generator(self, first_job_id: int) -> CpuEngine:
        """A copy sharing the model and its KV storage (`_runner`) but with its own page pool and scheduler, so
        it too believes every page is free."""
        twin = self._shallow_twin()
        twin._pool = PagePool(len(self._pool.pages), PAGE_SIZE)
        twin._scheduler = Scheduler(twin._pool, self._scheduler.max_batch_size, MAX_STEP_TOKENS)
        twin._ids = itertools.count(first_job_id)
        return twin

    def _forget_cache_contents(self) -> None:
        self._pool.forget_contents()

    # -- views ---------------------------------------------------------------------------------------------

    def score(self, token_ids: Sequence[int], *, noise_eps: float = 0.0) -> torch.Tensor:
        # the transformers model's own forward over the whole sequence: the paged cache, and the jobs whose
        # keys and values it holds, are left as they are
        model, generator = self._runner.model, torch.Generator().manual_seed(1)
        hooks = (
            [layer.register_forward_hook(_multiplicative_noise(noise_eps, generator)) for layer in model.model.layers]
            if noise_eps
            else []
        )
        try:
            with torch.inference_mode():
                logits = model(torch.tensor([list(token_ids)])).logits[0].float()
        finally:
            for hook in hooks:
                hook.remove()
        return logits[:, : self.tokenizer.vocab_size]

    def jobs(self) -> list[JobInfo]:
        return [
            JobInfo(
                job_id=job.job_id,
                identifier=job.spec.identifier,
                stage=job.stage,
                prompt_tokens=job.prompt_tokens,
                new_tokens=job.new_tokens,
                max_new_tokens=job.spec.max_new_tokens,
                time_enqueued=job.clock.enqueued,
                pages=len(job.reservation.page_table) if job.reservation else 0,
            )
            for job in sorted([*self._scheduler.active, *self._scheduler.pending], key=lambda j: j.job_id)
        ]

    def cache_view(self) -> CacheView:
        return CacheView(
            paged=True,
            page_size=PAGE_SIZE,
            max_tokens=self.max_seq_len,
            pages=tuple(
                PageInfo(
                    index=page.index,
                    owners=tuple(sorted(page.owners)),
                    ref_count=page.ref_count,
                    tokens_filled=page.tokens_filled,
                    shared=page.ref_count > 1,
                    cached=page.ref_count == 0 and page.prefix_hash is not None,
                )
                for page in self._pool.pages
            ),
        )

    def status(self) -> EngineStatus:
        return EngineStatus(
            engine=self.name,
            model=self.options.model_dir.name,
            device=f"cpu, {torch.get_num_threads()} threads",
            paged=True,
            attention="torch SDPA over a paged cache",
            cache_tokens=self.max_seq_len,
            cache_dtype="fp32",
            max_batch_size=self._scheduler.max_batch_size,
            decode=f"fp16 weights ({self._half_weight_projections} projections), fp32 arithmetic"
            if self._half_weight_projections
            else "",
        )

    def close(self) -> None:
        self._scheduler.pending.clear()
        self._scheduler.active.clear()
        del self._runner
