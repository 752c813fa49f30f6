"""The vocabulary every engine speaks: jobs, stream events and their timings, the job table's rows, the `Engine`
interface (what an engine shows of its cache and status is `views.py`'s).

Nothing here touches torch, so the session, widgets and notebooks can import it freely. An engine is a
synchronous object driven by one thread (the session's `EngineThread`): `enqueue`, `cancel` and `step`, like
exllamav2's dynamic generator with its `enqueue()` and `iterate()`.
"""

from __future__ import annotations

import copy
import enum
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from exlnb.engines.checks import check_field_types, check_job_limits
from exlnb.engines.constraint import OutputConstraint
from exlnb.engines.delivery import Delivery
from exlnb.engines.sampling import SamplerSettings
from exlnb.engines.token_info import TokenInfo
from exlnb.engines.tokenizer import Tokenizer
from exlnb.engines.views import CacheView, EngineStatus

DEFAULT_MAX_NEW_TOKENS = 256  # the one default for every entrance: API, magics, job specs


def one_line(error: BaseException) -> str:
    """An exception as `Type: first line of its message`, for errors shown in one line."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def wall_clock() -> float:
    """The one clock every timing in exlnb reads (monotonic, high resolution)."""
    return time.perf_counter()


class Stage(str, enum.Enum):
    """Where a job is. Strings, so events serialise and print plainly."""

    PENDING = "pending"  # queued, waiting for cache pages or a batch slot
    PREFILL = "prefill"  # prompt being ingested
    DECODE = "decode"  # producing new tokens
    DONE = "done"


class EosReason(str, enum.Enum):
    """Why a job ended; names follow exllamav2's `eos_reason` values where they exist."""

    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    MAX_NEW_TOKENS = "max_new_tokens"
    END_OF_CACHE = "end_of_cache"  # the sequence reached the cache's token limit
    LOOP_DETECTED = "loop_detected"  # the engine's own loop detector ended the job (exllamav3's stop_on_loop)
    END_FILTER = "end_filter"  # the answer completed its constraint, JSON schema or regex (the libraries' name)
    CANCELLED = "cancelled"
    FAILED = "failed"  # ended by an error (an engine failure, the model unloaded); the stream raised it

    @property
    def words(self) -> str:
        """Why the job ended, as a reader says it: what every view shows (the value is the libraries' name)."""
        return END_WORDS[self]


END_WORDS = {
    EosReason.STOP_TOKEN: "end of turn",
    EosReason.STOP_STRING: "stop string",
    EosReason.MAX_NEW_TOKENS: "max new tokens reached",
    EosReason.END_OF_CACHE: "cache full",
    EosReason.LOOP_DETECTED: "loop detected",
    EosReason.END_FILTER: "constraint complete",
    EosReason.CANCELLED: "cancelled",
    EosReason.FAILED: "failed",
}


# stop_on_loop=(window, min_reps): exllamav3's LoopDetector ends a job once the last `window` sampled tokens are
# one exact cycle of at most window // min_reps tokens repeated. (64, 3) catches a cycle of up to 21 tokens
# (a sentence of SmolLM2's) after about three turns, the point where `--loop-guard` cancels on other engines.
LOOP_DETECTOR = (64, 3)


@dataclass(frozen=True)
class JobSpec:
    """What a caller asks an engine to do; engines turn it into their own job objects."""

    input_ids: tuple[int, ...]
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    sampler: SamplerSettings = field(default_factory=SamplerSettings)
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    identifier: Hashable | None = None  # the caller's label, shown in job tables and cache grids
    min_new_tokens: int = 0  # stop tokens are refused until this many tokens are out (exllamav2's name)
    banned_strings: tuple[str, ...] = ()  # never in the output, case-insensitive (exllamav2's dynamic job)
    stop_on_loop: tuple[int, int] | None = None  # (window, min_reps): end a job that only repeats (ExLlamaV3's)
    top_tokens: int = 0  # k >= 1: each new token carries its probability and k alternatives (token_info.py)
    constraint: OutputConstraint | None = None  # the answer must satisfy it (constraint.py)

    def __post_init__(self) -> None:
        check_field_types(self)
        if not self.input_ids:
            raise ValueError("input_ids is empty: a job needs at least one prompt token")
        check_job_limits(self)
        if self.constraint is not None and not self.stop_token_ids:
            raise ValueError(
                f"a job constrained to a {self.constraint.describe()} ends on a stop token where the "
                "constraint is satisfied: give one (keep stop_at_eos=True)"
            )

    @staticmethod
    def stopping(stop: Sequence[str | int], tokenizer: Tokenizer, *, at_eos: bool = True) -> dict[str, object]:
        """`stop_token_ids` and `stop_strings` for what a user wrote: token ids, strings, and a string that is a
        special token ("<|im_end|>"), which stops on its id since it is never decoded as text."""
        special = tokenizer.special_tokens()
        stops = [special.get(s, s) if isinstance(s, str) else s for s in stop]
        ids = {s for s in stops if isinstance(s, int)} | (set(tokenizer.eos_token_ids) if at_eos else set())
        return dict(stop_token_ids=frozenset(ids), stop_strings=tuple(s for s in stops if isinstance(s, str)))

    def check_vocabulary(self, vocab_size: int) -> None:
        """Refuse, in one line, a prompt or `token_bias` id the model has no logit for."""
        bad = [t for t in self.input_ids + tuple(t for t, _ in self.sampler.token_bias) if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})")


@dataclass(frozen=True)
class StreamEvent:
    """One result of one job from one engine step.

    `time_produced` is `time.perf_counter()` after the device was synchronised, so a consumer can measure
    how long a chunk waited before it was delivered (field report 3). Timing fields are filled once known;
    the last event of a job (`eos=True`) carries them all.
    """

    job_id: int
    stage: Stage
    time_produced: float
    text: str = ""
    token_ids: tuple[int, ...] = ()
    token_info: tuple[TokenInfo, ...] = ()  # parallel to token_ids when the job asked for top_tokens
    eos: bool = False
    eos_reason: EosReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    new_tokens: int = 0
    time_enqueued: float = 0.0  # perf_counter() when the job was submitted
    time_to_first_token_s: float | None = None  # submit -> first new token
    prefill_tokens_per_s: float | None = None  # prompt tokens actually computed (not cached) per second
    decode_tokens_per_s: float | None = None  # new tokens after the first, per second of decoding
    taken_back: int = 0  # times so far a banned string was spelled and its tokens taken back (0 where not reported)
    delivery: Delivery | None = None  # a server's answer: its frames as received (the last event; None in the kernel)

    @property
    def computed_prompt_tokens(self) -> int:
        """Prompt tokens the engine ran through the model (the rest came from the cache)."""
        return self.prompt_tokens - self.cached_tokens

    def ended(self, reason: EosReason, now: float) -> StreamEvent:
        """The last event of a job ended from outside (cancelled, failed): its counts and timings so far."""
        return replace(
            self, stage=Stage.DONE, time_produced=now, text="", token_ids=(), token_info=(), eos=True, eos_reason=reason
        )


@dataclass
class JobClock:
    """The moments one job passes, each read on `wall_clock()` after the device synchronised.

    Every engine keeps one per job and builds its events with `job_event`, so time to first token, prefill
    and decode rates mean the same on every engine: the investigations compare engines by these numbers.
    """

    enqueued: float
    admitted: float | None = None  # the job got its pages and its prompt started
    first_token: float | None = None

    def token_arrived(self, now: float) -> None:
        if self.first_token is None:
            self.first_token = now


def job_event(
    job_id: int,
    stage: Stage,
    clock: JobClock,
    now: float,
    *,
    prompt_tokens: int,
    cached_tokens: int,
    new_tokens: int,
    text: str = "",
    token_ids: Sequence[int] = (),
    token_info: Sequence[TokenInfo] = (),
    eos_reason: EosReason | None = None,
    taken_back: int = 0,
    delivery: Delivery | None = None,
) -> StreamEvent:
    """One job's event with its timings derived the one way exlnb defines them.

    TTFT: submit -> first new token. Prefill rate: prompt tokens actually computed (cached ones excluded)
    over admission -> first token. Decode rate: new tokens after the first over first token -> now.
    """
    first, admitted = clock.first_token, clock.admitted
    computed = prompt_tokens - cached_tokens
    prefill_rate = computed / (first - admitted) if first and admitted and first > admitted and computed > 0 else None
    decode_rate = (new_tokens - 1) / (now - first) if first and new_tokens > 1 and now > first else None
    return StreamEvent(
        job_id=job_id,
        stage=stage,
        time_produced=now,
        text=text,
        token_ids=tuple(token_ids),
        token_info=tuple(token_info),
        eos=eos_reason is not None,
        eos_reason=eos_reason,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        new_tokens=new_tokens,
        time_enqueued=clock.enqueued,
        time_to_first_token_s=(first - clock.enqueued) if first else None,
        prefill_tokens_per_s=prefill_rate,
        decode_tokens_per_s=decode_rate,
        taken_back=taken_back,
        delivery=delivery,
    )


@dataclass(frozen=True)
class DecodeSpan:
    """Several jobs' decoding taken together: the tokens they decoded after their first, over the time during
    which at least one of them was decoding (the union of their decode intervals, first token -> last event).

    Jobs decoded side by side share that time and jobs served one after another (a server that runs one request
    at a time) add theirs, so the rate is what the engine delivered. The sum of each job's own rate was not: four
    samples served in turn read "65.8 tok/s" for 104 tokens in 7.8 s."""

    tokens: int
    seconds: float
    jobs: int

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.tokens and self.seconds > 0 else None

    @classmethod
    def of(cls, events: Sequence[StreamEvent]) -> DecodeSpan:
        """From each job's latest event: its decode interval and the tokens it decoded (as `job_event` counts them)."""
        intervals, tokens = [], 0
        for event in events:
            if event.time_to_first_token_s is None or event.new_tokens < 2:
                continue
            first = event.time_enqueued + event.time_to_first_token_s
            if event.time_produced > first:
                intervals.append((first, event.time_produced))
                tokens += event.new_tokens - 1
        seconds, reached = 0.0, -math.inf
        for start, end in sorted(intervals):
            seconds += max(0.0, end - max(start, reached))
            reached = max(reached, end)
        return cls(tokens, seconds, len(intervals))


@dataclass(frozen=True)
class JobInfo:
    """A row of the job table."""

    job_id: int
    identifier: Hashable | None
    stage: Stage
    prompt_tokens: int
    new_tokens: int
    max_new_tokens: int
    time_enqueued: float
    pages: int  # cache pages the job holds now


class SeparateGeneratorsRefused(RuntimeError):
    """The library itself refuses field report 2's generator-per-request pattern (exllamav3 1.6.5: a generator
    made over a cache takes it from the ones made before, which then raise instead of mixing outputs)."""


class JobFailed(Exception):
    """Raised by `Engine.step()` when the engine can tell which jobs a failure belongs to.

    The engine has already removed those jobs; they fail, and every other job runs on. `events` are what
    the step produced for the other jobs, delivered as usual.
    """

    def __init__(self, job_ids: Sequence[int], cause: BaseException, events: Sequence[StreamEvent] = ()) -> None:
        super().__init__(f"job(s) {', '.join(map(str, job_ids))} failed: {cause}")
        self.job_ids = tuple(job_ids)
        self.cause = cause
        self.events = tuple(events)


@dataclass(frozen=True)
class PromptPass:
    """A prompt run the way a user's own code runs it, split where that user's clock stops (field report 5).

    `begin(input_ids)` makes the library call that takes the prompt and returns when the call returns, the
    device perhaps still busy with the work queued; `first_token()` then produces the first greedy token.
    """

    begin: Callable[[Sequence[int]], None]
    first_token: Callable[[], int]


class Engine(ABC):
    """A model, its cache and a batching generator, driven by a single thread.

    Every method is called from one thread at a time (the session serialises them); `step()` does one
    unit of work (a batched forward pass) and returns the events it produced.
    """

    name: str
    tokenizer: Tokenizer
    max_seq_len: int
    # how this engine builds field report 2's generator-per-request pattern, in a sentence for a reader
    separate_generators_note: str = ""
    # True where `--loop-guard` is the engine's own loop detector (a job with `stop_on_loop=LOOP_DETECTOR`, ended
    # with eos reason "loop_detected"); elsewhere exlnb's n-gram check cancels the sample (generation.py)
    loop_guard_by_engine: bool = False
    # field report 5's prompt passes this engine can lend (`lend_prompt_pass`): name -> what it runs
    prompt_passes: Mapping[str, str] = MappingProxyType({})
    # True where `score(..., noise_eps=...)` can inject noise after every layer (a noise floor for `divergence`)
    scores_with_noise: bool = False
    # why this engine, as loaded, cannot run a prompt that continues an answer from one of its tokens (a branch,
    # `GenerationResult.branch`), in words a user can act on; None where it can. Never changes once loaded
    branch_refusal: str | None = None

    @abstractmethod
    def enqueue(self, spec: JobSpec) -> int:
        """Validate and queue a job; returns its id. Raises ValueError for a job that can never run."""

    def unsupported(self, spec: JobSpec) -> list[str]:
        """What `spec` asks that this engine does not implement, as "name=value (why)"; nothing by default."""
        return []

    def refuse_unsupported(self, spec: JobSpec) -> None:
        """Called by `enqueue`: a setting an engine cannot honour fails the job rather than being ignored."""
        missing = self.unsupported(spec)
        if missing:
            raise ValueError(
                f"the {self.name} engine does not implement {'; '.join(missing)}: leave it out or load another engine"
            )

    @abstractmethod
    def cancel(self, job_id: int) -> bool:
        """Stop a job and free its pages at once; False if it was not known (already finished)."""

    @abstractmethod
    def step(self) -> list[StreamEvent]:
        """Admit what fits, run one batched forward pass, sample, and report."""

    @abstractmethod
    def jobs(self) -> list[JobInfo]:
        """Pending and active jobs, oldest first."""

    @abstractmethod
    def cache_view(self) -> CacheView: ...

    @abstractmethod
    def status(self) -> EngineStatus: ...

    def has_work(self) -> bool:
        return bool(self.jobs())

    def synchronize(self) -> None:
        """Wait for queued device work; called before every clock read (field report 5)."""

    def run_with_separate_generators(self, specs: Sequence[JobSpec]) -> list[tuple[int, ...]]:
        """Field report 2's mistake, on purpose: one generator per request over the one model cache.

        Each generator keeps its own page table and believes the whole cache is its own, so their jobs
        write keys and values over each other's. Runs the specs to the end that way and returns each one's
        generated token ids; the engine is as before afterwards. For the concurrency investigation only.
        Raises `SeparateGeneratorsRefused` where the library itself stops the pattern.
        """
        self._refuse_while_busy("the generator-per-request run")
        try:
            generators = [self._separate_generator(first_job_id=1 + 1000 * k) for k in range(len(specs))]
            return _step_in_turn(generators, specs)
        finally:
            self._forget_cache_contents()

    def lend_prompt_pass(self, name: str) -> AbstractContextManager[PromptPass]:
        """One of `prompt_passes` over this engine's model and cache, lent (`with`) while no job runs; the engine
        is as before afterwards. For timing a prompt pass the way field report 5's reporter did."""
        raise NotImplementedError(
            f"the {self.name} engine lends no prompt pass: field report 5's passes need the ExLlamaV2 engine on CUDA"
        )

    def score(self, token_ids: Sequence[int], *, noise_eps: float = 0.0):
        """The logits this engine's model gives at every position of `token_ids`, in one pass without the
        paged cache: a float32 CPU tensor [len(token_ids), vocab] (row i predicts token i + 1). For measuring
        a model's distributions against a reference (`exlnb.divergence`); engines with "scoring" implement it.
        With `noise_eps` (engines that set `scores_with_noise`), every decoder layer's output is multiplied by
        1 + noise_eps * N(0, 1) from a fixed seed: ExLlamaV3's qbench noise floor."""
        raise NotImplementedError(
            f"the {self.name} engine cannot score a token sequence (it returns no logits): load the model "
            "with the cpu, exllamav2 or exllamav3 engine"
        )

    def _refuse_while_busy(self, what: str) -> None:
        if self.has_work():
            raise RuntimeError(f"the engine has jobs running; {what} would overwrite their cache")

    def _separate_generator(self, first_job_id: int) -> Engine:
        """Another generator over this engine's model and cache, with a page table of its own (the bug)."""
        raise NotImplementedError(f"the {self.name} engine cannot reproduce the generator-per-request pattern")

    def _shallow_twin(self) -> Engine:
        """A shallow copy of this engine, for `_separate_generator` to give a generator of its own. A method set
        on this instance is bound to this engine and would drive its generator, not the twin's: pytest before 9.2,
        undoing a patched `step`, set the engine's bound `step` back on the instance, and twins that copied it
        stepped the engine and never ended. The twin keeps its class's methods."""
        twin = copy.copy(self)
        for name, value in list(vars(twin).items()):
            if getattr(value, "__self__", None) is self:
                delattr(twin, name)
        return twin

    def _forget_cache_contents(self) -> None:
        """Forget which prompts the cache holds: separate generators wrote over them, and a later job
        reusing a "cached" prompt page would read their keys and values."""

    def close(self) -> None:
        """Release model and cache memory."""


def _step_in_turn(generators: Sequence[Engine], specs: Sequence[JobSpec]) -> list[tuple[int, ...]]:
    """One job per generator, each stepped in turn as concurrent request handlers would; their token ids.

    Each generator holds one job, and every step of it takes at least one prompt token or makes one new token:
    so no job needs more rounds than its prompt and new tokens, and a run that does is reported, not waited on."""
    tokens: dict[int, list[int]] = {}
    running: dict[int, Engine] = {}
    for generator, spec in zip(generators, specs):
        job_id = generator.enqueue(spec)
        tokens[job_id], running[job_id] = [], generator
    rounds = max(len(spec.input_ids) + spec.max_new_tokens for spec in specs) + 1
    for _ in range(rounds):
        if not running:
            break
        for generator in list(running.values()):
            for event in generator.step():
                tokens[event.job_id] += event.token_ids
                if event.eos:
                    running.pop(event.job_id, None)
    if running:
        raise RuntimeError(f"the separate generators' jobs {sorted(running)} did not end within {rounds} steps each")
    return [tuple(ids) for ids in tokens.values()]
