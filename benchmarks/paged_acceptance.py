"""Paged mode on the ExLlamaV2 engine without flash-attn: the acceptance numbers, written as JSON.

    python -m benchmarks paged-acceptance [--engine exllamav2] [--quick] [--out benchmarks/results]

Records, for the bundled model: the greedy text of 16 prompts run together in paged mode against each run
alone in unpaged mode; prompt pages shared by two running jobs with the same long prompt and reused by a
later one; aggregate decode tokens/s at 1 to 16 concurrent jobs (paged) and at 1 (unpaged); the pages left
when idle. The GPU tests (`tests/test_exllamav2_engine.py`) assert on the same scenarios.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

from benchmarks.decode import GREEDY, aggregate_throughput
from benchmarks.harness import device_slug, environment, summarise
from exlnb import get_session
from exlnb.engines.base import Stage
from exlnb.engines.job_options import JobOptions
from exlnb.engines.options import ENGINE_NAMES
from exlnb.session import Session
from exlnb.streaming import GenerationResult, JobStream
from exlnb.templates import chatml

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "What do bees make?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "List the planets of the solar system.",
    "What is the boiling point of water in Celsius?",
    "Suggest a name for a black cat.",
    "How many legs does a spider have?",
    "What is photosynthesis, in one sentence?",
    "Write a short limerick about a programmer.",
    "What is the largest ocean on Earth?",
]
LONG_PROMPT = chatml(
    " ".join(f"Fact {i}: the number {i} follows {i - 1}." for i in range(1, 60)) + "\nWhich fact mentions 7?"
)


def answers_alone(session: Session, questions: list[str], max_new_tokens: int) -> list[GenerationResult]:
    """Each prompt on its own, one after another (greedy)."""
    return [session.complete(chatml(q), max_new_tokens=max_new_tokens, sampler=GREEDY) for q in questions]


def answers_together(session: Session, questions: list[str], max_new_tokens: int) -> list[JobStream]:
    """All prompts submitted at once, so they run batched where the engine batches (greedy)."""
    specs = [session.spec_for(chatml(q), JobOptions(max_new_tokens=max_new_tokens, sampler=GREEDY)) for q in questions]
    return session.submit_together(specs)


def first_difference(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    """Index of the first token where two outputs differ; None where they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def shared_prompt_pages(session: Session, timeout_s: float = 30.0) -> dict:
    """Two jobs with the same long prompt started together, then a third after them: what the cache shows."""
    spec = session.spec_for(LONG_PROMPT, JobOptions(max_new_tokens=200, sampler=GREEDY, stop_at_eos=False))
    streams = session.submit_together([spec, spec])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = session.jobs()
        if len(rows) == 2 and all(r.info.stage is Stage.DECODE for r in rows):
            break
        time.sleep(0.001)
    running = session.cache_view()
    both = [s.result() for s in streams]
    later = session.complete(LONG_PROMPT, max_new_tokens=4, sampler=GREEDY)
    return {
        "prompt_tokens": later.prompt_tokens,
        "page_size": running.page_size,
        "shared_pages_while_both_run": running.shared_pages,
        "shared_pages": [
            {"index": p.index, "owners": list(p.owners), "ref_count": p.ref_count, "tokens_filled": p.tokens_filled}
            for p in running.pages
            if p.shared
        ],
        "cached_tokens": [r.cached_tokens for r in [*both, later]],
        "ttft_s": [r.time_to_first_token_s for r in [*both, later]],
        "same_text": len({r.text for r in both}) == 1,
        "first_different_token": first_difference(both[0].token_ids, both[1].token_ids),
    }


def throughput(session: Session, counts: tuple[int, ...], new_tokens: int, repeats: int) -> dict:
    """Aggregate new tokens/s of n jobs submitted together (`benchmarks.decode.aggregate_throughput`)."""
    aggregate_throughput(session, 1, new_tokens, seed=999)  # warm-up
    return {
        str(n): summarise([aggregate_throughput(session, n, new_tokens, seed=run) for run in range(repeats)])
        for n in counts
    }


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m benchmarks paged-acceptance", description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="auto", choices=ENGINE_NAMES)
    parser.add_argument("--quick", action="store_true", help="4 prompts, short runs: checks that everything runs")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    questions, new_tokens = (QUESTIONS[:4], 8) if args.quick else (QUESTIONS, 48)
    counts, repeats, decode_tokens = ((1, 2), 1, 8) if args.quick else ((1, 2, 4, 8, 16), 3, 128)

    session = get_session()
    paged = session.load("smollm2-135m-instruct", engine=args.engine, progress=False)
    unpaged_session = Session()  # a second engine, unpaged, for the reference answers
    unpaged = unpaged_session.load("smollm2-135m-instruct", engine=paged.engine, paged=False, progress=False)
    try:
        alone = answers_alone(unpaged_session, questions, new_tokens)
        unpaged_rates = throughput(unpaged_session, (1,), decode_tokens, repeats)
    finally:
        unpaged_session.unload()
    together = [s.result() for s in answers_together(session, questions, new_tokens)]
    sharing = shared_prompt_pages(session)
    rates = throughput(session, counts, decode_tokens, repeats)
    idle = session.cache_view()

    summary = {
        "environment": environment(),
        "paged": {"status": paged.line(), "notes": list(paged.notes)},
        "unpaged": {"status": unpaged.line(), "notes": list(unpaged.notes)},
        "together_paged_vs_alone_unpaged": {
            "prompts": len(questions),
            "max_new_tokens": new_tokens,
            "equal": sum(a.token_ids == t.token_ids for a, t in zip(alone, together)),
            "rows": [
                {
                    "question": q,
                    "alone_unpaged": a.text,
                    "together_paged": t.text,
                    "first_different_token": first_difference(a.token_ids, t.token_ids),
                }
                for q, a, t in zip(questions, alone, together)
            ],
        },
        "prefix_sharing": sharing,
        "aggregate_tokens_per_s": {
            "new_tokens_per_job": decode_tokens,
            "method": "n jobs of 64 random prompt tokens submitted together: their new tokens / submit-to-done seconds",
            "paged": rates,
            "unpaged": unpaged_rates,
            "ratio_8_over_1_paged": rates["8"]["median"] / rates["1"]["median"] if "8" in rates else None,
            "ratio_8_paged_over_1_unpaged": rates["8"]["median"] / unpaged_rates["1"]["median"]
            if "8" in rates
            else None,
        },
        "idle_cache": {
            "free_pages": idle.free_pages,
            "total_pages": idle.total_pages,
            "defrag_count": idle.defrag_count,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"paged-{paged.engine}-{device_slug(summary['environment'])}-{datetime.date.today()}"
    path = args.out / (stem + ("-quick" if args.quick else "") + ".json")
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
