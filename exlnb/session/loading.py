"""Loading: what to load, declared once and checked whole before the loaded model is touched; load, replace, unload.

`LoadOptions` declares every option of `Session.load` and `%exl_load` with `option()`: the keyword, the magic's
flag, the help, the default and docs/options.md's row all come from its fields. `LoadOptions.resolve` runs every
check that needs nothing loaded (the model folder, the engine and what it can do, the cache against the device's
memory, the machine); only then is the loaded model unloaded, and if the new one fails to load the previous one is
loaded again.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, fields

from exlnb.engine_thread import EngineThread
from exlnb.engines import create_engine
from exlnb.engines.base import Engine, EngineStatus, one_line
from exlnb.engines.checks import check_field_types, check_option_names, is_number
from exlnb.engines.declaration import declared, option, takes_options
from exlnb.engines.options import (
    AUTO_SPLIT,
    CACHE_DTYPES,
    DEFAULT_CACHE_TOKENS,
    DEFAULT_MAX_BATCH_SIZE,
    ENGINE_NAMES,
    GRAPH_MODES,
    PAGED_MODES,
    SERVER_APIS,
    SERVER_DIALECTS,
    EngineOptions,
    check_cache_fits,
    check_engine_runs_here,
    parse_gpu_split,
    parse_paged,
    tp_backend_choices,
)
from exlnb.models import BUNDLED_MODEL, library_bars_silenced, resolve_model
from exlnb.session.base import SessionBase
from exlnb.streaming import JobError, ModelUnloaded


class LoadFailed(RuntimeError):
    """Loading a model failed; the message says what is loaded now (the previous model, or nothing)."""


@dataclass(frozen=True)
class LoadOptions:
    """What `Session.load` and `%exl_load` are asked to load: each field a keyword of `load` and a flag of the
    magic (`model` its argument). Types are checked here; `resolve` checks the rest."""

    model: str | os.PathLike = option(
        BUNDLED_MODEL,
        group="model",
        positional=True,
        help=f'a model folder (HF fp16, EXL2 or EXL3), a hub repo id, or "{BUNDLED_MODEL}" (fetched and converted '
        "once); for a server, the served model's local folder, which lends its tokenizer and template",
    )
    engine: str = option(
        "auto",
        group="model",
        choices=ENGINE_NAMES,
        help="auto: the engine for the folder's format that runs here (docs/engines.md)",
    )
    reload: bool = option(
        False,
        group="model",
        help="load again even if the same model is loaded; replace a model while jobs run (they end)",
    )
    cache_tokens: int | None = option(
        None, group="cache", metavar="N", help=f"KV cache size in tokens (default: {DEFAULT_CACHE_TOKENS})"
    )
    cache: str = option(
        "fp16",
        group="cache",
        choices=CACHE_DTYPES,
        help="KV cache precision: q4, q6 and q8 on the engines that quantize their cache",
    )
    max_batch_size: int | None = option(
        None, group="cache", metavar="N", help=f"most jobs decoded together (default: {DEFAULT_MAX_BATCH_SIZE})"
    )
    paged: str | bool = option(
        "auto",
        group="cache",
        parse=parse_paged,
        metavar=f"{{{','.join(PAGED_MODES)}}}",
        help="off: one contiguous cache, one job at a time, on the engines that can run "
        "unpaged; auto: the engine's own choice",
    )
    gpu_split: tuple[float, ...] | str | None = option(
        None,
        group="GPUs",
        parse=parse_gpu_split,
        metavar="GIB,GIB",
        help="auto (fill the GPUs in turn), or GiB per GPU, comma separated, e.g. 20,24; 0 leaves a GPU out",
    )
    tensor_parallel: bool = option(
        False, group="GPUs", help="split every layer over the GPUs instead of placing whole layers (2+ GPUs)"
    )
    tp_backend: str | None = option(
        None,
        group="GPUs",
        metavar="NAME",
        help=f"how tensor parallelism all-reduces, where the engine offers a choice ({tp_backend_choices()}); "
        "default: the library's own",
    )
    graphs: str = option(
        "auto", group="GPUs", choices=GRAPH_MODES, help="CUDA-graph decode: auto uses it where its load check passes"
    )
    url: str | None = option(
        None,
        group="server",
        metavar="URL",
        help="an OpenAI-compatible server's API base, e.g. http://127.0.0.1:8000/v1",
    )
    served_model: str | None = option(
        None, group="server", metavar="NAME", help="the server's name for the model (default: the one it serves)"
    )
    dialect: str | None = option(
        None,
        group="server",
        choices=SERVER_DIALECTS,
        help="the server's kind, where its /v1/models does not say (default: read from it)",
    )
    api_key_env: str | None = option(
        None,
        group="server",
        metavar="VAR",
        help="environment variable holding the server's API key (the only way a key is sent)",
    )
    api: str = option(
        "chat",
        group="server",
        choices=SERVER_APIS,
        help="chat: the server's chat template; completions: exlnb's templates",
    )

    def __post_init__(self) -> None:
        split = self.gpu_split
        if isinstance(split, str) and split != AUTO_SPLIT:  # "20,24" read as the flag reads it, not as 5 characters
            split = parse_gpu_split(split)
        if is_number(split, float):
            raise TypeError(f"gpu_split={split!r}: give GiB per GPU as a list, e.g. [{split}] or [20, 24], or 'auto'")
        if isinstance(split, list):
            split = tuple(split)
        object.__setattr__(self, "gpu_split", split)
        check_field_types(self)

    @classmethod
    def build(cls, **options) -> LoadOptions:
        """Options as a user writes them; a misspelt name is refused naming the valid ones."""
        check_option_names(options, valid=[o.keyword for o in declared(cls)])
        return cls(**options)

    def with_options(self, **options) -> LoadOptions:
        return LoadOptions.build(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **options})

    @classmethod
    def of(cls, options: EngineOptions) -> LoadOptions:
        """The load that gives `options` again: the loaded model in a session of its own (another way, with
        `with_options`), as the noise floor loads it."""
        return cls(
            model=str(options.model_dir),
            engine=options.engine,
            cache_tokens=options.cache_tokens,
            cache=options.cache_dtype,
            max_batch_size=options.max_batch_size,
            paged=options.paged,
            gpu_split=options.gpu_split,
            tensor_parallel=options.tensor_parallel,
            graphs=options.graphs,
            url=options.url,
            served_model=options.served_model,
            dialect=options.dialect,
            api_key_env=options.api_key_env,
            api=options.api,
        )

    def resolve(self, *, progress: bool = True) -> EngineOptions:
        """The engine's options, once every check that needs nothing loaded has passed: the model folder (fetched
        where it is the bundled name or a hub id), the engine and what it can do with it, a cache the device can
        hold, an engine this machine can run."""
        options = EngineOptions.resolve(
            engine=self.engine,
            model_dir=resolve_model(self.model, progress=progress),
            cache_tokens=self.cache_tokens,
            cache_dtype=self.cache,
            max_batch_size=self.max_batch_size,
            gpu_split=self.gpu_split,
            paged=self.paged,
            graphs=self.graphs,
            tensor_parallel=self.tensor_parallel,
            tp_backend=self.tp_backend,
            url=self.url,
            api_key_env=self.api_key_env,
            api=self.api,
            served_model=self.served_model,
            dialect=self.dialect,
        )
        check_cache_fits(options)
        check_engine_runs_here(options.engine)
        return options


class Loading(SessionBase):
    """The session's lifecycle: load, replace, unload; the engine thread started and stopped."""

    @takes_options(LoadOptions)
    def load(
        self, model: str | os.PathLike | LoadOptions = BUNDLED_MODEL, *, progress: bool = True, **options
    ) -> EngineStatus:
        """Load a model into the session (`model` a name, a folder or a whole `LoadOptions`; the options are
        `LoadOptions`', listed in docs/options.md); a second call with the same options does nothing.

        Everything that can be checked is checked before the loaded model is touched. Replacing a loaded model
        while jobs run needs `reload=True` (they are ended); `reload=True` also loads again with unchanged
        options. If the new model fails to load, the previous one is loaded again.
        """
        asked = (
            model.with_options(**options)
            if isinstance(model, LoadOptions)
            else LoadOptions.build(model=model, **options)
        )
        engine_options = asked.resolve(progress=progress)
        with self._load_lock:
            if self._thread is not None and engine_options == self._options and not asked.reload:
                return self.status()
            if self._thread is not None and not asked.reload and (running := self.jobs()):
                raise ValueError(
                    f"{len(running)} job(s) are running on {self._options.model_dir.name}: loading another "
                    "model would end them. Pass reload=True (%exl_load --reload) to replace it anyway"
                )
            previous = self._options
            self.unload()
            try:
                self._start(engine_options, progress)
            except Exception as error:
                raise self._previous_restored(engine_options, previous, error) from error
            return self.status()

    def _previous_restored(self, failed: EngineOptions, previous: EngineOptions | None, error: Exception) -> LoadFailed:
        """What to raise when `failed` did not load: the previous model loaded again, or why not."""
        words = f"loading {failed.model_dir.name} failed: {one_line(error)}"
        if previous is None:
            return LoadFailed(words)
        try:
            self._start(previous, progress=False)
        except Exception as again:
            return LoadFailed(
                f"{words}; loading {previous.model_dir.name} again failed too ({one_line(again)}): "
                "no model is loaded now"
            )
        return LoadFailed(f"{words}; {previous.model_dir.name} is loaded again")

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

    # -- the engine thread's callbacks ---------------------------------------------------------------------

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
