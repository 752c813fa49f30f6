"""What the ExLlama engines share: importing a verified library, tracking its jobs, cancelling them, and
reading the job table and cache pages off its objects.

exllamav2 0.3.2 and exllamav3 1.6.5 agree on these shapes: a generator with `enqueue`, `iterate`, `cancel` and
`pending_jobs`; a job holding `sequences`, each with `allocated_pages`, and counting `new_tokens`,
`cached_pages` and `cached_tokens`; a page (`CachePage`) with `page_index`, `ref_count` and `kv_position`
(tokens filled); a defragmenter that does its work only now and then and moves `last_defrag_serial` when it does.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from exlnb.engines.base import (
    Engine,
    EosReason,
    JobClock,
    JobInfo,
    JobSpec,
    Stage,
    StreamEvent,
    job_event,
    one_line,
    wall_clock,
)
from exlnb.engines.checks import check_prompt_fits
from exlnb.engines.device_sampling import DeviceDraws, JobDraw, Row, device_sampling_on
from exlnb.engines.fused_products import CHECK_TEXT, FusedProducts, check_fused, check_tails, fused_products_on
from exlnb.engines.queue_ahead import takes_the_argmax
from exlnb.engines.token_info import TokenInfo, token_info
from exlnb.engines.views import PageInfo

# the libraries' `eos_reason` strings; exllamav2 never reports a loop
LIBRARY_EOS_REASONS = {
    "stop_token": EosReason.STOP_TOKEN,
    "stop_string": EosReason.STOP_STRING,
    "max_new_tokens": EosReason.MAX_NEW_TOKENS,
    "loop_detected": EosReason.LOOP_DETECTED,
    "end_filter": EosReason.END_FILTER,
}


GRAPH_CHECK_TEXT = "The quick brown fox jumps over the lazy dog."  # the prompt of the graphs' load check


def import_library(name: str, version: str, engine: str) -> ModuleType:
    """Import `name` where CUDA is present and its version is the one exlnb is verified against."""
    if not torch.cuda.is_available():
        raise RuntimeError(f'the {engine} engine needs a CUDA GPU; on this machine use engine="cpu"')
    try:
        library = importlib.import_module(name)
    except ImportError as error:
        raise RuntimeError(f"the {engine} engine needs {name}=={version}: pip install {name}=={version}") from error
    found = installed_version(library, name)
    if found != version:
        raise RuntimeError(
            f"exlnb's {engine} engine is verified against {name} {version}, found {found}: install {name}=={version}"
        )
    return library


def installed_version(library: ModuleType, name: str) -> str:
    """The library's version: exllamav2 says it as `__version__`, exllamav3 1.6.5 only in its package metadata."""
    return getattr(library, "__version__", None) or importlib.metadata.version(name)


def max_new_tokens_within(spec: JobSpec, max_seq_len: int) -> int:
    """The job's token limit lowered to what the cache holds after its prompt; a prompt that fills it is refused."""
    prompt = len(spec.input_ids)
    check_prompt_fits(prompt, spec.max_new_tokens, max_seq_len)
    return min(spec.max_new_tokens, max_seq_len - prompt)


def job_arguments(spec: JobSpec, max_new_tokens: int, job_id: int) -> dict:
    """The keywords exllamav2 0.3.2's `ExLlamaV2DynamicJob` and exllamav3 1.6.5's `Job` take alike."""
    return dict(
        input_ids=torch.tensor([spec.input_ids], dtype=torch.long),
        max_new_tokens=max_new_tokens,
        seed=spec.seed,
        stop_conditions=[*spec.stop_token_ids, *spec.stop_strings],
        min_new_tokens=spec.min_new_tokens,
        banned_strings=list(spec.banned_strings) or None,
        decode_special_tokens=True,  # like the CPU engine: a generated <|im_start|> is visible
        identifier=job_id,
    )


@dataclass
class TrackedJob:
    """What we know of one library job beyond what the library reports."""

    job: object  # the library's job object
    spec: JobSpec
    max_new_tokens: int  # possibly lowered so the job fits the cache
    clock: JobClock
    draw: JobDraw | None = None  # where the job's tokens are drawn on the device (device_sampling.py)

    @property
    def new_tokens(self) -> int:
        return max(self.job.new_tokens, 0)  # exllamav2 counts -1 while a healed token is pending

    def eos_reason(self, library_reason: str) -> EosReason:
        """The library's reason, except that a limit lowered to fit the cache is the cache's end."""
        reason = LIBRARY_EOS_REASONS[library_reason]
        if reason is EosReason.MAX_NEW_TOKENS and self.max_new_tokens < self.spec.max_new_tokens:
            return EosReason.END_OF_CACHE
        return reason


def allocated_per_gpu() -> tuple[int, ...]:
    """Device memory this process holds on each GPU (the status line's per-GPU memory)."""
    return tuple(torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count()))


def used_per_gpu() -> tuple[int, ...]:
    """Device memory in use on each GPU as the driver counts it, every process included. exllamav3's tensor
    parallelism keeps the other cards' shards in worker processes, out of this process's sight: over two H100s
    the allocator counted 8.4 + 0.1 GiB where the driver counted 10.1 + 9.9 GiB."""
    return tuple(total - free for free, total in map(torch.cuda.mem_get_info, range(torch.cuda.device_count())))


class LibraryEngine(Engine):
    """An engine over exactly one exllamav2 or exllamav3 generator: exlnb job ids, events, cancel, job table."""

    def memory_per_gpu(self) -> tuple[int, ...]:
        """Each GPU's memory held for the model: the status line and the cache view show it (cheap enough for a
        view published every few steps)."""
        return allocated_per_gpu()

    generator: object
    page_size: int
    vocab_size: int  # the model's vocabulary; exllamav2 pads its logits past it
    _notes: list[str]  # what the status line says about how the engine was set up

    def _start_fused(self, fuse: Callable[[object], FusedProducts]) -> FusedProducts:
        """The model's fp16 projections fused (fused_products.py) unless asked not to, kept where a whole-sequence
        pass gives the separate products' logits; otherwise separate, with a note. Before the graphs, which then
        capture the fused products."""
        fused = FusedProducts()
        if not fused_products_on() or not torch.cuda.is_available():
            return fused
        try:
            fused = fuse(self.model)
            reason = check_fused(fused, self.score, self.tokenizer.encode(CHECK_TEXT))
        except Exception as error:  # a model the fusion misreads loads with its separate products, and says why
            reason = one_line(error)
        if reason is not None:
            fused.uninstall()
            self._notes.append(f"projections not fused: {reason}")
            return FusedProducts()
        if (refused := check_tails(fused)) is not None:
            fused.drop_tails()
            self._notes.append(f"step tails not used: {refused}")
        return fused

    def _decode_line(self) -> str:
        """How decode steps run, for the status: eager or from graphs, and the fused products."""
        graphs = self.graphs.describe() if self.graphs else "eager"
        return ", ".join(filter(None, [graphs, self.fused.describe()]))

    def _start_graphs(self, make_decoder: Callable[[], object], cannot_graph: Callable[[object], str | None]):
        """Decode from CUDA graphs unless asked not to, where the engine's setup allows it (`cannot_graph` says
        why not) and a decode step replayed agrees with the same step run eagerly (the decoder's `self_check`,
        which writes into the cache's first pages, forgotten after); otherwise eager, with a note."""
        if self.options.graphs == "off":
            return None
        reason = cannot_graph(self)
        decoder = None
        if reason is None:
            decoder = make_decoder()
            decoder.install()
            try:
                with torch.inference_mode():
                    reason = decoder.self_check(self.tokenizer.encode(GRAPH_CHECK_TEXT))
            except Exception as error:  # a capture that fails here leaves decode eager, and says why
                reason = f"capture failed: {one_line(error)}"
            self._forget_cache_contents()
            if reason is not None:
                decoder.uninstall()
                decoder = None
        if reason is not None:
            self._notes.append(f"decode eager, not from CUDA graphs: {reason}")
        return decoder

    def _twin_over(self, generator: object, first_job_id: int):
        """This engine over another generator, with job tracking of its own numbered from `first_job_id`: field
        report 2's generator per request, sharing the engine's model and cache."""
        twin = self._shallow_twin()
        twin.generator = generator
        twin._start_tracking()
        twin._next_id = first_job_id
        return twin

    def _start_tracking(self) -> None:
        self._jobs: dict[int, TrackedJob] = {}
        self._next_id = 1
        self.defrag_count = 0

    def _new_job_id(self) -> int:
        job_id, self._next_id = self._next_id, self._next_id + 1
        return job_id

    def _track(self, job_id: int, job: object, spec: JobSpec, max_new_tokens: int, draw: JobDraw | None = None) -> int:
        """Follow an enqueued library job, whose identifier is `job_id`."""
        self._jobs[job_id] = TrackedJob(job, spec, max_new_tokens, JobClock(enqueued=wall_clock()), draw)
        return job_id

    def _forget(self, job_id: int) -> TrackedJob | None:
        """Stop following a job (ended, cancelled or failed), giving back what it held on the device."""
        tracked = self._jobs.pop(job_id, None)
        if tracked is not None and tracked.draw is not None:
            self.draws.end(tracked.draw)
        return tracked

    # -- sampling on the device ----------------------------------------------------------------------------

    draws: DeviceDraws | None = None  # set where the engine decodes from graphs

    def _start_draws(self) -> None:
        """Sample on the device where decode runs from graphs and `EXLNB_DEVICE_SAMPLING=1` asks for it (the graph
        draws the tokens too; off by default, the measurements are in device_sampling's docstring)."""
        if self.graphs is not None and device_sampling_on():
            self.draws = DeviceDraws(self.generator.max_batch_size, self.vocab_size, self.graphs.device)
            self.graphs.draws, self.graphs.step_rows = self.draws, self._step_rows

    def _job_draw(self, spec: JobSpec) -> JobDraw | None:
        """How the job's tokens are drawn on the device; None where the library samples them: no graphs, settings
        the device does not take (`DeviceDraws.drawable`), or a greedy job. Greedy, the libraries' own step is an
        argmax, and drawing on the device cost more host time than it saved: 5.86 against 5.49 ms a token on the
        ExLlamaV3 engine, 6.54 against 6.30 on the ExLlamaV2 engine, timed in turns in one process on an H200
        (benchmarks/results/graphs-nvidia-h200-2026-11-27)."""
        if self.draws is None or spec.sampler.is_greedy or DeviceDraws.drawable(spec) or self._host_sampled(spec):
            return None
        return DeviceDraws.start(spec)

    def _host_sampled(self, spec: JobSpec) -> bool:
        """What else keeps a job on the host in this engine (none here; an engine adds its own)."""
        return False

    def _decode_rows(self) -> Iterator[tuple[int, TrackedJob | None]]:
        """The decode step's rows in the library's batch order (its active jobs past their prefill, a row per
        sequence, as exllamav2 0.3.2's and exllamav3 1.6.5's `iterate_gen` lay them out): each job's id and what
        the engine tracks of it."""
        for job in self.generator.active_jobs:
            if job.is_prefill_done():
                for _ in job.sequences:
                    yield job.identifier, self._jobs.get(job.identifier)

    def _step_rows(self) -> list[tuple[int, Row | None]]:
        """Each decode row's job id and its device row, or None where the host samples it."""
        rows = []
        for job_id, tracked in self._decode_rows():
            draw = tracked.draw if tracked is not None else None
            rows.append((job_id, self.draws.row(draw, tracked.new_tokens) if draw is not None else None))
        return rows

    def _argmax_rows(self) -> list[bool]:
        """Whether each decode row's token is its step's argmax, which a decoder may queue the next step on
        (queue_ahead.py)."""
        return [tracked is not None and takes_the_argmax(tracked.spec) for _, tracked in self._decode_rows()]

    def _wait_for_asked_steps(self) -> None:
        """Field report 5: read the clock only after the GPU has done the steps the generator asked for, not a step
        queued ahead of the next."""
        if self.graphs is not None:
            self.graphs.synchronize()
        else:
            self.synchronize()

    def _count_defrags(self, owner: object, method: str) -> None:
        """Wrap the library's defragmenter to count the times it really moved pages, and to drop a decode step
        queued ahead before it does (queue_ahead.py: the queued step writes into pages the defragmenter may move)."""
        original = getattr(owner, method)

        def counting(*args, **kwargs):
            if self.graphs is not None:
                self.graphs.drop_ahead()
            before = owner.last_defrag_serial
            original(*args, **kwargs)
            if owner.last_defrag_serial != before:
                self.defrag_count += 1

        setattr(owner, method, counting)

    def _started(self, job_id: int, tracked: TrackedJob, now: float) -> StreamEvent:
        tracked.clock.admitted = now
        return self._event(job_id, tracked, Stage.PREFILL, now)

    def _produced(
        self,
        job_id: int,
        tracked: TrackedJob,
        now: float,
        text: str,
        new_ids: list[int],
        library_eos: str | None,
        token_info: Sequence[TokenInfo] = (),
    ) -> StreamEvent:
        """The event for a job's new tokens, and its end where the library reports one (it is then forgotten)."""
        if tracked.new_tokens > 0:
            tracked.clock.token_arrived(now)
        eos_reason = tracked.eos_reason(library_eos) if library_eos else None
        if eos_reason:
            self._forget(job_id)
        stage = Stage.DONE if eos_reason else Stage.DECODE
        return self._event(job_id, tracked, stage, now, text, new_ids, eos_reason, token_info)

    def _event(
        self,
        job_id: int,
        tracked: TrackedJob,
        stage: Stage,
        now: float,
        text: str = "",
        token_ids: Sequence[int] = (),
        eos_reason: EosReason | None = None,
        token_info: Sequence[TokenInfo] = (),
    ) -> StreamEvent:
        job = tracked.job
        return job_event(
            job_id,
            stage,
            tracked.clock,
            now,
            prompt_tokens=len(tracked.spec.input_ids),
            cached_tokens=job.cached_pages * self.page_size + job.cached_tokens,
            new_tokens=tracked.new_tokens,
            text=text,
            token_ids=token_ids,
            token_info=token_info,
            eos_reason=eos_reason,
        )

    def _token_info(self, spec: JobSpec, ids: Sequence[int], *parts: Mapping) -> list[TokenInfo]:
        """The records of `ids` from a result's per-token outputs (and exllamav3's "held" part), in order.

        The model's own distribution (token_info.py) comes from "logits" (1, n, padded vocab; exllamav2), whose
        softmax at temperature 1 is taken here, with "token_probs" (1, n) then the sampler's probability of each
        drawn token; or from "token_probs" with "top_k_tokens" / "top_k_probs" (1, n, k), which exllamav3 reports
        from the model's softmax, with no sampler's figure. A greedy step's sampler's figure is a certain 1.0.
        A token reported without them has no record: the list may be shorter (exllamav2's stop token, but where
        its engine kept the stop step's logits and passes them as one more part).
        """
        if not spec.top_tokens:
            return []
        certain = 1.0 if spec.sampler.is_greedy else None
        rows: list[tuple[float, list[int], list[float], float | None]] = []
        for part in parts:
            if part.get("logits") is not None:
                chosen_ids = torch.tensor(ids[len(rows) : len(rows) + part["logits"].shape[1]], dtype=torch.long)
                probs = torch.softmax(part["logits"][0, : len(chosen_ids), : self.vocab_size].float(), dim=-1)
                top = torch.topk(probs, spec.top_tokens)
                chosen = probs.gather(1, chosen_ids[:, None])[:, 0]
                reported = part.get("token_probs")
                sampled = reported[0].tolist() if reported is not None else [certain] * len(chosen_ids)
                rows += zip(chosen.tolist(), top.indices.tolist(), top.values.tolist(), sampled)
            elif part.get("token_probs") is not None:
                probs = part["token_probs"][0].tolist()
                likeliest, their_probs = part["top_k_tokens"][0].tolist(), part["top_k_probs"][0].tolist()
                rows += zip(probs, likeliest, their_probs, [certain] * len(probs))
        return [
            token_info(self.tokenizer, t, p, top_ids, top_probs, sampled)
            for t, (p, top_ids, top_probs, sampled) in zip(ids, rows)
        ]

    def _cancel_failed_filters(self) -> dict[int, Exception]:
        """Cancel the jobs whose constraint filter kept an error during the step (exllamav2/filter.py,
        exllamav3/filter.py) and return their errors: both libraries run filters inside `iterate()`, where
        raising would fail every job, so a constraint's error ends its own job here, after the step."""
        failures = {
            job_id: f.error
            for job_id, tracked in self._jobs.items()
            for f in (getattr(tracked.job, "filters", None) or ())
            if getattr(f, "error", None) is not None
        }
        for job_id in failures:
            self.cancel(job_id)
        return failures

    def cancel(self, job_id: int) -> bool:
        tracked = self._forget(job_id)
        if tracked is None:
            return False
        self.generator.cancel(tracked.job)
        return True

    def has_work(self) -> bool:
        return bool(self._jobs)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def jobs(self) -> list[JobInfo]:
        return job_table(self._jobs, self.generator.pending_jobs)

    def _cancel_all(self) -> None:
        for job_id in list(self._jobs):
            self.generator.cancel(self._forget(job_id).job)


def job_table(jobs: Mapping[int, TrackedJob], pending_jobs: Iterable[object]) -> list[JobInfo]:
    pending = {id(j) for j in pending_jobs}
    infos = []
    for job_id, tracked in sorted(jobs.items()):
        job = tracked.job
        if id(job) in pending:
            stage, pages = Stage.PENDING, 0
        else:
            stage = Stage.DECODE if tracked.new_tokens > 0 else Stage.PREFILL
            pages = sum(len(seq.allocated_pages or ()) for seq in job.sequences)
        infos.append(
            JobInfo(
                job_id=job_id,
                identifier=tracked.spec.identifier,
                stage=stage,
                prompt_tokens=len(tracked.spec.input_ids),
                new_tokens=tracked.new_tokens,
                max_new_tokens=tracked.spec.max_new_tokens,
                time_enqueued=tracked.clock.enqueued,
                pages=pages,
            )
        )
    return infos


def page_view(jobs: Mapping[int, TrackedJob], all_pages: Iterable[object]) -> tuple[PageInfo, ...]:
    owners: dict[int, set[int]] = {}
    for job_id, tracked in jobs.items():
        for seq in tracked.job.sequences:
            for page in seq.allocated_pages or ():
                owners.setdefault(page.page_index, set()).add(job_id)
    return tuple(
        PageInfo(
            index=page.page_index,
            owners=tuple(sorted(owners.get(page.page_index, ()))),
            ref_count=page.ref_count,
            tokens_filled=page.kv_position,
            shared=page.ref_count > 1,
            cached=page.ref_count == 0 and page.kv_position > 0,
        )
        for page in sorted(all_pages, key=lambda p: p.page_index)
    )
