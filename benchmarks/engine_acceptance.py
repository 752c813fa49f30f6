"""Measure the spine's acceptance numbers on one engine and write them as JSON with the environment.

    python -m benchmarks.engine_acceptance --engine exllamav2 --out benchmarks/results

Runs the same scenarios as tests/test_session.py, but records numbers instead of asserting them: what the
model answered, logits against transformers, the cost of an un-cancelled job (field report 1), prefix
reuse, and decode speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch

from benchmarks.harness import device_slug, environment
from exlnb import SamplerSettings, get_session
from exlnb.models import resolve_model
from exlnb.templates import chatml


def logits_error(session) -> float:
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([session.tokenizer.encode("The capital of France is Paris. " * 8)])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m-instruct"), dtype=torch.float32).to(device)
    with torch.inference_mode():
        reference = hf(ids.to(device)).logits.float().cpu()
    del hf
    if session.status().engine == "exllamav2":
        ours = session.run_on_engine(lambda e: e.model.forward(ids).float().cpu())
    else:
        from exlnb.engines.cpu.runner import SequenceChunk

        def forward_all(engine):
            runner = engine._runner
            return torch.stack(
                [runner.forward([SequenceChunk(tuple(ids[0, : n + 1].tolist()), 0, (0,))])[0] for n in range(ids.shape[1])]
            )

        ours = session.run_on_engine(forward_all)[None]
    return float((ours - reference).norm() / reference.norm())


def timed(session, prompt: str, **options) -> tuple[float, object]:
    start = time.perf_counter()
    result = session.complete(prompt, **options)
    return time.perf_counter() - start, result


def abandoned_job_cost(session, hog_tokens: int) -> dict:
    """Field report 1: a consumer stops after 5 tokens; with and without cancelling, time the next job."""
    greedy = SamplerSettings.greedy()
    probe = chatml("What is 2 plus 2?")
    outcome = {}
    for cancel in (False, True):
        stream = session.generate(chatml("Tell me a very long story."), max_new_tokens=hog_tokens,
                                  sampler=greedy, stop_at_eos=False, cancel_when_abandoned=cancel)
        for n, _ in enumerate(stream, 1):
            if n == 5:
                break
        del stream
        seconds, _ = timed(session, probe, max_new_tokens=50, sampler=greedy)
        outcome["next_job_s_" + ("cancelled" if cancel else "abandoned")] = seconds
        session.cancel_all()
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="auto")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--hog-tokens", type=int, default=1000, help="max_new_tokens of the abandoned job")
    args = parser.parse_args()

    session = get_session()
    status = session.load("smollm2-135m-instruct", engine=args.engine, progress=False)
    greedy = SamplerSettings.greedy()
    _, paris = timed(session, chatml("What is the capital of France?"), max_new_tokens=40, sampler=greedy)
    story = " ".join(f"Fact {i}: the number {i} follows {i - 1}." for i in range(1, 40))
    long_prompt = chatml(f"{story}\nWhich fact mentions the number 7?")
    _, first = timed(session, long_prompt, max_new_tokens=4, sampler=greedy)
    _, second = timed(session, long_prompt, max_new_tokens=4, sampler=greedy)
    decode = [
        timed(session, chatml("Tell me a very long story."), max_new_tokens=256, sampler=greedy, stop_at_eos=False)[1]
        for _ in range(3)
    ]
    summary = {
        "environment": environment(),
        "status": status.line(),
        "notes": list(status.notes),
        "paris": {"text": paris.text, "eos_reason": paris.eos_reason.value, "new_tokens": paris.new_tokens},
        "logits_relative_error_vs_transformers_fp32": logits_error(session),
        "prefix_reuse": {
            "prompt_tokens": first.prompt_tokens,
            "cached_tokens": [first.cached_tokens, second.cached_tokens],
            "ttft_s": [first.time_to_first_token_s, second.time_to_first_token_s],
        },
        "decode_tokens_per_s": [r.decode_tokens_per_s for r in decode],
        "abandoned_job": {"hog_max_new_tokens": args.hog_tokens, **abandoned_job_cost(session, args.hog_tokens)},
    }
    view = session.cache_view()
    summary["idle_cache"] = {"free_pages": view.free_pages, "total_pages": view.total_pages}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"acceptance-{status.engine}-{device_slug(summary['environment'])}-{datetime.date.today()}.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
