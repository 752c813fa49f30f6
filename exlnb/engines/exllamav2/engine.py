"""The ExLlamaV2 engine: an ExLlamaV2 model and cache, and exactly one ExLlamaV2DynamicGenerator.

exllamav2 is imported here only: importing it JIT-builds its CUDA extension (about 150 s the first time).
Verified against exllamav2 0.3.2, whose quirks on current torch and transformers are handled below.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import fields

import torch

from exlnb.engines import vocab
from exlnb.engines.base import (
    CacheView,
    EngineStatus,
    JobFailed,
    JobSpec,
    PromptPass,
    SamplerSettings,
    StreamEvent,
    wall_clock,
)
from exlnb.engines.device_sampling import JobDraw
from exlnb.engines.exllamav2.fused_products import fuse_exllamav2
from exlnb.engines.exllamav2.graph_decode import GraphDecoder, cannot_graph
from exlnb.engines.exllamav2.logits import KeptRawLogits, stop_token_logits, token_info_outputs
from exlnb.engines.exllamav2.paged_attention import VERIFIED_EXLLAMAV2
from exlnb.engines.exllamav2.prefill_together import PrefillTogether
from exlnb.engines.grammar import GrammarMatcher
from exlnb.engines.library_engine import (
    LibraryEngine,
    import_library,
    job_arguments,
    max_new_tokens_within,
    page_view,
)
from exlnb.engines.options import EngineOptions
from exlnb.engines.tokenizer import HfTokenizer

SDPA_TOLERANCE = 1e-2  # relative error between exllamav2's SDPA and matmul attention paths


def without_taken_back(ids: list[int], result: dict) -> list[int]:
    """The ids a streaming result really produced. When exllamav2 0.3.2 takes back the tokens of a banned string,
    its rewind restores `held_token` (a typo for `held_tokens`), so the next result still reports the taken-back
    tokens at the end of its ids while its text, probabilities and position leave them out (docs/gpu.md)."""
    taken_back = result.get("suppressed_tokens")
    if taken_back is None or not taken_back.numel():
        return ids
    tail = taken_back.flatten().tolist()
    return ids[: -len(tail)] if ids[-len(tail) :] == tail else ids


class ExLlamaV2Engine(LibraryEngine):
    name = "exllamav2"
    separate_generators_note = (
        "The generator-per-request outputs come from real extra ExLlamaV2DynamicGenerators over the engine's "
        "model and cache, the reporter's own pattern."
    )
    prompt_passes = {
        "streaming": "ExLlamaV2StreamingGenerator.begin_stream_ex, the reporter's call (exllamav2's "
        "examples/streaming.py): its prompt pass is model.forward(..., preprocess_only=True), which returns no logits",
        "dynamic": "the ExLlamaV2DynamicGenerator as exlnb's engine steps it: a job enqueued, iterate() until its "
        "first token, up to where the engine's step synchronises",
    }

    def __init__(self, options: EngineOptions, *, progress: bool = True) -> None:
        exl = import_library("exllamav2", VERIFIED_EXLLAMAV2, "ExLlamaV2")
        from exllamav2.generator import ExLlamaV2DynamicGenerator

        self.options = options
        self._notes: list[str] = []
        self.tokenizer = HfTokenizer(options.model_dir)
        config = exl.ExLlamaV2Config(str(options.model_dir))
        _apply_rope_theta(config, options.model_dir)
        cache_tokens = options.cache_tokens - options.cache_tokens % 256  # exllamav2 pages are 256 tokens
        # loading runs a warm-up pass of max_input_len tokens through the cache: it must fit a small cache
        config.max_input_len = min(config.max_input_len, cache_tokens)
        config.max_attention_size = min(config.max_attention_size, config.max_input_len**2)
        self.config = config
        self.vocab_size = config.vocab_size
        self.model = exl.ExLlamaV2(config)
        cache_class = {
            "fp16": exl.ExLlamaV2Cache,
            "q4": exl.ExLlamaV2Cache_Q4,
            "q6": exl.ExLlamaV2Cache_Q6,
            "q8": exl.ExLlamaV2Cache_Q8,
        }[options.cache_dtype]
        split = options.split_gib()
        if options.tensor_parallel:  # every layer split over the GPUs; the cache follows the model's split
            self.model.load_tp(
                split, progress=progress, expect_cache_tokens=cache_tokens, expect_cache_base=cache_class
            )
            self.cache = exl.ExLlamaV2Cache_TP(self.model, base=cache_class, max_seq_len=cache_tokens)
        elif split is None:
            self.cache = cache_class(self.model, max_seq_len=cache_tokens, lazy=True)
            self.model.load_autosplit(self.cache, progress=progress)
        else:
            self.model.load(split, progress=progress)
            self.cache = cache_class(self.model, max_seq_len=cache_tokens)
        self._check_sdpa()
        self.paged, self.attention = self._choose_attention()
        self.generator = ExLlamaV2DynamicGenerator(
            model=self.model,
            cache=self.cache,
            tokenizer=exl.ExLlamaV2Tokenizer(config),
            max_batch_size=options.max_batch_size,
            paged=self.paged,
        )
        self.page_size = self.generator.page_size
        self.fused = self._start_fused(fuse_exllamav2)
        self.graphs = self._start_graphs(self._graph_decoder, cannot_graph)
        self._start_draws()
        self._start_tracking()
        self.prefill = PrefillTogether.start(self.generator, self._notes, batchable=not options.tensor_parallel)
        # exllamav2 defragments only when idle after touching every page
        self._count_defrags(self.generator, "defrag_cache")
        self.max_seq_len = min(config.max_seq_len, cache_tokens)

    def _graph_decoder(self) -> GraphDecoder:
        decoder = GraphDecoder(
            self.model,
            self.cache,
            page_size=self.page_size,
            max_batch_size=self.generator.max_batch_size,
            max_pages=self.generator.max_pages,
        )
        decoder.argmax_rows = self._argmax_rows
        return decoder

    # -- load-time checks ----------------------------------------------------------------------------------

    def _check_sdpa(self) -> None:
        """exllamav2 0.3.2 gives wrong logits through its SDPA path (measured with torch 2.11, docs/gpu.md); the
        matmul path is right. The likely cause is upstream: `ExLlamaV2Attention._attn_torch` takes
        `attn_params.get_block_diag_mask()` as the mask whenever `causal` is set, and that is None outside
        variable-length batches, so SDPA runs without a causal mask.

        Compare the two on a short input and keep SDPA only if they agree.
        """
        from exllamav2 import attn

        if not attn.has_lower_right_sdpa or self.config.no_sdpa:
            return
        ids = torch.tensor([self.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)])
        with torch.inference_mode():
            sdpa = self.model.forward(ids).float()
            self.config.no_sdpa = True
            matmul = self.model.forward(ids).float()
        error = float((sdpa - matmul).norm() / matmul.norm())
        if error <= SDPA_TOLERANCE:
            self.config.no_sdpa = False
            return
        self._notes.append(
            f"exllamav2's SDPA attention disagreed with its matmul path (relative error {error:.3g}); "
            "using the matmul path (config.no_sdpa = True)"
        )
        print(f"exlnb: {self._notes[-1]}")

    def _choose_attention(self) -> tuple[bool, str]:
        """flash-attn's paged kernels where exllamav2 found them, else exlnb's paged attention, unless unpaged
        was asked for: unpaged, exllamav2 0.3.2's dynamic generator runs one job at a time on a one-page cache,
        with no batching and no prefix sharing (docs/gpu.md)."""
        from exllamav2 import attn

        from exlnb.engines.exllamav2 import paged_attention

        wanted = self.options.paged
        unpaged = "torch matmul" if self.config.no_sdpa else "torch SDPA"
        if self.options.tensor_parallel and not attn.has_flash_attn_with_paged:
            # exllamav2's paged tensor-parallel attention calls flash-attn's kernel from C++ (flash_attn_2_cuda),
            # past the Python function exlnb's paged attention stands in for
            if wanted is True:
                raise ValueError(
                    "paged=True with tensor_parallel needs flash-attn >= 2.5.7 (exllamav2 calls its "
                    'kernel directly there): load with paged="auto" to run unpaged'
                )
            self._notes.append(
                "unpaged: exllamav2's tensor-parallel paged attention needs flash-attn >= 2.5.7, "
                "so the dynamic generator runs one job at a time"
            )
            return False, unpaged
        if attn.has_flash_attn_with_paged and not paged_attention.installed() and not self.config.no_flash_attn:
            if wanted is False:
                return False, "flash-attn (unpaged by request)"
            return True, "flash-attn paged"
        if wanted is False:
            self._notes.append(
                "unpaged by request: the dynamic generator runs one job at a time and the cache is one page"
            )
            return False, unpaged
        if attn.has_flash_attn and wanted == "auto":  # flash-attn older than 2.5.7: install() would refuse
            self._notes.append(
                "unpaged: the installed flash-attn is older than 2.5.7, so the dynamic generator runs one job at "
                "a time; upgrade flash-attn, or uninstall it to use exlnb's paged attention"
            )
            return False, "flash-attn (unpaged)"
        paged_attention.install()
        self._notes.append(
            "paged through exlnb's PyTorch paged attention (flash-attn >= 2.5.7 is not importable); "
            "install flash-attn for faster attention"
        )
        if paged_attention.decodes_on_triton():
            return True, "exlnb paged attention (Triton decode, PyTorch prefill)"
        return True, "exlnb paged attention (PyTorch)"

    # -- jobs ----------------------------------------------------------------------------------------------

    def enqueue(self, spec: JobSpec) -> int:
        from exllamav2.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

        max_new = max_new_tokens_within(spec, self.max_seq_len)
        spec.check_vocabulary(self.vocab_size)
        self.refuse_unsupported(spec)
        settings = self._upstream_settings(spec.sampler, ExLlamaV2Sampler.Settings)
        job_id = self._new_job_id()
        job = ExLlamaV2DynamicJob(
            gen_settings=settings,
            **job_arguments(spec, max_new, job_id),
            **token_info_outputs(spec),
            filters=self._filters(spec),
        )
        draw = self._job_draw(spec)
        if draw is not None:
            job.receive_logits = self._drawn_on_device(job, job_id, draw)
        elif spec.top_tokens:
            job.receive_logits = KeptRawLogits(job.receive_logits)
        self.generator.enqueue(job)
        return self._track(job_id, job, spec, max_new, draw)

    def _host_sampled(self, spec: JobSpec) -> bool:
        # the token view's sampler's probability (return_probs) comes from exllamav2's host sampler
        return spec.top_tokens > 0

    def _drawn_on_device(self, job, job_id: int, draw: JobDraw):
        """The job's `receive_logits` where the device draws its tokens (device_sampling.py): the token the decode
        step's graph drew, or one drawn from the job's own logits where the step ran eagerly; what exllamav2
        0.3.2's own returns, with no probabilities (a job that asks for them is sampled on the host)."""
        draws = self.draws

        def receive_logits(logits: torch.Tensor):
            token = draws.host_token(job_id)
            if token is None:
                token = int(draws.draw_alone(draws.row(draw, max(job.new_tokens, 0)), logits))
            return torch.tensor([[token]], dtype=torch.long), None, None, None, False

        return receive_logits

    def unsupported(self, spec: JobSpec) -> list[str]:
        missing = []
        if spec.stop_on_loop:
            missing.append(f"stop_on_loop={spec.stop_on_loop!r} (exllamav2 0.3.2 has no loop detector; ExLlamaV3 has)")
        if spec.constraint and spec.banned_strings:
            missing.append(
                f"banned_strings={spec.banned_strings!r} with a {spec.constraint.describe()} (exllamav2 "
                "0.3.2's job cannot combine banned strings with filters; ExLlamaV3 can)"
            )
        return missing

    def _filters(self, spec: JobSpec) -> list | None:
        """exlnb's llguidance filter for a constraint (filter.py)."""
        if spec.constraint is None:
            return None
        from exlnb.engines.exllamav2.filter import GrammarFilter

        matcher = GrammarMatcher(spec.constraint, self.tokenizer, self.vocab_size, spec.stop_token_ids)
        return [GrammarFilter(self.model, self.generator.tokenizer, matcher)]

    def _upstream_settings(self, s: SamplerSettings, settings_class):
        """exllamav2's Settings from ours: the fields share exllamav2's names; two need its tensor or id forms."""
        values = {f.name: getattr(s, f.name) for f in fields(s)}
        vocab_size = self.vocab_size
        if s.token_bias:
            # the shape exllamav2's own Settings.disallow_tokens gives the bias: the vocabulary padded to 32
            bias = torch.zeros(vocab_size + -vocab_size % 32, dtype=torch.float)
            ids, amounts = zip(*s.token_bias)
            bias[list(ids)] = torch.tensor(amounts)
            values["token_bias"] = bias
        else:
            values["token_bias"] = None
        if s.dry_sequence_breakers is not None:  # None: exllamav2 derives its default set itself
            values["dry_sequence_breakers"] = set(
                vocab.dry_breaker_ids(self.tokenizer, s.dry_sequence_breakers, vocab_size)
            )
        return settings_class(**values)

    def step(self) -> list[StreamEvent]:
        results = self.generator.iterate()
        self._wait_for_asked_steps()
        events = self._events(results, wall_clock())
        if failures := self._cancel_failed_filters():
            others = [event for event in events if event.job_id not in failures]
            raise JobFailed(list(failures), next(iter(failures.values())), others)
        return events

    def _events(self, results: list[dict], now: float) -> list[StreamEvent]:
        """The events of one `iterate()`'s results, read at `now`."""
        events = []
        for result in results:
            job_id = result.get("identifier")
            tracked = self._jobs.get(job_id)
            if tracked is None:
                continue
            if result["stage"] == "started":
                events.append(self._started(job_id, tracked, now))
            elif result["stage"] == "streaming":
                ids = result.get("token_ids")
                new_ids = without_taken_back(ids.flatten().tolist() if ids is not None else [], result)
                stopped = result.get("eos_reason") == "stop_token"
                if stopped:  # exllamav2 holds the stop token back; report it, like the CPU engine
                    new_ids.append(result["eos_triggering_token_id"])
                info = self._token_info(tracked.spec, new_ids, result, *stop_token_logits(tracked.job, stopped))
                events.append(
                    self._produced(
                        job_id, tracked, now, result.get("text", ""), new_ids, result.get("eos_reason"), info
                    )
                )
        return events

    # -- field report 5: a prompt pass timed the way a user times it ----------------------------------------

    @contextlib.contextmanager
    def lend_prompt_pass(self, name: str) -> Iterator[PromptPass]:
        if name not in self.prompt_passes:
            raise ValueError(f"no prompt pass {name!r}: choose one of {', '.join(self.prompt_passes)}")
        self._refuse_while_busy(f"the {name} prompt pass")
        try:
            yield self._streaming_pass() if name == "streaming" else self._dynamic_pass()
        finally:
            self._cancel_all()  # the dynamic pass's job, where its first token was never read
            if name == "streaming":
                self._forget_cache_contents()  # it wrote from position 0 over the cache's pages

    def _streaming_pass(self) -> PromptPass:
        """The reporter's code: an ExLlamaV2StreamingGenerator over the engine's model, cache and tokenizer."""
        from exllamav2.generator import ExLlamaV2Sampler, ExLlamaV2StreamingGenerator

        streaming = ExLlamaV2StreamingGenerator(self.model, self.cache, self.generator.tokenizer)
        settings = self._upstream_settings(SamplerSettings.greedy(), ExLlamaV2Sampler.Settings)

        def begin(input_ids: Sequence[int]) -> None:
            streaming.begin_stream_ex(torch.tensor([list(input_ids)], dtype=torch.long), settings)

        def first_token() -> int:
            streaming.stream_ex()
            return int(streaming.sequence_ids[0, -1])  # the sampled token, even where it is a stop token

        return PromptPass(begin, first_token)

    def _dynamic_pass(self) -> PromptPass:
        """exlnb's own path, `step()` split at its synchronise: `begin` iterates the engine's generator until
        the job has its first token; `first_token` synchronises and reads the events as `step()` would."""
        results: list[dict] = []

        def begin(input_ids: Sequence[int]) -> None:
            job_id = self.enqueue(JobSpec(tuple(input_ids), max_new_tokens=1, sampler=SamplerSettings.greedy()))
            while not any(r.get("identifier") == job_id and r["stage"] == "streaming" for r in results):
                if not self.generator.num_remaining_jobs():
                    raise RuntimeError(f"exllamav2 dropped the prompt pass's job {job_id} before its first token")
                results.extend(self.generator.iterate())

        def first_token() -> int:
            self.synchronize()
            return next(event.token_ids[0] for event in self._events(results, wall_clock()) if event.token_ids)

        return PromptPass(begin, first_token)

    # -- field report 2's mistake, on purpose --------------------------------------------------------------

    def _separate_generator(self, first_job_id: int) -> ExLlamaV2Engine:
        """The reporter's code: another ExLlamaV2DynamicGenerator over the same model and cache. Its constructor
        builds a fresh page table over every page of the cache (exllamav2 0.3.2, `reset_page_table`), so it
        allocates the same pages the engine's generator and the other requests' generators use."""
        from exllamav2.generator import ExLlamaV2DynamicGenerator

        generator = ExLlamaV2DynamicGenerator(
            model=self.model,
            cache=self.cache,
            tokenizer=self.generator.tokenizer,
            max_batch_size=self.generator.max_batch_size,
            paged=self.paged,
        )
        return self._twin_over(generator, first_job_id)

    def _forget_cache_contents(self) -> None:
        self.generator.reset_page_table()

    # -- views ---------------------------------------------------------------------------------------------

    def cache_view(self) -> CacheView:
        return CacheView(
            paged=self.paged,
            page_size=self.page_size,
            pages=page_view(self._jobs, self.generator.all_pages),
            max_tokens=self.generator.max_total_tokens,
            defrag_count=self.defrag_count if self.paged else None,
            device_memory_per_gpu=self.memory_per_gpu(),
        )

    def status(self) -> EngineStatus:
        per_gpu = self.memory_per_gpu()
        device = torch.cuda.get_device_name()
        return EngineStatus(
            engine=self.name,
            model=self.options.model_dir.name,
            device=device,
            paged=self.paged,
            attention=self.attention,
            cache_tokens=self.generator.max_total_tokens,
            cache_dtype=self.options.cache_dtype,
            max_batch_size=self.generator.max_batch_size if self.paged else 1,
            device_memory_bytes=sum(per_gpu),
            device_memory_per_gpu=per_gpu,
            notes=tuple(self._notes),
            library=f"exllamav2 {VERIFIED_EXLLAMAV2}",
            decode=self._decode_line(),
        )

    def score(self, token_ids: Sequence[int], *, noise_eps: float = 0.0) -> torch.Tensor:
        if noise_eps:
            raise ValueError(
                f"the {self.name} engine scores without injected noise: compute the noise floor on the cpu engine"
            )
        # exllamav2 0.3.2's model.forward without a cache returns the logits of every position
        with torch.inference_mode():
            return self.model.forward(torch.tensor([list(token_ids)])).float().cpu()[0, :, : self.tokenizer.vocab_size]

    def close(self) -> None:
        self._cancel_all()
        if self.graphs:
            self.graphs.uninstall()
            self.graphs = None
        self.fused.uninstall()
        self.model.unload()
        del self.generator, self.cache, self.model
        torch.cuda.empty_cache()


def _apply_rope_theta(config, model_dir) -> None:
    # transformers 5 writes rope_parameters; exllamav2 0.3.2 reads top-level rope_theta only and silently
    # uses 10000 without it. Read it ourselves rather than rewriting the user's folder.
    raw = json.loads((model_dir / "config.json").read_text())
    theta = raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None:
        config.rotary_embedding_base = float(theta)
