"""The kernel-resident session: one model, one cache, one generator per kernel process.

Every cell, widget, magic and background job talks to `get_session()`. Field report 2 is what happens
otherwise: generators created per request, sharing one cache, write over each other's pages.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

from exlnb.engine_thread import EngineThread
from exlnb.engines import EngineOptions, create_engine
from exlnb.engines.base import (
    CacheView,
    Engine,
    EngineStatus,
    EosReason,
    JobInfo,
    JobSpec,
    SamplerSettings,
    Stage,
    StreamEvent,
    Tokenizer,
    wall_clock,
)
from exlnb.models import BUNDLED_MODEL, resolve_model
from exlnb.streaming import EventInbox, GenerationResult, JobStream


class NoModelLoaded(RuntimeError):
    def __init__(self) -> None:
        super().__init__('no model is loaded: call get_session().load() or run %exl_load first')


@dataclass(frozen=True)
class JobRow:
    """A job as the job table shows it: the engine's view plus whether anyone still reads its stream."""

    info: JobInfo
    consumed: bool  # a consumer is iterating the stream right now
    abandoned_ok: bool  # submitted with cancel_when_abandoned=False (runs on with nobody reading)


class Session:
    """Owns the engine and its thread; hands out `JobStream`s. Safe to use from any thread or task."""

    def __init__(self) -> None:
        self._load_lock = threading.RLock()  # load/unload; held while waiting on the engine thread
        self._lock = threading.Lock()  # the inbox table; taken by the engine thread, never held while waiting
        self._thread: EngineThread | None = None
        self._options: EngineOptions | None = None
        self._inboxes: dict[int, EventInbox] = {}
        self._last_event: dict[int, StreamEvent] = {}
        self._detached: set[int] = set()

    # -- loading ---------------------------------------------------------------------------------------

    def load(
        self,
        model: str = BUNDLED_MODEL,
        *,
        engine: str = "auto",
        cache_tokens: int | None = None,
        cache: str = "fp16",
        max_batch_size: int | None = None,
        gpu_split: Sequence[float] | None = None,
        paged: str | bool = "auto",
        reload: bool = False,
        progress: bool = True,
    ) -> EngineStatus:
        """Load a model into the session; a second call with the same arguments does nothing.

        `model` is "smollm2-135m-instruct" (fetched and converted once, then cached) or a local folder.
        `engine` is "auto" (ExLlamaV2 where CUDA is available, else CPU), "exllamav2" or "cpu".
        """
        model_dir = resolve_model(model, progress=progress)
        options = EngineOptions.resolve(
            engine=engine,
            model_dir=model_dir,
            cache_tokens=cache_tokens,
            cache_dtype=cache,
            max_batch_size=max_batch_size,
            gpu_split=tuple(gpu_split) if gpu_split else None,
            paged=paged,
        )
        with self._load_lock:
            if self._thread is not None and options == self._options and not reload:
                return self.status()
            self.unload()
            engine_obj = create_engine(options, progress=progress)
            self._options = options
            self._thread = EngineThread(engine_obj, self._deliver, self._fail_all)
            self._thread.start()
            return engine_obj.status()

    def unload(self) -> None:
        """Cancel every job, stop the engine thread and free model and cache memory."""
        with self._load_lock:
            if self._thread is None:
                return
            self.cancel_all()
            thread, self._thread, self._options = self._thread, None, None
            thread.stop()
            thread.engine.close()
            del thread
            gc.collect()

    @property
    def loaded(self) -> bool:
        return self._thread is not None

    def _engine_thread(self) -> EngineThread:
        thread = self._thread
        if thread is None:
            raise NoModelLoaded()
        return thread

    def status(self) -> EngineStatus:
        return self._engine_thread().call(lambda engine: engine.status())

    @property
    def tokenizer(self) -> Tokenizer:
        return self._engine_thread().engine.tokenizer

    @property
    def engine(self) -> Engine:
        """The engine itself, for experiments that compare against driving it by hand.

        Call it only through `run_on_engine` while the session runs, so that one thread owns it.
        """
        return self._engine_thread().engine

    def run_on_engine(self, fn):
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        return self._engine_thread().call(fn)

    # -- jobs ----------------------------------------------------------------------------------------------

    def submit(self, spec: JobSpec, *, cancel_when_abandoned: bool = True) -> JobStream:
        """Queue a job and return its stream.

        With `cancel_when_abandoned=False` the job runs to the end even when nobody reads it: the bug of
        field report 1, kept reachable so the notebooks can reproduce it.
        """
        return self.submit_together([spec], cancel_when_abandoned=cancel_when_abandoned)[0]

    def submit_together(self, specs: Sequence[JobSpec], *, cancel_when_abandoned: bool = True) -> list[JobStream]:
        """Queue several jobs in one engine command, so that the engine starts them in the same step.

        Jobs queued one by one may straddle a step: the first then decodes its first token alone and the
        next joins it a step later, in a batch of another shape. fp16 kernels round rows of differently
        shaped batches differently, so two greedy samples of one prompt may part ways; started together
        they share the prompt's pages from the first pass and stay in the same batches (`--n` samples).
        """
        thread = self._engine_thread()
        inboxes = [EventInbox() for _ in specs]

        def enqueue(engine: Engine) -> list[int]:
            # registered on the engine thread before its first step, so no event can be missed
            job_ids = []
            for spec, inbox in zip(specs, inboxes):
                job_id = engine.enqueue(spec)
                job_ids.append(job_id)
                with self._lock:
                    self._inboxes[job_id] = inbox
                    if not cancel_when_abandoned:
                        self._detached.add(job_id)
            return job_ids

        try:
            job_ids = thread.call(enqueue)
        except BaseException:
            # Interrupted while waiting (Ctrl-C), or one spec refused after others were queued: the engine
            # thread may have enqueued jobs all the same, and no stream would ever cancel them. Commands run
            # in order, so this runs after the enqueue.
            thread.post(lambda engine: self._cancel_orphans(engine, inboxes))
            raise
        return [
            JobStream(job_id, inbox, self.cancel, self.request_cancel, cancel_when_abandoned)
            for job_id, inbox in zip(job_ids, inboxes)
        ]

    def _cancel_orphans(self, engine: Engine, inboxes: list[EventInbox]) -> None:
        with self._lock:
            orphans = [job_id for job_id, box in self._inboxes.items() if any(box is mine for mine in inboxes)]
        for job_id in orphans:
            self._cancel_on_engine(engine, job_id)

    def job_spec(
        self,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int = 256,
        sampler: SamplerSettings | None = None,
        stop: Sequence[str | int] = (),
        seed: int | None = None,
        identifier: Hashable | None = None,
        stop_at_eos: bool = True,
        **sampler_overrides: float,
    ) -> JobSpec:
        """What `generate` submits, for `submit_together`: the prompt encoded, the settings checked.

        Sampler settings come from `sampler` (default: exllamav2's defaults) with keyword overrides, e.g.
        `temperature=0.7, top_p=0.9`. `stop` takes strings and token ids; the tokenizer's end-of-sequence
        token stops generation unless `stop_at_eos=False`.
        """
        tokenizer = self.tokenizer
        input_ids = tokenizer.encode(prompt, special=True) if isinstance(prompt, str) else list(prompt)
        settings = replace(sampler or SamplerSettings(), **sampler_overrides)
        stop_ids = {s for s in stop if isinstance(s, int)}
        if stop_at_eos:
            stop_ids.update(tokenizer.eos_token_ids)
        return JobSpec(
            input_ids=tuple(input_ids),
            max_new_tokens=max_new_tokens,
            sampler=settings,
            stop_token_ids=frozenset(stop_ids),
            stop_strings=tuple(s for s in stop if isinstance(s, str)),
            seed=seed,
            identifier=identifier,
        )

    def generate(
        self, prompt: str | Sequence[int], *, cancel_when_abandoned: bool = True, **options
    ) -> JobStream:
        """Start generating from a prompt (text, special tokens encoded as such, or token ids).

        `options` are `job_spec`'s: `max_new_tokens`, `sampler`, `stop`, `seed`, `identifier`,
        `stop_at_eos` and sampler overrides such as `temperature=0.7`.
        """
        return self.submit(self.job_spec(prompt, **options), cancel_when_abandoned=cancel_when_abandoned)

    def complete(self, prompt: str | Sequence[int], **options) -> GenerationResult:
        """`generate(...)` and wait for the whole result."""
        return self.generate(prompt, **options).result()

    def cancel(self, job_id: int) -> bool:
        """Cancel a job; its pages are free when this returns. False if it had already finished."""
        thread = self._thread
        if thread is None:
            return False
        return bool(thread.call(lambda engine: self._cancel_on_engine(engine, job_id)))

    def request_cancel(self, job_id: int) -> None:
        """Ask for a cancel without waiting: what a garbage-collector finaliser may safely do."""
        thread = self._thread
        if thread is not None:
            thread.post(lambda engine: self._cancel_on_engine(engine, job_id))

    def cancel_all(self) -> int:
        """Cancel every pending and active job; returns how many there were."""
        thread = self._thread
        if thread is None:
            return 0

        def cancel_everything(engine: Engine) -> int:
            return sum(self._cancel_on_engine(engine, info.job_id) for info in engine.jobs())

        return thread.call(cancel_everything)

    def _cancel_on_engine(self, engine: Engine, job_id: int) -> bool:
        if not engine.cancel(job_id):
            return False
        last = self._last_event.get(job_id)
        self._deliver(
            [
                StreamEvent(
                    job_id=job_id,
                    stage=Stage.DONE,
                    time_produced=wall_clock(),
                    eos=True,
                    eos_reason=EosReason.CANCELLED,
                    prompt_tokens=last.prompt_tokens if last else 0,
                    cached_tokens=last.cached_tokens if last else 0,
                    new_tokens=last.new_tokens if last else 0,
                    time_enqueued=last.time_enqueued if last else 0.0,
                    time_to_first_token_s=last.time_to_first_token_s if last else None,
                    prefill_tokens_per_s=last.prefill_tokens_per_s if last else None,
                    decode_tokens_per_s=last.decode_tokens_per_s if last else None,
                )
            ]
        )
        return True

    def jobs(self) -> list[JobRow]:
        """Pending and active jobs with whether their streams are being read."""
        infos = self._engine_thread().call(lambda engine: engine.jobs())
        with self._lock:
            inboxes = {info.job_id: self._inboxes.get(info.job_id) for info in infos}
            return [
                JobRow(
                    info=info,
                    consumed=inboxes[info.job_id] is not None and inboxes[info.job_id].consuming,
                    abandoned_ok=info.job_id in self._detached,
                )
                for info in infos
            ]

    def cache_view(self) -> CacheView:
        return self._engine_thread().call(lambda engine: engine.cache_view())

    # -- delivery (engine thread) ------------------------------------------------------------------------

    def _deliver(self, events: list[StreamEvent]) -> None:
        with self._lock:
            for event in events:
                inbox = self._inboxes.get(event.job_id)
                if event.eos:
                    self._inboxes.pop(event.job_id, None)
                    self._last_event.pop(event.job_id, None)
                    self._detached.discard(event.job_id)
                else:
                    self._last_event[event.job_id] = event
                if inbox is not None:
                    inbox.put(event)

    def _fail_all(self, error: BaseException) -> None:
        """An engine step raised: every job fails with that error, and the session stays usable."""
        engine = self._engine_thread().engine
        for info in engine.jobs():
            engine.cancel(info.job_id)
        with self._lock:
            inboxes, self._inboxes = self._inboxes, {}
            self._last_event.clear()
            self._detached.clear()
        for inbox in inboxes.values():
            inbox.put(error)


_session: Session | None = None
_session_lock = threading.Lock()


def get_session() -> Session:
    """The kernel's one session, created on first use."""
    global _session
    with _session_lock:
        if _session is None:
            _session = Session()
        return _session
