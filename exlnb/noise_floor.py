"""The noise floor of the near-tie map, measured on the loaded engine: the same greedy steps run again another way,
and how far each margin moved (`exlnb.near_ties`).

Probe questions are answered greedily, each alone; then inside a batch of 2, 8 and 16 (the other rows other
questions, all submitted in one step and run to the same length, so the batch keeps its shape); then, on the
engines that score, by a whole-sequence pass over the answer (`Engine.score`: the prompt path against step-by-step
decode); then with the model loaded again another way, in a session of its own: an fp16 cache against a q8 one,
CUDA graphs against eager decode, and where the machine has two GPUs, one card against a layer split and against
tensor parallelism. What an engine cannot compare (the registry says what it has; the machine how many GPUs) is
said in one line. The floor is kept per session and loaded model (`measured_floor`), so `result.near_ties()`
measures it once.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from exlnb.datasets import load_questions
from exlnb.engines.job_options import JobOptions
from exlnb.engines.options import EngineOptions
from exlnb.engines.registry import engine_spec
from exlnb.engines.sampling import SamplerSettings
from exlnb.near_ties import FloorComparison, NoiseFloor, margin, pair_margin
from exlnb.scoring import score
from exlnb.session import LoadOptions, Session
from exlnb.streaming import GenerationResult
from exlnb.templates import conversation, render

BATCH_SIZES = (2, 8, 16)
PROBES = 4
PROBE_TOKENS = 32
ALTERNATIVES = 5  # a pair that swapped is still among them: its margin's sign says so


@dataclass(frozen=True)
class Layout:
    """The loaded model loaded again another way: the keywords of `Session.load` that change, given the loaded
    options, and what the engine and the machine need for it."""

    name: str
    capability: str
    lacking: str  # what an engine without the capability has not, in a few words
    changes: Callable[[EngineOptions], dict]
    gpus: int = 1


LAYOUTS = (
    Layout(
        "an fp16 cache against a q8 cache",
        "quantized_cache",
        "quantized cache",
        lambda o: {"cache": "q8" if o.cache_dtype == "fp16" else "fp16"},
    ),
    Layout(
        "CUDA graphs against eager decode",
        "graphs",
        "CUDA graphs",
        lambda o: {"graphs": "off" if o.graphs == "auto" else "auto"},
    ),
    Layout(
        "one card against a layer split",
        "gpu_split",
        "layer split",
        lambda o: {"gpu_split": "auto", "tensor_parallel": False} if o.gpu_split is None else {"gpu_split": None},
        gpus=2,
    ),
    Layout(
        "one card against tensor parallelism",
        "tensor_parallel",
        "tensor parallelism",
        lambda o: {"tensor_parallel": not o.tensor_parallel, "gpu_split": None},
        gpus=2,
    ),
)
LAYOUT_NAMES = tuple(layout.name for layout in LAYOUTS)


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def why_not(layout: Layout, engine: str, gpus: int) -> str | None:
    """Why `engine` on this machine cannot make `layout`'s comparison, in a few words; None where it can."""
    if not engine_spec(engine).can(layout.capability):
        return f"{layout.name} (the {engine} engine has no {layout.lacking})"
    if gpus < layout.gpus:
        return f"{layout.name} (it needs {layout.gpus} GPUs, this machine has {gpus})"
    return None


def noise_floor(
    session: Session,
    *,
    probes: int = PROBES,
    max_new_tokens: int = PROBE_TOKENS,
    batch_sizes: Sequence[int] = BATCH_SIZES,
    layouts: Sequence[str] = LAYOUT_NAMES,
) -> NoiseFloor:
    """Measure the loaded engine's noise floor on `probes` questions answered greedily for `max_new_tokens`:
    alone against inside each batch size, against a whole-sequence pass where the engine scores, and against each
    of `layouts` (LAYOUT_NAMES) the engine and the machine can make, each loaded in a session of its own."""
    unknown = [name for name in layouts if name not in LAYOUT_NAMES]
    if unknown:
        raise ValueError(f"layouts={unknown!r}: choose from {', '.join(map(repr, LAYOUT_NAMES))}")
    if any(isinstance(size, bool) or not isinstance(size, int) or size < 2 for size in batch_sizes):
        raise ValueError(
            f"batch_sizes={list(batch_sizes)!r}: give batches of 2 or more (a probe alone is the baseline)"
        )
    if not 1 <= probes <= len(load_questions()):
        raise ValueError(f"probes={probes}: give 1 to {len(load_questions())} questions")
    options, engine = session.options, session.status().engine  # NoModelLoaded first, in a line
    prompts = probe_prompts(session, probes + max(batch_sizes, default=1))
    job = probe_options(session, prompts[0], max_new_tokens)
    alone = one_by_one(session, prompts[:probes], job)
    comparisons, missing = [], []
    for size in batch_sizes:
        if size > options.max_batch_size:
            missing.append(f"a batch of {size} (the engine decodes at most {options.max_batch_size} at once)")
            continue
        batched = inside_batches(session, prompts, probes, size, job)
        comparisons.append(compare(f"alone against inside a batch of {size}", alone, batched))
    if engine_spec(engine).can("scoring"):
        comparisons.append(compare_with_scoring(session, prompts[:probes], alone))
    else:
        missing.append(f"decode against a whole-sequence pass (the {engine} engine returns no logits)")
    gpus = gpu_count()
    for layout in (layout for layout in LAYOUTS if layout.name in layouts):
        reason = why_not(layout, engine, gpus)
        if reason:
            missing.append(reason)
            continue
        again = run_in_layout(
            options, layout, lambda other: [run_together(other, [p], job)[0] for p in prompts[:probes]]
        )
        comparisons.append(compare(layout.name, alone, again))
    note = f"not compared here: {'; '.join(missing)}" if missing else ""
    return NoiseFloor(engine, options.model_dir.name, tuple(comparisons), note)


def probe_prompts(session: Session, count: int) -> list[list[int]]:
    """The first `count` questions of data/questions, each as a user turn in the model's own template."""
    tokenizer = session.tokenizer
    questions = list(load_questions().question)
    return [tokenizer.encode(render("auto", conversation(q), tokenizer), special=True) for q in questions[:count]]


def probe_options(session: Session, prompt: Sequence[int], max_new_tokens: int) -> JobOptions:
    """Greedy with no penalties, the two likeliest tokens' probabilities recorded, run to `max_new_tokens` where the
    engine can ignore the end of sequence (so a batch keeps its shape), else to it."""
    job = JobOptions(
        max_new_tokens=max_new_tokens, sampler=SamplerSettings.greedy(), top_tokens=ALTERNATIVES, stop_at_eos=False
    )
    spec = session.spec_for(prompt, job)
    if session.run_on_engine(lambda engine: engine.unsupported(spec)):
        return JobOptions(max_new_tokens=max_new_tokens, sampler=SamplerSettings.greedy(), top_tokens=ALTERNATIVES)
    return job


def run_together(session: Session, prompts: Sequence[Sequence[int]], job: JobOptions) -> list[GenerationResult]:
    """The prompts' jobs submitted in one engine step, so they start and decode in one batch."""
    streams = session.submit_together([session.spec_for(list(p), job) for p in prompts])
    return [stream.result() for stream in streams]


def one_by_one(session: Session, prompts: Sequence[Sequence[int]], job: JobOptions) -> list[GenerationResult]:
    """Each prompt's job alone: submitted once the one before has ended."""
    return [run_together(session, [p], job)[0] for p in prompts]


def inside_batches(
    session: Session, prompts: Sequence[Sequence[int]], probes: int, size: int, job: JobOptions
) -> list[GenerationResult]:
    """Each probe answered inside a batch of `size`: the probes in groups of `size`, each group filled up with
    other questions."""
    results = []
    for start in range(0, probes, size):
        group = list(prompts[start : min(start + size, probes)])
        fillers = prompts[probes : probes + size - len(group)]
        results += run_together(session, [*group, *fillers], job)[: len(group)]
    return results


Step = tuple[int, Callable[[int, int], "float | None"]]  # the token chosen there, and a pair's margin there


def record_steps(result: GenerationResult) -> list[Step]:
    """Each position of a run: the token it chose, and a pair's margin in its record."""
    return [(r.info.token_id, partial(pair_margin, r.info)) for r in result.token_records]


def shifts(base: GenerationResult, steps: Sequence[Step]) -> tuple[list[float], bool]:
    """How far each of `base`'s margins (its top pair's) moved in another run's `steps`, up to and including the
    first position where the other chose another token; and whether it did."""
    moved = []
    for record, (choice, pair) in zip(base.token_records, steps):
        (top, _, _), (second, _, _) = record.info.alternatives[:2]
        now = pair(top, second)
        moved.append(float("inf") if now is None else abs(margin(record.info) - now))
        if choice != record.info.token_id:
            return moved, True
    return moved, False


def compare(name: str, alone: Sequence[GenerationResult], other: Sequence[GenerationResult]) -> FloorComparison:
    return comparison(name, [shifts(a, record_steps(b)) for a, b in zip(alone, other)])


def comparison(name: str, measured: Sequence[tuple[list[float], bool]]) -> FloorComparison:
    moved = [shift for shifts_, _ in measured for shift in shifts_]
    return FloorComparison(name, len(measured), len(moved), max(moved, default=0.0), sum(p for _, p in measured))


def compare_with_scoring(
    session: Session, prompts: Sequence[Sequence[int]], alone: Sequence[GenerationResult]
) -> FloorComparison:
    """Each answer's margins against those of one pass over its prompt and answer (`Engine.score`)."""
    measured = []
    for prompt, answer in zip(prompts, alone):
        logits = score(session, [*prompt, *answer.token_ids])[len(prompt) - 1 : -1]
        steps = [(int(row.argmax()), lambda top, second, row=row: float(row[top] - row[second])) for row in logits]
        measured.append(shifts(answer, steps))
    return comparison("decode against a whole-sequence pass", measured)


def run_in_layout(options: EngineOptions, layout: Layout, run: Callable[[Session], list[GenerationResult]]):
    """`run(session)` on the loaded model loaded again `layout`'s way, in a session of its own."""
    other = Session()
    other.load(LoadOptions.of(options).with_options(**layout.changes(options)), progress=False)
    try:
        return run(other)
    finally:
        other.unload()


_measured: weakref.WeakKeyDictionary[Session, tuple[EngineOptions, NoiseFloor]] = weakref.WeakKeyDictionary()
_measuring = threading.Lock()


def measured_floor(session: Session) -> NoiseFloor:
    """The loaded model's noise floor at the defaults, measured on the first call and kept until another model is
    loaded into `session`."""
    with _measuring:
        kept = _measured.get(session)
        if kept is None or kept[0] != session.options:
            kept = (session.options, noise_floor(session))
            _measured[session] = kept
        return kept[1]
