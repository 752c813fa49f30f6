"""Decode and prefill measurements of one engine: through the session, by hand, and by transformers.

Each function returns raw samples; `harness.summarise` turns them into medians and spreads.
"""

from __future__ import annotations

import random
import time

import torch

from benchmarks.harness import clock, sync
from exlnb import SamplerSettings
from exlnb.engines.base import JobSpec
from exlnb.session import Session

GREEDY = SamplerSettings.greedy()


def random_prompt(session: Session, tokens: int, seed: int) -> list[int]:
    """Random ordinary tokens: no prefix in common with any other prompt, so nothing is served from cache."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(tokens)]


def session_decode(session: Session, prompt: list[int], new_tokens: int) -> dict:
    """Consume a stream as the widget does; time every token on the consumer's side."""
    start = clock()
    arrivals = []
    for event in session.generate(prompt, max_new_tokens=new_tokens, sampler=GREEDY, stop_at_eos=False):
        if event.token_ids:
            arrivals.append(time.perf_counter())
    return {
        "ttft_s": arrivals[0] - start,
        "decode_tokens_per_s": (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]),
    }


def raw_decode(session: Session, prompt: list[int], new_tokens: int) -> dict:
    """The engine's own generator driven by hand on the engine thread, no session in between."""

    def drive(engine) -> dict:
        if engine.name == "exllamav2":
            return _exllamav2_by_hand(engine, prompt, new_tokens)
        start = clock()
        engine.enqueue(JobSpec(tuple(prompt), max_new_tokens=new_tokens, sampler=GREEDY))
        arrivals = []
        while engine.has_work():
            for event in engine.step():
                if event.token_ids:
                    arrivals.append(time.perf_counter())
        return {
            "ttft_s": arrivals[0] - start,
            "decode_tokens_per_s": (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]),
        }

    return session.run_on_engine(drive)


def _exllamav2_by_hand(engine, prompt: list[int], new_tokens: int) -> dict:
    from exllamav2.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

    generator = engine.generator
    start = clock()
    generator.enqueue(
        ExLlamaV2DynamicJob(
            input_ids=torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            gen_settings=ExLlamaV2Sampler.Settings.greedy(),
            stop_conditions=[],
        )
    )
    arrivals = []
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result["stage"] == "streaming" and result.get("token_ids") is not None:
                sync()
                arrivals.append(time.perf_counter())
    return {
        "ttft_s": arrivals[0] - start,
        "decode_tokens_per_s": (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]),
    }


def engine_prefill(session: Session, prompt: list[int]) -> float:
    """Prompt tokens per second from submit to first token, for a prompt nothing is cached for."""
    start = clock()
    result = session.complete(prompt, max_new_tokens=1, sampler=GREEDY, stop_at_eos=False)
    return len(prompt) / (time.perf_counter() - start) if result.new_tokens else float("nan")


def load_hf_peer(model_dir):
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float16 if cuda else torch.float32)
    return model.to("cuda" if cuda else "cpu").eval()


@torch.inference_mode()
def hf_decode(model, prompt: list[int], new_tokens: int) -> dict:
    """transformers `generate`, greedy, batch 1: decode rate from a full run minus a one-token run."""
    ids = torch.tensor([prompt], device=model.device)
    options = dict(do_sample=False, min_new_tokens=new_tokens, pad_token_id=0)
    start = clock()
    model.generate(ids, max_new_tokens=1, **{**options, "min_new_tokens": 1})
    first = clock() - start
    start = clock()
    model.generate(ids, max_new_tokens=new_tokens, **options)
    total = clock() - start
    return {"ttft_s": first, "decode_tokens_per_s": (new_tokens - 1) / (total - first)}


@torch.inference_mode()
def hf_prefill(model, prompt: list[int]) -> float:
    ids = torch.tensor([prompt], device=model.device)
    start = clock()
    model(ids, logits_to_keep=1)
    return len(prompt) / (clock() - start)


def aggregate_throughput(session: Session, concurrency: int, new_tokens: int, seed: int) -> float:
    """Total new tokens per second of `concurrency` jobs submitted together."""
    prompts = [random_prompt(session, 64, seed * 100 + i) for i in range(concurrency)]
    start = clock()
    streams = [session.generate(p, max_new_tokens=new_tokens, sampler=GREEDY, stop_at_eos=False) for p in prompts]
    produced = sum(s.result().new_tokens for s in streams)
    return produced / (clock() - start)
