"""Submitting: a prompt and its `JobOptions` made into the engine's job, queued, and cancelled.

Every job's prompt and whole answer are checked against the cache before any is queued, so a refused one leaves
nothing behind; jobs queued together start in the same engine step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from inspect import Parameter

from exlnb.engines.base import Engine, EosReason, JobInfo, JobSpec
from exlnb.engines.checks import check_prompt_fits, is_number
from exlnb.engines.declaration import takes_options
from exlnb.engines.job_options import JobOptions
from exlnb.engines.sampling import SamplerSettings
from exlnb.session.base import NoModelLoaded, SessionBase
from exlnb.streaming import EventInbox, GenerationResult, JobStream

# `generate(prompt, **options)` names `JobOptions`' keywords, and a whole `sampler` to start from
takes_job_options = takes_options(
    JobOptions,
    SamplerSettings,
    leading=[Parameter("sampler", Parameter.KEYWORD_ONLY, default=None, annotation=SamplerSettings)],
)


def _not_a_prompt(prompt: object) -> TypeError:
    return TypeError(
        f"prompt={prompt!r:.60} has the wrong type: it must be a string, or token ids: a list of integers, or a 1-D "
        "array or tensor of them"
    )


class Submitting(SessionBase):
    """Jobs in and out of the engine: submitted (alone or together), generated from a prompt, cancelled."""

    @takes_job_options
    def generate(self, prompt: str | Sequence[int], *, cancel_when_abandoned: bool = True, **options) -> JobStream:
        """Start generating from a prompt (text, special tokens encoded as such, or token ids); `options` are
        `JobOptions`' (`max_new_tokens`, `stop`, `seed`, `stop_at_eos`, ..., docs/options.md) and sampler settings
        such as `temperature=0.7`."""
        spec = self.spec_for(prompt, JobOptions.build(**options))
        return self.submit(spec, cancel_when_abandoned=cancel_when_abandoned)

    @takes_job_options
    async def agenerate(
        self, prompt: str | Sequence[int], *, cancel_when_abandoned: bool = True, **options
    ) -> JobStream:
        """`generate` for a coroutine: returns without waiting for the engine's current step."""
        spec = self.spec_for(prompt, JobOptions.build(**options))
        return (await self.asubmit_together([spec], cancel_when_abandoned=cancel_when_abandoned))[0]

    @takes_job_options
    def complete(self, prompt: str | Sequence[int], **options) -> GenerationResult:
        """`generate(...)` and wait for the whole result."""
        return self.generate(prompt, **options).result()

    def spec_for(self, prompt: str | Sequence[int], options: JobOptions | None = None) -> JobSpec:
        """The engine's job for a prompt under `options` (default: `JobOptions()`), for `submit_together`."""
        options = options or JobOptions()
        return options.make_spec(self.prompt_ids(prompt, options.max_new_tokens), self.tokenizer)

    def prompt_ids(self, prompt: str | Sequence[int], max_new_tokens: int = 1) -> list[int]:
        """A prompt as the token ids of a job: text encoded with the session's tokenizer (special tokens as such)
        once it is known to be short enough, or ids as given. Either is compared with the cache by its length
        before each id is looked at: checking every one of 10^7 ids' types first took 42 s to refuse them."""
        if isinstance(prompt, str):
            self.check_text_fits(prompt)
            ids = self.tokenizer.encode(prompt, special=True)
            check_prompt_fits(len(ids), max_new_tokens, self._engine_thread().engine.max_seq_len)
            return list(ids)
        listed = isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray))  # bytes are no ids
        array = getattr(prompt, "ndim", None) == 1 and hasattr(prompt, "tolist")  # a numpy array or a torch tensor
        if not (listed or array):
            raise _not_a_prompt(prompt)
        check_prompt_fits(len(prompt), max_new_tokens, self._engine_thread().engine.max_seq_len)
        ids = prompt.tolist() if array else list(prompt)
        if not all(is_number(i, int) for i in ids):
            raise _not_a_prompt(prompt)
        return ids

    def submit(self, spec: JobSpec, *, cancel_when_abandoned: bool = True) -> JobStream:
        """Queue a job and return its stream.

        With `cancel_when_abandoned=False` the job runs to the end even when nobody reads it: the bug of
        field report 1, kept reachable so the notebooks can reproduce it.
        """
        return self.submit_together([spec], cancel_when_abandoned=cancel_when_abandoned)[0]

    def submit_together(
        self, specs: Sequence[JobSpec], *, cancel_when_abandoned: bool = True, shared: object | None = None
    ) -> list[JobStream]:
        """Queue several jobs in one engine command, so that the engine starts them in the same step.

        Jobs queued one by one may straddle a step: the first then decodes its first token alone and the
        next joins it a step later, in a batch of another shape. fp16 kernels round rows of differently
        shaped batches differently, so two greedy samples of one prompt may part ways; started together
        they share the prompt's pages from the first pass and stay in the same batches (`--n` samples).
        With `shared` (a `queue.SimpleQueue`), every job's events go to that one queue.
        """
        inboxes, enqueue = self._enqueuing(specs, cancel_when_abandoned, shared)
        with self._orphans_cancelled(inboxes):
            job_ids = self._call(enqueue)
        return self._streams(job_ids, specs, inboxes, cancel_when_abandoned)

    async def asubmit_together(
        self, specs: Sequence[JobSpec], *, cancel_when_abandoned: bool = True, shared: object | None = None
    ) -> list[JobStream]:
        """`submit_together` for a coroutine: the event loop runs on while the engine finishes its step."""
        inboxes, enqueue = self._enqueuing(specs, cancel_when_abandoned, shared)
        with self._orphans_cancelled(inboxes):
            job_ids = await self._acall(enqueue)
        return self._streams(job_ids, specs, inboxes, cancel_when_abandoned)

    def _enqueuing(
        self, specs: Sequence[JobSpec], cancel_when_abandoned: bool, shared: object | None
    ) -> tuple[list[EventInbox], Callable[[Engine], list[int]]]:
        """Each job's inbox, and the engine command that queues the jobs, once all are known to fit the cache."""
        self._check_fits(specs)
        inboxes = [EventInbox(shared) for _ in specs]

        def enqueue(engine: Engine) -> list[int]:
            # registered on the engine thread before its first step, so no event can be missed
            job_ids = []
            for spec, inbox in zip(specs, inboxes):
                job_id = engine.enqueue(spec)
                job_ids.append(job_id)
                self._deliveries.register(job_id, inbox, detached=not cancel_when_abandoned)
            return job_ids

        return inboxes, enqueue

    def _streams(
        self, job_ids: list[int], specs: Sequence[JobSpec], inboxes: list[EventInbox], cancel_when_abandoned: bool
    ) -> list[JobStream]:
        return [
            JobStream(job_id, inbox, self.cancel, self.request_cancel, cancel_when_abandoned, spec.constraint)
            for job_id, spec, inbox in zip(job_ids, specs, inboxes)
        ]

    @contextmanager
    def _orphans_cancelled(self, inboxes: list[EventInbox]) -> Iterator[None]:
        """Interrupted while waiting (Ctrl-C, task cancelled), or one spec refused after others were queued:
        the engine thread may have enqueued jobs all the same, and no stream would ever cancel them.
        Commands run in order, so the cancel runs after the enqueue."""
        thread = self._engine_thread()
        try:
            yield
        except BaseException:

            def cancel_mine(engine: Engine) -> None:
                for job_id in self._deliveries.open_inboxes(inboxes):
                    self._cancel_on_engine(engine, job_id)

            thread.post(cancel_mine)
            raise

    def check_text_fits(self, text: str) -> None:
        """Refuse, before tokenizing it, text that cannot fit the cache even at the vocabulary's longest token:
        tokenizing a 50 MB prompt only to learn that it does not fit took 66-94 s and 3.1 GB."""
        engine = self._engine_thread().engine
        limit, longest = engine.max_seq_len, engine.tokenizer.longest_token()
        if len(text) > limit * longest:
            raise ValueError(
                f"the prompt has {len(text):,} characters, more than the cache's {limit} tokens could hold even at "
                f"{longest} characters a token (the vocabulary's longest): shorten it, or load with a larger "
                "cache_tokens"
            )

    def _check_fits(self, specs: Sequence[JobSpec]) -> None:
        """Every job's prompt and whole answer fit the cache (a job reserves pages for its whole answer when it
        starts): checked before any is queued, so none is left behind when one is refused."""
        limit = self._engine_thread().engine.max_seq_len
        for spec in specs:
            prompt = len(spec.input_ids)
            check_prompt_fits(prompt, spec.max_new_tokens, limit)
            if prompt + spec.max_new_tokens > limit:
                raise ValueError(
                    f"max_new_tokens={spec.max_new_tokens} with a {prompt}-token prompt does not fit the cache "
                    f"({limit} tokens; a job reserves pages for its whole answer): ask for at most {limit - prompt}, "
                    "or load with a larger cache_tokens"
                )

    # -- cancelling ------------------------------------------------------------------------------------------

    def cancel(self, job_id: int) -> bool:
        """Cancel a job; its pages are free when this returns. False if it had already finished."""
        try:
            return bool(self._call(lambda engine: self._cancel_on_engine(engine, job_id)))
        except NoModelLoaded:
            return False

    async def acancel(self, job_id: int) -> bool:
        """`cancel` for a coroutine."""
        try:
            return bool(await self._acall(lambda engine: self._cancel_on_engine(engine, job_id)))
        except NoModelLoaded:
            return False

    def request_cancel(self, job_id: int) -> None:
        """Ask for a cancel without waiting: what a finaliser, a button or an event loop may safely do."""
        thread = self._thread
        if thread is not None:
            thread.post(lambda engine: self._cancel_on_engine(engine, job_id))

    def request_cancel_all(self) -> None:
        """Ask for every job to be cancelled without waiting (a Cancel-all button on the event loop)."""
        thread = self._thread
        if thread is not None:
            thread.post(lambda engine: self._cancel_matching(engine, lambda info: True))

    def cancel_all(self) -> int:
        """Cancel every pending and active job; returns how many there were."""
        return self.cancel_where(lambda info: True)

    def cancel_where(self, matches: Callable[[JobInfo], bool]) -> int:
        """Cancel every job whose `JobInfo` matches, in one engine command; returns how many there were.

        One command, not one `cancel` per job: each command waits for the step in progress, so cancelling
        3,000 jobs one by one took 326 s where cancelling 2,000 in one command took 0.31 s."""
        try:
            return self._call(lambda engine: self._cancel_matching(engine, matches))
        except NoModelLoaded:
            return 0

    def _cancel_matching(self, engine: Engine, matches: Callable[[JobInfo], bool]) -> int:
        return sum(self._cancel_on_engine(engine, info.job_id) for info in engine.jobs() if matches(info))

    def _cancel_on_engine(self, engine: Engine, job_id: int) -> bool:
        if not engine.cancel(job_id):
            return False
        self._deliveries.end(job_id, EosReason.CANCELLED)
        return True
