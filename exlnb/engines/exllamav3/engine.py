"""The ExLlamaV3 engine: an ExLlamaV3 model and paged cache, and exactly one exllamav3 `Generator`.

exllamav3 is imported here only: importing it JIT-builds its CUDA extension (about 7 minutes the first time,
gpu.md). Verified against exllamav3 1.6.5, whose API this module uses as it is: `Config.from_directory`,
`Model.from_config`, a `Cache` built before `model.load()` (its generator asserts that order), and
`Generator.enqueue / iterate / cancel` over `Job`s. Attention runs on exllamav3's own paged kernels, so
continuous batching and prefix sharing need no flash-attn; a single sequence's decode calls take exlnb's Triton
kernel where triton is installed (decode_attention.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from exlnb.engines.base import (
    CacheView,
    EngineStatus,
    JobFailed,
    JobSpec,
    SamplerSettings,
    SeparateGeneratorsRefused,
    StreamEvent,
    wall_clock,
)
from exlnb.engines.device_sampling import DeviceDraws, JobDraw
from exlnb.engines.exllamav3.compat import fix_exllamav3
from exlnb.engines.exllamav3.decode_attention import take_decode_attention
from exlnb.engines.exllamav3.fused_products import fuse_exllamav3
from exlnb.engines.exllamav3.graph_checks import cannot_graph
from exlnb.engines.exllamav3.graph_decode import GraphDecoder
from exlnb.engines.exllamav3.prefill_together import PrefillTogether
from exlnb.engines.exllamav3.sampler import refused_settings, sampler_steps
from exlnb.engines.library_engine import (
    LibraryEngine,
    TrackedJob,
    allocated_per_gpu,
    import_library,
    job_arguments,
    max_new_tokens_within,
    page_view,
    used_per_gpu,
)
from exlnb.engines.options import PAGE_TOKENS, EngineOptions
from exlnb.engines.tokenizer import HfTokenizer

MAX_CHUNK_TOKENS = 2048  # exllamav3's own default prefill chunk

VERIFIED_EXLLAMAV3 = "1.6.5"


# exllamav3 1.6.5's error from a Generator after a newer one was made over its cache (`Generator.iterate`)
SUPERSEDED = "no longer owns its Cache"


class ExLlamaV3Engine(LibraryEngine):
    name = "exllamav3"
    page_size = PAGE_TOKENS  # exllamav3.constants.PAGE_SIZE is 256, like exllamav2's pages
    loop_guard_by_engine = True  # exllamav3's LoopDetector serves --loop-guard
    separate_generators_note = (
        "The generator-per-request run makes real extra exllamav3 Generators over the engine's model and cache, "
        "the reporter's pattern on the maintained library. exllamav3 1.6.5 gives the cache to the newest "
        "Generator and makes the older ones raise, so the pattern fails loudly there instead of mixing outputs."
    )

    def __init__(self, options: EngineOptions, *, progress: bool = True) -> None:
        exl3 = import_library("exllamav3", VERIFIED_EXLLAMAV3, "ExLlamaV3")
        fix_exllamav3()
        self.options = options
        self._notes: list[str] = []
        self.tokenizer = HfTokenizer(options.model_dir)
        try:
            config = exl3.Config.from_directory(str(options.model_dir))
        except AssertionError as error:  # exllamav3 asserts on an architecture it does not know
            raise ValueError(f"exllamav3 {VERIFIED_EXLLAMAV3} cannot load {options.model_dir}: {error}") from error
        cache_tokens = options.cache_tokens - options.cache_tokens % self.page_size  # exllamav3 asserts whole pages
        self.vocab_size = config.vocab_size or self.tokenizer.vocab_size
        self.model = exl3.Model.from_config(config)
        self.cache = exl3.Cache(self.model, max_num_tokens=cache_tokens, **_cache_layers(exl3, options.cache_dtype))
        # exllamav3 loads (and prefills) in chunks of 2048 tokens by default and asserts that a chunk fits the
        # cache ("Cache too small for batch shape"), so a smaller cache needs smaller chunks
        self.max_chunk_size = min(MAX_CHUNK_TOKENS, cache_tokens)
        self.model.load(
            use_per_device=options.split_gib(),
            tensor_p=options.tensor_parallel,
            **({"tp_backend": options.tp_backend} if options.tp_backend else {}),
            progressbar=progress,
            max_batch_size=options.max_batch_size,
            max_chunk_size=self.max_chunk_size,
        )
        self.max_seq_len = min(config.max_position_embeddings or cache_tokens, cache_tokens)
        self._start_tracking()
        self._own_generator(exl3.Tokenizer.from_config(config))
        self.fused = self._start_fused(fuse_exllamav3)
        self.decode_attention, note = take_decode_attention(self.model, self.page_size)
        self._notes += [note] if note else []
        self.graphs = self._start_graphs(self._graph_decoder, cannot_graph)
        self._start_draws()
        self._check_it_runs()

    def _graph_decoder(self) -> GraphDecoder:
        decoder = GraphDecoder(
            self.model,
            self.cache,
            max_batch_size=self.generator.max_batch_size,
            max_pages=self.generator.max_total_tokens // self.page_size,
        )
        decoder.capacities, decoder.argmax_rows = self._row_capacities, self._argmax_rows
        return decoder

    def _row_capacities(self) -> list[int]:
        """How many tokens each decode row's allocated pages hold, in the order exllamav3 1.6.5 batches its rows
        (`Generator.iterate_gen`: its active jobs past their prefill, a row per sequence): how far a step queued
        ahead may write (queue_ahead.py)."""
        return [
            len(sequence.allocated_pages) * self.page_size
            for job in self.generator.active_jobs
            if job.is_prefill_done()
            for sequence in job.sequences
        ]

    def _check_it_runs(self) -> None:
        """One tiny greedy job before the load counts as done: exllamav3 loads weights its kernels cannot run
        (the bundled model's EXL3 quantization: "exl3_mgemm autotune: no compatible kernel shapes" on the first
        step), and a load that fails says so in one line, where a first job failing later would not. It also
        runs the kernels' autotuning, which the user's first job would otherwise wait for."""
        from exllamav3 import Job

        probe = Job(
            input_ids=torch.tensor([[self.tokenizer.encode("Hi")[0]] * 2]),
            max_new_tokens=2,
            sampler=build_sampler(SamplerSettings.greedy(), self.tokenizer, self.vocab_size),
        )
        try:
            self.generator.enqueue(probe)
            while self.generator.num_remaining_jobs():
                self.generator.iterate()
        except Exception as error:
            self.close()
            # the session shows the first line (`one_line`): torch's checks append a C++ trace after it
            raise ValueError(
                f"exllamav3 {VERIFIED_EXLLAMAV3} loads {self.options.model_dir.name} but cannot run it: "
                f"{type(error).__name__}: {error}"
            ) from error
        self.generator.pagetable.reset_page_table()  # the cache inspector starts from an empty cache

    def _own_generator(self, tokenizer) -> None:
        """Make the engine's one generator, which owns the cache from then on (a fresh page table: nothing cached)."""
        self.generator = self._new_generator(tokenizer)
        batchable = self.generator.recurrent_cache is None and not self.model.loaded_tp
        self.prefill = PrefillTogether.start(self.generator, self._notes, batchable=batchable)
        # exllamav3 defragments its page table when the queue drains (`on_queue_drained`), at most once per
        # 8 x pages of allocations
        self._count_defrags(self.generator.pagetable, "defrag")

    # -- jobs ----------------------------------------------------------------------------------------------

    def enqueue(self, spec: JobSpec) -> int:
        from exllamav3 import Job

        max_new = max_new_tokens_within(spec, self.max_seq_len)
        spec.check_vocabulary(self.vocab_size)
        job_id = self._new_job_id()
        draw = self._job_draw(spec)
        sampler = (
            DrawnOnDevice(self.draws, job_id, draw)
            if draw is not None
            else build_sampler(spec.sampler, self.tokenizer, self.vocab_size)
        )
        job = Job(
            **job_arguments(spec, max_new, job_id),
            sampler=sampler,
            stop_on_loop=spec.stop_on_loop,
            # exllamav3 1.6.5 reports the softmax of the logits at temperature 1 before its sampler (Job's
            # return_probs), for every step: token_info.py's model's own probability, and no sampler's figure
            return_probs=spec.top_tokens > 0,
            return_top_tokens=spec.top_tokens,
            filters=self._filters(spec),
        )
        try:
            self.generator.enqueue(job)
        except AssertionError as error:  # exllamav3 asserts when a job can never fit its cache
            raise ValueError(f"exllamav3 refused the job: {error}") from error
        if draw is not None:
            sampler.job = job
        # exllamav3 lowers max_new_tokens in enqueue so that prompt + output + 1 fit the cache
        return self._track(job_id, job, spec, job.max_new_tokens, draw)

    def unsupported(self, spec: JobSpec) -> list[str]:
        """The sampler settings exllamav3 cannot sample as exlnb means them; enqueue refuses them in
        `check_supported`'s one message, and experiments read them here to say why a run was left out."""
        return refused_settings(spec.sampler)

    def _filters(self, spec: JobSpec) -> list | None:
        """exllamav3 1.6.5's own llguidance filter for a constraint, ending the job once the grammar is complete
        ("end_filter"), keeping its errors for this job alone (filter.py). Its keywords are
        llguidance's format names: json_schema=, regex=. exllamav3's filter reads the model's tokenizer.json as
        exlnb's own llguidance view does, so that view's check (`grammar_tokenizer`) guards this one too."""
        if spec.constraint is None:
            return None
        from exlnb.engines.exllamav3.filter import KeptErrorFilter

        self.tokenizer.grammar_tokenizer(self.vocab_size)  # built once; raises where llguidance misreads tokens
        constraint = spec.constraint
        return [
            KeptErrorFilter(self.generator.tokenizer, eos_after_completed=True, **{constraint.kind: constraint.source})
        ]

    def _start_tracking(self) -> None:
        super()._start_tracking()
        self._failed_step_events: list[StreamEvent] = []

    def has_work(self) -> bool:
        return bool(self._jobs) or bool(self._failed_step_events)

    def step(self) -> list[StreamEvent]:
        events, self._failed_step_events = self._failed_step_events, []
        results = self.generator.iterate()
        self._wait_for_asked_steps()
        now = wall_clock()
        failures: dict[int, BaseException] = {}
        for result in results:
            job_id = result["job"].identifier  # "error" results carry the job, not the identifier
            tracked = self._jobs.get(job_id)
            if tracked is None:
                continue
            if result["stage"] == "error":  # exllamav3 reaped the job (reap_failed_job); the rest run on
                self._forget(job_id)
                failures[job_id] = result["error"]
            elif result["stage"] == "started":
                events.append(self._started(job_id, tracked, now))
            elif result["stage"] == "streaming":
                events.append(self._streaming_event(job_id, result, tracked, now))
        failures.update(self._cancel_failed_filters())
        events = [event for event in events if event.job_id not in failures]
        if failures:
            self._failed_step_events = events  # delivered by the next step, so no other job loses an event
            raise JobFailed(list(failures), next(iter(failures.values())))
        return events

    def _streaming_event(self, job_id: int, result: dict, tracked: TrackedJob, now: float) -> StreamEvent:
        text, new_ids = result.get("text", ""), _ids(result.get("token_ids"))
        held: dict = {}
        if result.get("eos_reason") == "stop_token":
            # exllamav3 keeps the stop token, and text held back with it, in "held"; report the token like the
            # CPU engine does and the held text without the stop token's own piece
            held = result.get("held", {})
            text += held.get("text", "").removesuffix(result["eos_triggering_token_str"])
            new_ids += _ids(held.get("token_ids"))
        info = self._token_info(tracked.spec, new_ids, result, held)
        return self._produced(job_id, tracked, now, text, new_ids, result.get("eos_reason"), info)

    # -- views ---------------------------------------------------------------------------------------------

    def cache_view(self) -> CacheView:
        return CacheView(
            paged=True,
            page_size=self.page_size,
            pages=page_view(self._jobs, self.generator.pagetable.all_pages),
            max_tokens=self.generator.max_total_tokens,
            defrag_count=self.defrag_count,
            device_memory_per_gpu=self.memory_per_gpu(),
        )

    def memory_per_gpu(self) -> tuple[int, ...]:
        """Under tensor parallelism the driver's count: exllamav3 keeps the other cards' shards in worker processes."""
        return used_per_gpu() if self.options.tensor_parallel else allocated_per_gpu()

    def status(self) -> EngineStatus:
        per_gpu = self.memory_per_gpu()
        return EngineStatus(
            engine=self.name,
            model=self.options.model_dir.name,
            device=torch.cuda.get_device_name(),
            paged=True,
            attention=(
                "exlnb paged attention (Triton decode, one sequence), exllamav3's for batches and prefill"
                if self.decode_attention
                else "exllamav3 paged attention"
            ),
            cache_tokens=self.generator.max_total_tokens,
            cache_dtype=self.options.cache_dtype,
            max_batch_size=self.generator.max_batch_size,
            device_memory_bytes=sum(per_gpu),
            device_memory_per_gpu=per_gpu,
            notes=tuple(self._notes),
            library=f"exllamav3 {VERIFIED_EXLLAMAV3}",
            decode=self._decode_line(),
        )

    def _new_generator(self, tokenizer):
        import exllamav3 as exl3

        return exl3.Generator(
            model=self.model,
            cache=self.cache,
            tokenizer=tokenizer,
            max_batch_size=self.options.max_batch_size,
            max_chunk_size=self.max_chunk_size,
        )

    # -- field report 2's mistake, on purpose --------------------------------------------------------------

    def run_with_separate_generators(self, specs):
        try:
            return super().run_with_separate_generators(specs)
        except RuntimeError as error:
            if SUPERSEDED not in str(error):
                raise
            raise SeparateGeneratorsRefused(
                f"exllamav3 {VERIFIED_EXLLAMAV3} refuses a generator per request: {error}"
            ) from None

    def _separate_generator(self, first_job_id: int) -> ExLlamaV3Engine:
        """The reporter's pattern on exllamav3: another Generator over the engine's model and cache. Its
        constructor builds a PageTable of its own over every page of the cache (exllamav3 1.6.5,
        `PageTable(self, cache)`) and takes the cache from every Generator made before it (`owner_serial`):
        those raise at their next `iterate`."""
        return self._twin_over(self._new_generator(self.generator.tokenizer), first_job_id)

    def _forget_cache_contents(self) -> None:
        """A new generator for the engine: separate generators took the cache from the old one, which exllamav3
        no longer lets run, and wrote over the pages its page table remembers."""
        retired = self.generator
        self._own_generator(retired.tokenizer)
        retired.close()

    def score(self, token_ids: Sequence[int], *, noise_eps: float = 0.0) -> torch.Tensor:
        if noise_eps:
            raise ValueError(
                f"the {self.name} engine scores without injected noise: compute the noise floor on the cpu engine"
            )
        # exllamav3 1.6.5's eval/ppl.py scores this way: model.forward without a cache, non-causal-cache attention
        with torch.inference_mode():
            logits = self.model.forward(torch.tensor([list(token_ids)]), {"attn_mode": "flash_attn_nc"})
        return logits.float().cpu()[0, :, : self.tokenizer.vocab_size]

    def close(self) -> None:
        self._cancel_all()
        if self.graphs:
            self.graphs.uninstall()
            self.graphs = None
        self.fused.uninstall()
        if self.decode_attention:
            self.decode_attention.uninstall()
        self.generator.close()
        self.model.unload()
        del self.generator, self.cache, self.model
        torch.cuda.empty_cache()


class DrawnOnDevice:
    """The sampler of an exllamav3 job whose tokens the device draws (device_sampling.py): it hands exllamav3 the
    token the decode step's graph drew for the job, or draws it from the job's own logits where the step ran
    eagerly. exllamav3 1.6.5's Job calls `forward` and reads the two flags; nothing else."""

    reqs_past_ids = False  # the penalties' counts live on the device: no sequence to upload
    reqs_torch_seed = False

    def __init__(self, draws: DeviceDraws, job_id: int, draw: JobDraw) -> None:
        self.draws, self.job_id, self.draw = draws, job_id, draw
        self.job = None  # the library's job, set once it exists

    def forward(self, logits: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        token = self.draws.token(self.job_id)
        if token is None:
            token = self.draws.draw_alone(self.draws.row(self.draw, max(self.job.new_tokens, 0)), logits)
        return token


def build_sampler(settings: SamplerSettings, tokenizer: HfTokenizer, vocab_size: int):
    """An exllamav3 `CustomSampler` from the planned steps (ValueError for a setting it lacks)."""
    from exllamav3.generator import sampler as exl3_sampler

    steps = [getattr(exl3_sampler, step.name)(*step.args) for step in sampler_steps(settings, tokenizer, vocab_size)]
    return exl3_sampler.CustomSampler(steps)


def _cache_layers(exl3, cache_dtype: str) -> dict:
    """Cache keyword arguments: fp16 layers, or quantized ones with `k_bits` = `v_bits` = 4, 6 or 8."""
    if cache_dtype == "fp16":
        return {"layer_type": exl3.CacheLayer_fp16}
    bits = int(cache_dtype.removeprefix("q"))
    return {"layer_type": exl3.CacheLayer_quant, "k_bits": bits, "v_bits": bits}


def _ids(tensor) -> list[int]:
    return tensor.flatten().tolist() if tensor is not None else []
