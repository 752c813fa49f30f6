"""What a load test sends and when: the settings, checked where the user enters them, and the seeded plan.

Arrivals follow vLLM's `benchmark_serving`: the first request at time 0, then gaps drawn from a gamma
distribution with shape = burstiness and scale = 1 / (rate * burstiness), so the mean rate is `rate` whatever
the burstiness; burstiness 1 is a Poisson process, below 1 burstier, above 1 more even. A rate of `inf`
sends every request at once. Nothing here touches the session, so a plan can be inspected before it runs.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from exlnb.datasets import DATA_DIR, load_prompts
from exlnb.engines.base import Tokenizer
from exlnb.engines.checks import check_seed
from exlnb.metrics import check_slos
from exlnb.templates import conversation, render

MAX_REQUESTS = 10_000  # per rate: a notebook cell, not a soak test; also the cap of a run given a duration
# the longest a rate may take to send its requests: a rate of 1e-6 req/s was once accepted, and would have
# waited about 10^6 s for its 16 requests
MAX_SEND_S = 3600.0
DEFAULT_REQUESTS = 16
# Random prompt tokens come from ids below 32000, the smallest vocabulary the engines load (Llama 2), and
# from 100 up, past the special tokens. Random tokens share no prefix, so no prompt is served from cache.
RANDOM_TOKEN_IDS = (100, 32000)

Length = int | tuple[int, int]


@dataclass(frozen=True)
class Workload:
    """A load test's settings; invalid values fail here, one line each, before anything is sent."""

    request_rates: tuple[float, ...] = (math.inf,)  # requests per second; several rates are run one by one
    burstiness: float = 1.0
    max_concurrency: int | None = None  # requests in flight at most; None: as many as have arrived
    prompt_len: Length = 128  # tokens, or a (low, high) range sampled per request
    output_len: Length = 32  # exact: submitted with stop_at_eos=False, like vLLM's --ignore-eos
    dataset: str | None = None  # prompts from data/prompts/<dataset>.json instead of random tokens
    num_requests: int | None = None  # per rate; DEFAULT_REQUESTS unless duration_s is given
    duration_s: float | None = None  # send for this long instead of a number of requests
    seed: int = 0
    slos: Mapping[str, float] | None = None  # goodput objectives in ms, e.g. {"ttft_ms": 500, "tpot_ms": 50}

    def __post_init__(self) -> None:
        if not self.request_rates:
            raise ValueError("request_rate is empty: give a rate in requests per second, or inf for all at once")
        for rate in self.request_rates:
            if not rate > 0:
                raise ValueError(f"request_rate={rate!r} must be > 0 requests per second (inf sends all at once)")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness={self.burstiness!r} must be a positive number (1 is a Poisson process)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency={self.max_concurrency} must be >= 1, or None for no limit")
        _check_length("prompt_len", self.prompt_len)
        _check_length("output_len", self.output_len)
        if self.num_requests is not None and self.duration_s is not None:
            raise ValueError("give num_requests or duration_s, not both")
        if self.num_requests is not None and not 1 <= self.num_requests <= MAX_REQUESTS:
            raise ValueError(f"num_requests={self.num_requests} must be between 1 and {MAX_REQUESTS}")
        if self.duration_s is not None:
            if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
                raise ValueError(f"duration_s={self.duration_s!r} must be a positive number of seconds")
            if self.duration_s > MAX_SEND_S:
                raise ValueError(
                    f"duration_s={self.duration_s:g} is longer than a rate may send for "
                    f"({_in_words(MAX_SEND_S)}): give at most {MAX_SEND_S:g} seconds"
                )
            if math.inf in self.request_rates and self.max_concurrency is None:
                raise ValueError(
                    "duration_s with request_rate=inf would send every request at once: set max_concurrency "
                    "to keep that many in flight for the duration, or give a finite rate"
                )
        if self.duration_s is None:
            for rate in self.request_rates:
                sending_s = (self.requests_per_rate - 1) / rate  # the mean of the last arrival
                if sending_s > MAX_SEND_S:
                    raise ValueError(
                        f"request_rate={rate:g} would take about {_in_words(sending_s)} to send "
                        f"{self.requests_per_rate} requests, and a rate may take at most {_in_words(MAX_SEND_S)}: "
                        "raise the rate, send fewer requests, or give duration_s"
                    )
        check_seed(self.seed, why=" (the same seed sends the same requests at the same times)")
        if self.slos:
            check_slos(self.slos)
        if self.dataset is not None and self.dataset not in prompt_sets():
            raise ValueError(
                f"dataset={self.dataset!r}: no data/prompts/{self.dataset}.json; choose from {', '.join(prompt_sets())}"
            )

    @property
    def requests_per_rate(self) -> int:
        """Requests planned per rate; with a duration, the cap (those arriving after it are never sent)."""
        if self.duration_s is not None:
            return MAX_REQUESTS
        return self.num_requests or DEFAULT_REQUESTS

    def as_dict(self) -> dict:
        return {
            "request_rates": [rate_label(rate) for rate in self.request_rates],
            "burstiness": self.burstiness,
            "max_concurrency": self.max_concurrency,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "dataset": self.dataset,
            "num_requests": None if self.duration_s is not None else self.requests_per_rate,
            "duration_s": self.duration_s,
            "seed": self.seed,
            "slos": dict(self.slos) if self.slos else None,
        }


def _in_words(seconds: float) -> str:
    """'45 s', '20 minutes', '3 hours', '185 days': a duration as a person reads it."""
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            amount = f"{seconds / size:.3g}"
            return f"{amount} {unit}" if amount == "1" else f"{amount} {unit}s"
    return f"{seconds:.3g} s"


def rate_label(request_rate: float) -> str:
    """How tables, figures and JSON name a rate: "4", "0.5", "inf"."""
    return "inf" if math.isinf(request_rate) else f"{request_rate:g}"


@dataclass(frozen=True)
class PlannedRequest:
    """One request of a plan: when it arrives (seconds after the run starts) and what it asks for."""

    index: int
    arrival_s: float
    prompt_ids: tuple[int, ...]
    output_tokens: int


def plan_requests(
    workload: Workload, request_rate: float, tokenizer: Tokenizer, cache_tokens: int
) -> list[PlannedRequest]:
    """The requests of one rate. The same seed gives the same prompts and lengths at every rate, so a sweep
    varies the rate alone; a request that could never fit the cache fails the whole plan at once."""
    count = workload.requests_per_rate
    rng = np.random.default_rng(workload.seed)
    outputs = _lengths(rng, workload.output_len, count)
    prompts = _prompts(rng, workload, tokenizer, count)
    arrivals = arrival_times(np.random.default_rng([workload.seed, 1]), request_rate, workload.burstiness, count)
    longest = max(len(p) + n for p, n in zip(prompts, outputs))
    if longest > cache_tokens:
        raise ValueError(
            f"a request needs {longest} tokens (prompt + output) but the cache holds {cache_tokens}: "
            "shorten prompt_len or output_len, or load with a larger cache_tokens"
        )
    return [
        PlannedRequest(i, float(t), tuple(p), int(n)) for i, (t, p, n) in enumerate(zip(arrivals, prompts, outputs))
    ]


def arrival_times(rng: np.random.Generator, request_rate: float, burstiness: float, count: int) -> np.ndarray:
    """Seconds after the start: 0, then cumulative gamma-distributed gaps (all 0 for an infinite rate)."""
    if math.isinf(request_rate):
        return np.zeros(count)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=count - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def prompt_sets() -> list[str]:
    """The names `dataset` accepts: the prompt files in the checkout's data/prompts/."""
    return sorted(path.stem for path in (DATA_DIR / "prompts").glob("*.json"))


def _prompts(rng: np.random.Generator, workload: Workload, tokenizer: Tokenizer, count: int) -> list[list[int]]:
    if workload.dataset is None:
        lengths = _lengths(rng, workload.prompt_len, count)
        return [rng.integers(*RANDOM_TOKEN_IDS, size=n).tolist() for n in lengths]
    texts = load_prompts(workload.dataset)
    chosen = rng.choice(len(texts), size=count, replace=count > len(texts))
    return [tokenizer.encode(_as_turn(texts[i], tokenizer), special=True) for i in chosen]


def _as_turn(text: str, tokenizer: Tokenizer) -> str:
    """A data set's prompt as a user turn in the model's own format, where it has one."""
    return render("auto", conversation(text, system=None), tokenizer) if tokenizer.chat_template else text


def _lengths(rng: np.random.Generator, length: Length, count: int) -> np.ndarray:
    if isinstance(length, int):
        return np.full(count, length)
    low, high = length
    return rng.integers(low, high + 1, size=count)


def _check_length(name: str, length: Length) -> None:
    if isinstance(length, int):
        if length < 1:
            raise ValueError(f"{name}={length} must be >= 1 token")
        return
    if not (isinstance(length, Sequence) and len(length) == 2 and all(isinstance(v, int) for v in length)):
        raise ValueError(f"{name}={length!r}: give a number of tokens or a (low, high) range of them")
    low, high = length
    if not 1 <= low <= high:
        raise ValueError(f"{name}={tuple(length)}: a range needs 1 <= low <= high")


# -- the settings as command lines write them (%exl_bench and benchmarks/serving.py) ------------------------


def rates_argument(text: str) -> list[float]:
    """'1,2,4,inf' -> [1.0, 2.0, 4.0, inf] requests per second."""
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give requests per second separated by commas, e.g. 1,2,inf"
        ) from None


def length_argument(text: str) -> Length:
    """'128' -> 128 tokens; '64-256' -> the range (64, 256)."""
    try:
        low, _, high = text.partition("-")
        return (int(low), int(high)) if high else int(low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of tokens, or a range such as 64-256") from None


def slo_argument(text: str) -> tuple[str, float]:
    """'ttft_ms=500' -> ("ttft_ms", 500.0); the name is checked with the other settings."""
    name, _, value = text.partition("=")
    try:
        return name.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give an objective as NAME=MILLISECONDS, e.g. ttft_ms=500"
        ) from None
