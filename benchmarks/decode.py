"""One timed generation: through the session, by hand over the engine's own generator, through the magic,
and by transformers. The suites repeat these; `harness.summarise` turns the samples into medians and spreads.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import torch

from benchmarks.harness import clock
from exlnb import SamplerSettings
from exlnb.engines.base import JobSpec
from exlnb.engines.job_options import JobOptions
from exlnb.session import Session

GREEDY = SamplerSettings.greedy()


def random_prompt(tokens: int, seed: int) -> list[int]:
    """Random ordinary tokens: no prefix in common with any other prompt, so nothing is served from cache."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(tokens)]


@dataclass(frozen=True)
class Run:
    """One generation as its consumer saw it: submit to first token, then the rate of the tokens after it."""

    prompt_tokens: int
    ttft_s: float
    decode_tokens_per_s: float  # nan for a one-token run

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.ttft_s


class TokenClock:
    """Counts tokens (not events: an event may carry several) as they reach the consumer."""

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.start = clock()
        self.first: float | None = None
        self.last = 0.0
        self.first_tokens = 0
        self.tokens = 0

    def arrived(self, tokens: int) -> None:
        if not tokens:
            return
        now = time.perf_counter()  # the tokens are on the host already: the device has finished them
        if self.first is None:
            self.first, self.first_tokens = now, tokens
        self.last = now
        self.tokens += tokens

    def run(self) -> Run:
        if self.first is None:
            raise RuntimeError("the job produced no token: nothing to time")
        later = self.tokens - self.first_tokens
        rate = later / (self.last - self.first) if later else math.nan
        return Run(self.prompt_tokens, self.first - self.start, rate)


def session_decode(session: Session, prompt: list[int], new_tokens: int, top_tokens: int = 0) -> Run:
    """Consume a stream as the widget does (iterate the JobStream's events) and time it on the consumer's side."""
    timer = TokenClock(len(prompt))
    stream = session.generate(
        prompt, max_new_tokens=new_tokens, sampler=GREEDY, stop_at_eos=False, top_tokens=top_tokens
    )
    for event in stream:
        timer.arrived(len(event.token_ids))
    return timer.run()


LIBRARY_ENGINES = ("exllamav2", "exllamav3")  # engines that wrap a library generator a user could drive by hand


def raw_decode(session: Session, prompt: list[int], new_tokens: int) -> Run:
    """The engine's own generator driven by hand on the engine thread, no session in between."""

    def drive(engine) -> Run:
        if engine.name in LIBRARY_ENGINES:
            return library_by_hand(engine.generator, library_job(engine.name, prompt, new_tokens), len(prompt))
        timer = TokenClock(len(prompt))
        engine.enqueue(JobSpec(tuple(prompt), max_new_tokens=new_tokens, sampler=GREEDY))
        while engine.has_work():
            for event in engine.step():
                timer.arrived(len(event.token_ids))
        return timer.run()

    return session.run_on_engine(drive)


def library_by_hand(generator, job, prompt_tokens: int) -> Run:
    """What a user writes without exlnb: enqueue a job, loop over `iterate()` (exllamav2 and exllamav3 alike)."""
    timer = TokenClock(prompt_tokens)
    generator.enqueue(job)
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result["stage"] == "streaming" and result.get("token_ids") is not None:
                timer.arrived(result["token_ids"].numel())
    return timer.run()


def library_aggregate(generator, library: str, prompts: list[list[int]], new_tokens: int) -> float:
    """Total new tokens per second of one library job per prompt, enqueued together and iterated to the end."""
    start = clock()
    for prompt in prompts:
        generator.enqueue(library_job(library, prompt, new_tokens))
    produced = 0
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result["stage"] == "streaming" and result.get("token_ids") is not None:
                produced += result["token_ids"].numel()
    return produced / (clock() - start)


def library_job(library: str, prompt: list[int], new_tokens: int):
    """A greedy job without stop conditions, in the library's own terms."""
    if library == "exllamav2":
        from exllamav2.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

        return ExLlamaV2DynamicJob(
            input_ids=torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            gen_settings=ExLlamaV2Sampler.Settings.greedy(),
            stop_conditions=[],
        )
    from exllamav3 import ArgmaxSampler, Job

    return Job(input_ids=torch.tensor([prompt]), max_new_tokens=new_tokens, sampler=ArgmaxSampler(), stop_conditions=[])


def exllamav3_peer_available(session: Session) -> bool:
    """exllamav3 is the peer of another engine on a CUDA machine where it is installed."""
    import importlib.util

    return (
        torch.cuda.is_available()
        and session.status().engine != "exllamav3"
        and bool(importlib.util.find_spec("exllamav3"))
    )


def load_exllamav3_peer(model_dir, cache_tokens: int = 8192):
    """exllamav3's own generator over the model, loaded as its README does it, outside exlnb (with the fixes
    without which exllamav3 1.6.5 cannot run a model whose sizes are not multiples of 128, exllamav3/compat.py)."""
    from exllamav3 import Cache, Config, Generator, Model, Tokenizer

    from exlnb.engines.exllamav3.compat import fix_exllamav3

    fix_exllamav3()

    config = Config.from_directory(str(model_dir))
    model = Model.from_config(config)
    cache = Cache(model, max_num_tokens=cache_tokens)  # built before load(): exllamav3 allocates it then
    model.load()
    return Generator(model=model, cache=cache, tokenizer=Tokenizer.from_config(config))


def load_exllamav2_peer(model_dir, cache_tokens: int = 8192):
    """exllamav2's own dynamic generator over the model, loaded as its examples do, outside exlnb. Paged only
    where flash-attn is installed (exllamav2 0.3.2 refuses paged mode without it), and on the matmul path
    (`no_sdpa`), as the ExLlamaV2 engine chooses on the GPU machine: there exllamav2's SDPA path gave wrong
    logits, and was slower (docs/gpu.md)."""
    import importlib.util
    from pathlib import Path

    from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
    from exllamav2.generator import ExLlamaV2DynamicGenerator

    from exlnb.engines.exllamav2.engine import _apply_rope_theta

    config = ExLlamaV2Config(str(model_dir))
    _apply_rope_theta(config, Path(model_dir))
    config.no_sdpa = True
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, max_seq_len=cache_tokens, lazy=True)
    model.load_autosplit(cache, progress=False)
    return ExLlamaV2DynamicGenerator(
        model=model,
        cache=cache,
        tokenizer=ExLlamaV2Tokenizer(config),
        paged=importlib.util.find_spec("flash_attn") is not None,
    )


def exllamav3_by_hand(generator, prompt: list[int], new_tokens: int) -> Run:
    return library_by_hand(generator, library_job("exllamav3", prompt, new_tokens), len(prompt))


def magic_ttft(session: Session, text: str) -> tuple[float, float]:
    """Seconds from running a `%%exl_generate` cell for one new token until its job is over, and the job's
    own time to first token (submit to first token, as the engine reports it).

    The first is an upper bound on the magic's time to first token: it includes parsing the cell and showing
    the output. The magic runs in an IPython shell on the same (kernel-resident) session as everything else
    here, with the raw template and the prompt passed through a variable: the cell body is formatted with
    the user namespace, and random prompt text may hold braces.
    """
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.extension_manager.load_extension("exlnb")
    shell.user_ns["benchmark_prompt"] = text
    start = clock()
    shell.run_cell_magic(
        "exl_generate", "--max-new-tokens 1 --template raw --out benchmark_result", "{benchmark_prompt}"
    )
    while session.jobs():  # a magic that streams in the background returns before its job ends
        time.sleep(0.0005)
    return clock() - start, shell.user_ns["benchmark_result"].time_to_first_token_s


def load_hf_peer(model_dir):
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float16 if cuda else torch.float32)
    return model.to("cuda" if cuda else "cpu").eval()


@torch.inference_mode()
def hf_decode(model, prompt: list[int], new_tokens: int) -> float:
    """transformers `generate`, greedy, batch 1: decode tokens/s from a full run minus a one-token run."""
    ids = torch.tensor([prompt], device=model.device)
    options = dict(do_sample=False, pad_token_id=0)
    start = clock()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **options)
    first = clock() - start
    start = clock()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **options)
    total = clock() - start
    return (new_tokens - 1) / (total - first)


@torch.inference_mode()
def hf_prefill(model, prompt: list[int]) -> float:
    ids = torch.tensor([prompt], device=model.device)
    start = clock()
    model(ids, logits_to_keep=1)
    return len(prompt) / (clock() - start)


def aggregate_throughput(session: Session, concurrency: int, new_tokens: int, seed: int) -> float:
    """Total new tokens per second of `concurrency` jobs submitted together."""
    return session_aggregate(session, [random_prompt(64, seed * 100 + i) for i in range(concurrency)], new_tokens)


def session_aggregate(session: Session, prompts: list[list[int]], new_tokens: int) -> float:
    """Total new tokens per second of one job per prompt, submitted together, from submit to the last one's end."""
    return session_together(session, prompts, new_tokens)["tokens_per_s"]


def session_together(session: Session, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """One job per prompt, submitted together: the total new tokens per second from submit to the last one's end
    (`tokens_per_s`), the slowest job's first token (`first_token_ms`: admission and prefill, the ramp) and the new
    tokens after each job's first over the time after the slowest one's (`decode_tokens_per_s`: the decode that
    follows the ramp; a job that started early counts a few of its tokens in it)."""
    start = clock()
    streams = session.submit_together(
        [session.spec_for(p, JobOptions(max_new_tokens=new_tokens, sampler=GREEDY, stop_at_eos=False)) for p in prompts]
    )
    results = [s.result() for s in streams]
    seconds = clock() - start
    first = max(r.time_to_first_token_s or 0.0 for r in results)
    after = sum(max(r.new_tokens - 1, 0) for r in results)
    return {
        "tokens_per_s": sum(r.new_tokens for r in results) / seconds,
        "first_token_ms": 1000 * first,
        "decode_tokens_per_s": after / (seconds - first),
    }
