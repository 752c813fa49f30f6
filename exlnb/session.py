"""The kernel-resident session: one model, one cache, one generator per kernel process.

Every cell, widget, magic and background job talks to `get_session()`. Field report 2 is what happens
otherwise: generators created per request, sharing one cache, write over each other's pages.

The session owns the lifecycle (load, replace, unload), the engine thread, submit and cancel. Delivering
events to streams is `exlnb.streaming.Deliveries`' job.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from exlnb.engine_thread import EngineStopped, EngineThread, EngineViews
from exlnb.engines import create_engine
from exlnb.engines.base import (
    DEFAULT_MAX_NEW_TOKENS,
    CacheView,
    Engine,
    EngineStatus,
    EosReason,
    JobInfo,
    JobSpec,
    SamplerSettings,
    StreamEvent,
    Tokenizer,
    one_line,
)
from exlnb.engines.checks import check_option_names, is_number, one_or_many
from exlnb.engines.constraint import OutputConstraint
from exlnb.engines.options import EngineOptions, check_cache_fits
from exlnb.models import BUNDLED_MODEL, library_bars_silenced, resolve_model
from exlnb.streaming import Deliveries, EventInbox, GenerationResult, JobError, JobStream, ModelUnloaded

T = TypeVar("T")


class NoModelLoaded(RuntimeError):
    def __init__(self) -> None:
        super().__init__("no model is loaded: call get_session().load() or run %exl_load first")


class LoadFailed(RuntimeError):
    """Loading a model failed; the message says what is loaded now (the previous model, or nothing)."""


@dataclass(frozen=True)
class JobRow:
    """A job as the job table shows it: the engine's view plus whether anyone still reads its stream."""

    info: JobInfo
    consumed: bool  # a consumer is iterating the stream right now
    abandoned_ok: bool  # submitted with cancel_when_abandoned=False (runs on with nobody reading)


# no vocabulary we know has a longer token (SmolLM2's longest, 81 characters, are runs of '#' and of spaces)
MAX_CHARS_PER_TOKEN = 128

JOB_SPEC_OPTIONS = (
    "max_new_tokens", "sampler", "stop", "seed", "identifier", "stop_at_eos", "min_new_tokens", "banned_strings",
    "stop_on_loop", "top_tokens", "json_schema", "regex",
)


class Session:
    """Owns the engine and its thread; hands out `JobStream`s. Safe to use from any thread or task."""

    def __init__(self) -> None:
        self._load_lock = threading.RLock()  # load/unload; held while waiting on the engine thread
        self._thread: EngineThread | None = None
        self._options: EngineOptions | None = None
        self._deliveries = Deliveries()

    # -- loading ---------------------------------------------------------------------------------------

    def load(
        self,
        model: str = BUNDLED_MODEL,
        *,
        engine: str = "auto",
        cache_tokens: int | None = None,
        cache: str = "fp16",
        max_batch_size: int | None = None,
        gpu_split: Sequence[float] | str | None = None,
        paged: str | bool = "auto",
        graphs: str = "auto",
        tensor_parallel: bool = False,
        url: str | None = None,
        served_model: str | None = None,
        api_key_env: str | None = None,
        api: str = "chat",
        reload: bool = False,
        progress: bool = True,
    ) -> EngineStatus:
        """Load a model into the session; a second call with the same arguments does nothing.

        `model` is "smollm2-135m-instruct" (fetched and converted once, then cached) or a local folder.
        `engine` is "auto" (by the folder's format: ExLlamaV2 where CUDA is available, else CPU, for unquantized
        weights) or a registered engine's name (`ENGINE_NAMES`; docs/engines.md).
        Replacing a loaded model while jobs run needs `reload=True` (they are ended); `reload=True` also
        loads again with unchanged arguments. `graphs` ("auto" or "off") is the ExLlamaV2 engine's CUDA-graph
        decode: "auto" uses it where a decode step replayed at load agrees with the same step run eagerly.
        `gpu_split` ("auto", or GiB per GPU, 0 leaves one out) spreads the layers over GPUs; `tensor_parallel=True` splits
        every layer over them instead (ExLlamaV2 and ExLlamaV3 engines, at least two GPUs). Everything that can
        be checked is checked before the loaded model is touched; if the new one fails to load, the previous one
        is loaded again.

        `url` (an OpenAI-compatible server's API base, e.g. "http://127.0.0.1:8000/v1") loads the openai engine:
        jobs stream from that server, `model` is then the same model's local folder (or the bundled name) for its
        tokenizer and template, `served_model` the server's name for it (default: the one it serves), `api_key_env`
        the environment variable with its key (the only way a key is sent: a url carrying one is refused), and `api`
        "chat" (the server's chat template) or "completions" (exlnb's templates). docs/servers.md says what each
        server returns.
        """
        for name, count in (("cache_tokens", cache_tokens), ("max_batch_size", max_batch_size)):
            if count is not None and not is_number(count, int):
                raise TypeError(f"{name}={count!r} has the wrong type: it must be an integer, or None for the default")
        model_dir = resolve_model(model, progress=progress)
        options = EngineOptions.resolve(
            engine=engine,
            model_dir=model_dir,
            cache_tokens=cache_tokens,
            cache_dtype=cache,
            max_batch_size=max_batch_size,
            gpu_split=gpu_split,
            paged=paged,
            graphs=graphs,
            tensor_parallel=tensor_parallel,
            url=url,
            api_key_env=api_key_env,
            api=api,
            served_model=served_model,
        )
        check_cache_fits(options)
        with self._load_lock:
            if self._thread is not None and options == self._options and not reload:
                return self.status()
            if self._thread is not None and not reload and self.jobs():
                raise ValueError(
                    f"{len(self.jobs())} job(s) are running on {self._options.model_dir.name}: loading another "
                    "model would end them. Pass reload=True (%exl_load --reload) to replace it anyway"
                )
            previous = self._options
            self.unload()
            try:
                self._start(options, progress)
            except Exception as error:
                if previous is None:
                    raise LoadFailed(f"loading {options.model_dir.name} failed: {one_line(error)}") from error
                try:
                    self._start(previous, progress=False)
                except Exception as again:
                    raise LoadFailed(
                        f"loading {options.model_dir.name} failed: {one_line(error)}; loading "
                        f"{previous.model_dir.name} again failed too ({one_line(again)}): no model is loaded now"
                    ) from error
                raise LoadFailed(
                    f"loading {options.model_dir.name} failed: {one_line(error)}; "
                    f"{previous.model_dir.name} is loaded again"
                ) from error
            return self.status()

    def _start(self, options: EngineOptions, progress: bool) -> None:
        with library_bars_silenced():
            engine = create_engine(options, progress=progress)
        self._thread = EngineThread(
            engine,
            deliver=self._deliveries.deliver,
            on_job_failure=self._fail_jobs,
            on_step_error=self._fail_step,
            on_stop=self._end_every_job,
        )
        self._options = options
        self._thread.start()

    def unload(self) -> None:
        """End every job (their streams raise `ModelUnloaded`), stop the engine thread, free model and cache."""
        with self._load_lock:
            if self._thread is None:
                return
            thread, self._thread, self._options = self._thread, None, None
            thread.stop()  # runs what is queued, then `_end_every_job`; later commands are refused
            thread.engine.close()
            del thread
            gc.collect()

    @property
    def loaded(self) -> bool:
        return self._thread is not None

    @property
    def options(self) -> EngineOptions | None:
        """What is loaded (None when nothing is)."""
        return self._options

    def _engine_thread(self) -> EngineThread:
        thread = self._thread
        if thread is None:
            raise NoModelLoaded()
        return thread

    def _call(self, fn: Callable[[Engine], T]) -> T:
        try:
            return self._engine_thread().call(fn)
        except EngineStopped:
            raise NoModelLoaded() from None

    async def _acall(self, fn: Callable[[Engine], T]) -> T:
        """`_call` for a coroutine: awaits the engine thread's answer, so the event loop never waits for a step."""
        try:
            return await asyncio.wrap_future(self._engine_thread().submit(fn))
        except EngineStopped:
            raise NoModelLoaded() from None

    def status(self) -> EngineStatus:
        return self._call(lambda engine: engine.status())

    @property
    def tokenizer(self) -> Tokenizer:
        return self._engine_thread().engine.tokenizer

    @property
    def engine(self) -> Engine:
        """The engine itself, for experiments that compare against driving it by hand.

        Call it only through `run_on_engine` while the session runs, so that one thread owns it.
        """
        return self._engine_thread().engine

    def run_on_engine(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        return self._call(fn)

    # -- jobs ----------------------------------------------------------------------------------------------

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
        self._check_fits(specs)
        inboxes = [EventInbox(shared) for _ in specs]
        thread = self._engine_thread()
        try:
            job_ids = self._call(self._enqueue(specs, inboxes, cancel_when_abandoned))
        except BaseException:
            self._cancel_orphans(thread, inboxes)
            raise
        return self._streams(job_ids, specs, inboxes, cancel_when_abandoned)

    async def asubmit_together(
        self, specs: Sequence[JobSpec], *, cancel_when_abandoned: bool = True, shared: object | None = None
    ) -> list[JobStream]:
        """`submit_together` for a coroutine: the event loop runs on while the engine finishes its step."""
        self._check_fits(specs)
        inboxes = [EventInbox(shared) for _ in specs]
        thread = self._engine_thread()
        try:
            job_ids = await self._acall(self._enqueue(specs, inboxes, cancel_when_abandoned))
        except BaseException:
            self._cancel_orphans(thread, inboxes)
            raise
        return self._streams(job_ids, specs, inboxes, cancel_when_abandoned)

    def _enqueue(self, specs: Sequence[JobSpec], inboxes: list[EventInbox], cancel_when_abandoned: bool):
        def enqueue(engine: Engine) -> list[int]:
            # registered on the engine thread before its first step, so no event can be missed
            job_ids = []
            for spec, inbox in zip(specs, inboxes):
                job_id = engine.enqueue(spec)
                job_ids.append(job_id)
                self._deliveries.register(job_id, inbox, detached=not cancel_when_abandoned)
            return job_ids

        return enqueue

    def _streams(
        self, job_ids: list[int], specs: Sequence[JobSpec], inboxes: list[EventInbox], cancel_when_abandoned: bool
    ) -> list[JobStream]:
        return [
            JobStream(job_id, inbox, self.cancel, self.request_cancel, cancel_when_abandoned, spec.constraint)
            for job_id, spec, inbox in zip(job_ids, specs, inboxes)
        ]

    def _cancel_orphans(self, thread: EngineThread, inboxes: list[EventInbox]) -> None:
        """Interrupted while waiting (Ctrl-C, task cancelled), or one spec refused after others were queued:
        the engine thread may have enqueued jobs all the same, and no stream would ever cancel them.
        Commands run in order, so this runs after the enqueue."""
        def cancel_mine(engine: Engine) -> None:
            for job_id in self._deliveries.open_inboxes(inboxes):
                self._cancel_on_engine(engine, job_id)

        thread.post(cancel_mine)

    def job_spec(
        self,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        sampler: SamplerSettings | None = None,
        stop: Sequence[str | int] = (),
        seed: int | None = None,
        identifier: Hashable | None = None,
        stop_at_eos: bool = True,
        min_new_tokens: int = 0,
        banned_strings: Sequence[str] = (),
        stop_on_loop: tuple[int, int] | None = None,
        top_tokens: int = 0,
        json_schema: object = None,
        regex: str | None = None,
        **sampler_options,
    ) -> JobSpec:
        """What `generate` submits, for `submit_together`: the prompt encoded, the settings checked.

        Sampler settings come from `sampler` (default: exllamav2's defaults) with keyword overrides, e.g.
        `temperature=0.7, top_p=0.9`. `stop` takes strings and token ids; the tokenizer's end-of-sequence
        token stops generation unless `stop_at_eos=False`. `min_new_tokens`, `banned_strings`, `stop_on_loop`
        and `top_tokens` (per-token probabilities; 0 computes none) are `JobSpec`'s. `json_schema` (a dict, a
        pydantic model class or a .json file) or `regex` constrains the answer (`OutputConstraint`). The prompt and
        its answer must fit the cache: every job reserves pages for its whole answer when it starts.
        """
        check_option_names(sampler_options, valid=[*JOB_SPEC_OPTIONS, *SamplerSettings.option_names()])
        settings = (sampler or SamplerSettings()).with_options(**sampler_options)
        tokenizer = self.tokenizer
        if isinstance(prompt, str):
            self.check_text_fits(prompt)
        input_ids = tokenizer.encode(prompt, special=True) if isinstance(prompt, str) else list(prompt)
        return JobSpec(
            input_ids=tuple(input_ids),
            max_new_tokens=max_new_tokens,
            sampler=settings,
            **JobSpec.stopping(one_or_many(stop), tokenizer, at_eos=stop_at_eos),
            seed=seed,
            identifier=identifier,
            min_new_tokens=min_new_tokens,
            banned_strings=one_or_many(banned_strings),
            stop_on_loop=stop_on_loop,
            top_tokens=top_tokens,
            constraint=OutputConstraint.given(json_schema, regex),
        )

    def check_text_fits(self, text: str) -> None:
        """Refuse, before tokenizing it, text that cannot fit the cache even at the longest tokens: tokenizing
        a 50 MB prompt only to learn that it does not fit took 66-94 s and 3.1 GB."""
        limit = self._engine_thread().engine.max_seq_len
        if len(text) > limit * MAX_CHARS_PER_TOKEN:
            raise ValueError(
                f"the prompt has {len(text):,} characters, more than the cache's {limit} tokens could hold even at "
                f"{MAX_CHARS_PER_TOKEN} characters a token: shorten it, or load with a larger cache_tokens"
            )

    def _check_fits(self, specs: Sequence[JobSpec]) -> None:
        """Every job's prompt and whole answer fit the cache: checked before any is queued, so none is left
        behind when one is refused."""
        limit = self._engine_thread().engine.max_seq_len
        for spec in specs:
            self._check_fit(spec, limit)

    @staticmethod
    def _check_fit(spec: JobSpec, limit: int) -> None:
        prompt = len(spec.input_ids)
        if prompt >= limit:
            raise ValueError(
                f"the prompt has {prompt} tokens but the cache holds {limit}: shorten the prompt or load with "
                f"cache_tokens of at least {prompt + spec.max_new_tokens}"
            )
        if prompt + spec.max_new_tokens > limit:
            raise ValueError(
                f"max_new_tokens={spec.max_new_tokens} with a {prompt}-token prompt does not fit the cache "
                f"({limit} tokens; a job reserves pages for its whole answer): ask for at most {limit - prompt}, "
                "or load with a larger cache_tokens"
            )

    def generate(self, prompt: str | Sequence[int], *, cancel_when_abandoned: bool = True, **options) -> JobStream:
        """Start generating from a prompt (text, special tokens encoded as such, or token ids).

        `options` are `job_spec`'s: `max_new_tokens`, `sampler`, `stop`, `seed`, `identifier`,
        `stop_at_eos` and sampler settings such as `temperature=0.7`.
        """
        return self.submit(self.job_spec(prompt, **options), cancel_when_abandoned=cancel_when_abandoned)

    async def agenerate(self, prompt: str | Sequence[int], *, cancel_when_abandoned: bool = True, **options) -> JobStream:
        """`generate` for a coroutine: returns without waiting for the engine's current step."""
        spec = self.job_spec(prompt, **options)
        return (await self.asubmit_together([spec], cancel_when_abandoned=cancel_when_abandoned))[0]

    def complete(self, prompt: str | Sequence[int], **options) -> GenerationResult:
        """`generate(...)` and wait for the whole result."""
        return self.generate(prompt, **options).result()

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
            thread.post(self._cancel_everything)

    def cancel_all(self) -> int:
        """Cancel every pending and active job; returns how many there were."""
        if self._thread is None:
            return 0
        return self._call(self._cancel_everything)

    async def acancel_all(self) -> int:
        if self._thread is None:
            return 0
        return await self._acall(self._cancel_everything)

    def cancel_where(self, matches: Callable[[JobInfo], bool]) -> int:
        """Cancel every job whose `JobInfo` matches, in one engine command; returns how many there were.

        One command, not one `cancel` per job: each command waits for the step in progress, so cancelling
        3,000 jobs one by one took 326 s where cancelling 2,000 in one command took 0.31 s."""
        try:
            return self._call(lambda engine: self._cancel_matching(engine, matches))
        except NoModelLoaded:
            return 0

    def _cancel_everything(self, engine: Engine) -> int:
        return self._cancel_matching(engine, lambda info: True)

    def _cancel_matching(self, engine: Engine, matches: Callable[[JobInfo], bool]) -> int:
        return sum(self._cancel_on_engine(engine, info.job_id) for info in engine.jobs() if matches(info))

    def _cancel_on_engine(self, engine: Engine, job_id: int) -> bool:
        if not engine.cancel(job_id):
            return False
        self._deliveries.end(job_id, EosReason.CANCELLED)
        return True

    def jobs(self) -> list[JobRow]:
        """Pending and active jobs with whether their streams are being read; during a long step, as the engine
        last published them (`EngineThread.views`), so a view waits for no step unless a command was queued
        before it (a cancel asked for without waiting), which it shows."""
        return self._rows(self._views().jobs)

    def ended(self, job_id: int) -> StreamEvent | None:
        """The last event of a job that has ended lately: how a job table that saw it running says it ended."""
        return self._deliveries.ended(job_id)

    async def ajobs(self) -> list[JobRow]:
        """`jobs` for a coroutine."""
        return self._rows(await self._acall(lambda engine: engine.jobs()))

    def _rows(self, infos: list[JobInfo]) -> list[JobRow]:
        return [
            JobRow(info, self._deliveries.consumed(info.job_id), self._deliveries.detached(info.job_id))
            for info in infos
        ]

    def cache_view(self) -> CacheView:
        """The KV cache's pages; like `jobs`, never waits for a step (a long prefill held `%exl_cache` 3-5 s)."""
        return self._views().cache

    async def acache_view(self) -> CacheView:
        return await self._acall(lambda engine: engine.cache_view())

    def _views(self) -> EngineViews:
        try:
            return self._engine_thread().views()
        except EngineStopped:
            raise NoModelLoaded() from None

    # -- failures and the end (engine thread) ----------------------------------------------------------------

    def _fail_jobs(self, job_ids: tuple[int, ...], error: BaseException) -> None:
        """The engine failed these jobs alone: their streams raise, every other job runs on."""
        self._deliveries.fail(job_ids, _caused_by(JobError(f"job failed inside the engine: {one_line(error)}"), error))

    def _fail_step(self, engine: Engine, error: BaseException) -> None:
        """A whole engine step raised: every job fails with that error, and the session stays usable."""
        _drop_every_job(engine)
        message = f"the engine step failed: {one_line(error)}"
        self._deliveries.fail_all(lambda job_id: _caused_by(JobError(f"job {job_id}: {message}"), error))

    def _end_every_job(self, engine: Engine) -> None:
        """The engine thread's last act: no job outlives the model, and no stream waits for ever."""
        _drop_every_job(engine)
        self._deliveries.fail_all(
            lambda job_id: ModelUnloaded(
                f"job {job_id} ended: the model was unloaded after {self._deliveries.new_tokens(job_id)} new tokens"
            )
        )


def _caused_by(job_error: JobError, error: BaseException) -> JobError:
    """The engine's own exception under the one-line JobError, so a notebook's traceback shows where it arose."""
    job_error.__cause__ = error
    return job_error


def _drop_every_job(engine: Engine) -> None:
    """Take every job out of the engine; their streams are ended by the caller, with its own reason."""
    for info in engine.jobs():
        engine.cancel(info.job_id)


_session: Session | None = None
_session_lock = threading.Lock()


def get_session() -> Session:
    """The kernel's one session, created on first use, unloaded when the process exits (an engine thread
    stopped in the middle of a forward pass at interpreter shutdown aborts the process)."""
    global _session
    with _session_lock:
        if _session is None:
            _session = Session()
            atexit.register(_session.unload)
        return _session
