"""What the speed suite times: each setup loaded and driven (exlnb's engines through the session, the libraries'
own generators, transformers `generate` with a static cache), the measurements taken of it, a model's floor, and
one decode token's kernels by kind. `benchmarks.speed` runs them as parts and keeps the record.
"""

from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing
import os
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import decode
from benchmarks.harness import clock, summarise
from exlnb.engines.base import one_line
from exlnb.session import Session

CACHE_TOKENS = 4608  # 18 pages of 256: a 4,096-token context, or 8 jobs of 256 + 128, in every setup alike
BATCH = 8
BATCHED = f"batch{BATCH}_tokens_per_s"


# -- a model's floor --------------------------------------------------------------------------------------------


def weight_bytes_read_per_token(folder: Path) -> int:
    """Every tensor of the folder's safetensors files, read from their headers, except the embedding where an
    output head of its own exists (decode reads one embedding row, and a tied embedding is the head)."""
    sizes = {}
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        header.pop("__metadata__", None)
        sizes |= {name: tensor["data_offsets"][1] - tensor["data_offsets"][0] for name, tensor in header.items()}
    untied = any(name.startswith("lm_head.") for name in sizes)
    return sum(size for name, size in sizes.items() if not (untied and name.startswith("model.embed_tokens.")))


def copy_bandwidth() -> float:
    """Bytes/s of a large copy on the device, read and written counted (docs/gpu.md's convention)."""
    if torch.cuda.is_available():
        from benchmarks.hardware import copy_bandwidth as device_copy

        return device_copy()
    src = torch.empty(2**28, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = clock()
    for _ in range(5):
        dst.copy_(src)
    return 2 * src.numel() * 5 / (clock() - start)


# -- the setups -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timed:
    """One loaded setup: a batch-1 generation as its consumer sees it, and the aggregate of several together."""

    generate: Callable[[list[int], int], decode.Run]  # a prompt and its new tokens -> the run
    # prompts submitted together -> {"tokens_per_s": aggregate new tokens/s, and where the setup can tell,
    # "first_token_ms" and "decode_tokens_per_s": the ramp and the decode after it}
    together: Callable[[list[list[int]], int], dict[str, float]]
    status: str = ""


def free_memory() -> None:
    """What a setup held, given back before the next one loads into the same process."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _switched(variable: str, on: str, off: str) -> dict[str, tuple[str, dict[str, str]]]:
    """Both GPU engines with `variable` set to 1 (the runner named `kit-ENGINE-ON`) and to 0 (`kit-ENGINE-OFF`)."""
    return {
        f"kit-{engine}-{side}": (engine, {variable: value})
        for engine in ("exllamav2", "exllamav3")
        for side, value in ((on, "1"), (off, "0"))
    }


# exlnb's engines loaded with a switch set, timed in turns beside each other: runner -> (engine, the environment it
# loads and runs in). A switch's A/B names both sides ("-fused", "-unfused"): a setup's record belongs to one part,
# and the goals' own setups ("kit-exllamav3") keep the numbers of the turns they took with their peers.
KIT_VARIANTS = {
    "kit-exllamav3-ahead-off": ("exllamav3", {"EXLNB_QUEUE_AHEAD": "0"}),
    "kit-exllamav2-ahead-on": ("exllamav2", {"EXLNB_QUEUE_AHEAD": "1"}),
    "kit-exllamav2-ahead-off": ("exllamav2", {"EXLNB_QUEUE_AHEAD": "0"}),
    # the ExLlamaV2 engine's MLP and attention tails, each alone, both and neither, no norm folded (mlp_tail.py,
    # attention_tail.py)
    **{
        f"kit-exllamav2-{name}": (
            "exllamav2",
            {"EXLNB_MLP_TAIL": mlp, "EXLNB_ATTENTION_TAIL": attention, "EXLNB_NORM_IN_PRODUCT": "0"},
        )
        for name, (mlp, attention) in {
            "mlp-tail": ("1", "0"),
            "attention-tail": ("0", "1"),
            "tails": ("1", "1"),
            "tails-apart": ("0", "0"),
        }.items()
    },
    # with both tails, each norm folded into the group after it (folded_norm.py): the attention's alone (its default),
    # both and none; both with the activation's kernel in its former shape, 4 rows of gate and 4 of up a program in
    # tiles of 512 inputs (normed_gemv.py), against the sweep's fastest it takes now; and both with every kernel of a
    # layer exlnb's, launched dependent on the one before (dependent_launch.py)
    **{
        f"kit-exllamav2-fold-{name}": ("exllamav2", {"EXLNB_NORM_IN_PRODUCT": folds, **tiles})
        for name, (folds, tiles) in {
            "attention": ("attention", {}),
            "both": ("1", {}),
            "none": ("0", {}),
            "both-g4k512": ("1", {"EXLNB_GATED_TILES": "4,512,4,4"}),
            "both-dependent": ("1", {"EXLNB_DEPENDENT_LAUNCH": "1"}),
        }.items()
    },
    "kit-exllamav3-before-wait": ("exllamav3", {"EXLNB_QUEUE_BEFORE_WAIT": "1"}),
    "kit-exllamav3-after-wait": ("exllamav3", {"EXLNB_QUEUE_BEFORE_WAIT": "0"}),
    **_switched("EXLNB_PREFILL_TOGETHER", "prefill-together", "prefill-apart"),
    **_switched("EXLNB_TOKEN_FEED", "feed-on", "feed-off"),
    # both engines' decode attention with 512 keys a split and with 256, its default (triton_decode.py)
    **{
        f"kit-{engine}-split{keys}": (engine, {"EXLNB_DECODE_SPLIT_KEYS": str(keys)})
        for engine in ("exllamav2", "exllamav3")
        for keys in (512, 256)
    },
    # both engines' decode attention with 8 warps a program (its default) and with 4 (triton_decode.py)
    **{
        f"kit-{engine}-warps{warps}": (engine, {"EXLNB_DECODE_SPLIT_WARPS": str(warps)})
        for engine in ("exllamav2", "exllamav3")
        for warps in (8, 4)
    },
    **_switched("EXLNB_FUSED_PRODUCTS", "fused", "unfused"),
    # both engines' decode attention with the call's new keys in tiles of their own (its default), and in every tile
    **_switched("EXLNB_DECODE_FRESH_APART", "fresh-apart", "fresh-inline"),
    # both engines with exlnb's kernels launched dependent on the one before (dependent_launch.py), and apart
    **_switched("EXLNB_DEPENDENT_LAUNCH", "dependent", "independent"),
}


@contextlib.contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    """`variables` set while the block runs, then as they were."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def setup(runner: str, folder: Path) -> Iterator[Timed]:
    if runner.startswith("kit-"):
        session = Session()
        engine, variables = KIT_VARIANTS.get(runner, (runner.removeprefix("kit-"), {}))
        # held while it runs too, in its own process (setup_apart): a switch read after the load sees it as well
        with _environment(variables):
            status = session.load(str(folder), engine=engine, cache_tokens=CACHE_TOKENS, progress=False)
            try:
                yield Timed(
                    lambda p, n: decode.session_decode(session, p, n),
                    lambda ps, n: decode.session_together(session, ps, n),
                    # with its notes: an engine that fell back to eager decode says why (every EXL3 capture once
                    # failed, and the record showed only "decode: eager")
                    " | ".join([status.line(), *status.notes]),
                )
            finally:
                session.unload()
    elif runner.startswith("raw-"):
        library = runner.removeprefix("raw-")
        load = decode.load_exllamav2_peer if library == "exllamav2" else decode.load_exllamav3_peer
        generator = load(folder, CACHE_TOKENS)
        try:
            yield Timed(
                lambda p, n: decode.library_by_hand(generator, decode.library_job(library, p, n), len(p)),
                lambda ps, n: {"tokens_per_s": decode.library_aggregate(generator, library, ps, n)},
            )
        finally:
            if library == "exllamav3":
                generator.close()
            generator.model.unload()
            del generator
    else:
        model = decode.load_hf_peer(folder)
        try:
            yield Timed(
                lambda p, n: hf_static_generate(model, [p], n)[0], lambda ps, n: hf_static_generate(model, ps, n)[1]
            )
        finally:
            del model


@contextlib.contextmanager
def setup_apart(runner: str, folder: Path) -> Iterator[Timed]:
    """`setup` in a process of its own, driven from this one, so that setups timed in turns share no allocator,
    CUDA graph pool or compiled state (exlnb's engines with CUDA graphs beside transformers' compiled static cache
    in one process ended in an illegal memory access on an H100, 2026-11-28; users run them apart too). Each run
    is timed inside its worker, as its consumer sees it; the pipe's cost is outside every number."""
    spawn = multiprocessing.get_context("spawn")
    here, there = spawn.Pipe()
    worker = spawn.Process(target=_serve, args=(runner, folder, there), name=f"speed-{runner}", daemon=True)
    worker.start()
    there.close()

    def ask(*request):
        here.send(request)
        return _answer(here, worker, runner)

    try:
        status = _answer(here, worker, runner)  # the worker's first word: its status line once loaded
        yield Timed(lambda p, n: ask("generate", p, n), lambda ps, n: ask("together", ps, n), status)
    finally:
        with contextlib.suppress(OSError):
            here.send(None)
        worker.join(timeout=120)
        if worker.is_alive():
            worker.kill()
            worker.join()


def _answer(conn, worker, runner: str):
    """The worker's reply, or its error raised here; a worker that died says so with its exit code."""
    while not conn.poll(0.5):
        if not worker.is_alive():
            raise RuntimeError(f"the process timing {runner} ended without answering (exit code {worker.exitcode})")
    ok, value = conn.recv()
    if not ok:
        raise RuntimeError(f"{runner}: {value}")
    return value


def _serve(runner: str, folder: Path, conn) -> None:
    """A worker's life: load the setup, say its status, then run each request until told to stop (None)."""
    try:
        with setup(runner, folder) as timed:
            conn.send((True, timed.status))
            while (request := conn.recv()) is not None:
                name, *args = request
                try:
                    conn.send((True, (timed.generate if name == "generate" else timed.together)(*args)))
                except Exception as error:  # the driver records it as the setup's failure
                    conn.send((False, one_line(error)))
    except Exception as error:
        conn.send((False, one_line(error)))


@torch.inference_mode()
def hf_static_generate(model, prompts: list[list[int]], new_tokens: int) -> tuple[decode.Run, dict[str, float]]:
    """transformers `generate` with a static cache (compiled by `generate`), greedy: the first sequence's run as
    its consumer sees it, and `Timed.together`'s numbers for all of them, from the call to its return."""
    from benchmarks.graphs import _TokenTimes

    times = _TokenTimes()
    start = clock()
    model.generate(
        torch.tensor(prompts, device=model.device),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        streamer=times,
        cache_implementation="static",
    )
    seconds = clock() - start
    steps = times.times[1:]  # times[0]: the prompt, handed over before the first step
    rate = (len(steps) - 1) / (steps[-1] - steps[0]) if len(steps) > 1 else float("nan")
    first = steps[0] - start
    together = {
        "tokens_per_s": len(prompts) * new_tokens / seconds,
        "first_token_ms": 1000 * first,
        "decode_tokens_per_s": len(prompts) * (new_tokens - 1) / (seconds - first),
    }
    return decode.Run(len(prompts[0]), first, rate), together


def measure(timed: dict[str, Timed], p: dict, contexts: dict[str, list[int]]) -> dict[str, dict]:
    """Warm-ups then repeats of each measurement, the setups in turns: every round gives each setup the same
    fresh random prompt (nothing is served from a cache), in an order that reverses from round to round, so that
    whatever else the machine does slows them alike. A context of C tokens decodes from C - new_tokens to C; the 8
    jobs decode at the shortest context. Per setup: medians, each sample with its spread, and for each context
    the slowest repeat over the fastest."""
    n, rounds = p["new_tokens"], p["warmup"] + p["repeats"]

    def ms_per_token(context: int) -> Callable[[Timed, int], float]:
        return lambda t, seed: 1000 / t.generate(decode.random_prompt(context - n, seed), n).decode_tokens_per_s

    def batched(t: Timed, seed: int) -> dict[str, float]:
        shortest = min(c for cs in contexts.values() for c in cs)
        together = t.together([decode.random_prompt(shortest - n, 1000 * seed + i) for i in range(BATCH)], n)
        return {f"batch{BATCH}_{name}": value for name, value in together.items()}  # tokens_per_s: BATCHED

    def ttft_ms(t: Timed, seed: int) -> float:
        return 1000 * t.generate(decode.random_prompt(p["ttft_prompt"], seed), 1).ttft_s

    measurements = [
        (f"ms_per_token_{c}", ms_per_token(c), [r for r in timed if c in contexts[r]])
        for c in sorted({c for cs in contexts.values() for c in cs})
    ]
    measurements += [(BATCHED, batched, list(timed)), (f"ttft_{p['ttft_prompt']}_ms", ttft_ms, list(timed))]
    samples: dict[str, dict[str, list[float]]] = {runner: {} for runner in timed}
    seeds = iter(range(1, 10**6))
    for name, sample, runners in measurements:
        for round_ in range(rounds):
            seed = next(seeds)
            for runner in runners if round_ % 2 == 0 else runners[::-1]:
                value = sample(timed[runner], seed)  # a number, or several named ones from the same run
                for metric, number in value.items() if isinstance(value, dict) else [(name, value)]:
                    samples[runner].setdefault(metric, []).append(number)
    return {runner: _summary(runs, p["warmup"], timed[runner].status) for runner, runs in samples.items()}


def _summary(runs: dict[str, list[float]], warmup: int, status: str) -> dict:
    kept = {name: values[warmup:] for name, values in runs.items()}
    metrics = {name: statistics.median(values) for name, values in kept.items()}
    for name in [m for m in metrics if m.startswith("ms_per_token_")]:
        context = name.removeprefix("ms_per_token_")
        metrics[f"tokens_per_s_{context}"] = 1000 / metrics[name]
        metrics[f"{name}_spread"] = max(kept[name]) / min(kept[name])  # the slowest repeat over the fastest
    return {"metrics": metrics, "samples": {name: summarise(values) for name, values in kept.items()}, "status": status}


# -- the kernels of one token (--profile) ---------------------------------------------------------------------

KERNEL_KINDS = (  # the first kind whose words a kernel's name holds; checked in this order
    ("attention", ("attn", "attention", "flash", "fmha", "sdpa", "softmax")),
    ("norms and RoPE", ("norm", "rope", "rotary")),
    ("sampling", ("argmax", "sampl", "topk", "sort", "multinomial", "cumsum")),
    (
        "GEMV/GEMM",
        ("gemm", "gemv", "matmul", "cutlass", "cublas", "xmma", "nvjet", "trellis", "q4", "splitk", "row_times_matrix"),
    ),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, words in KERNEL_KINDS if any(w in lowered for w in words)), "other")


def kernels_by_kind(prof, wall_s: float, steps: int) -> dict:
    """Kernel time per step by kind, and the host gaps: the step's wall time in which no kernel ran."""
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_kind: dict[str, float] = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
    for event in kernels:
        by_kind[kernel_kind(event.name)] += event.device_time / 1000 / steps
    busy_us, reach = 0.0, float("-inf")
    for begin, end in sorted((e.time_range.start, e.time_range.end) for e in kernels):
        busy_us += max(0.0, end - max(begin, reach))
        reach = max(reach, end)
    busy_ms = busy_us / 1000 / steps
    return {
        "kernel_ms_per_step_by_kind": by_kind,
        "gpu_busy_ms_per_step": busy_ms,
        "host_gap_ms_per_step": 1000 * wall_s / steps - busy_ms,
    }


# each engine's step profiled as it ships (the ExLlamaV2 engine's with both tails and the attention's norm folded, its
# defaults), and the ExLlamaV2 engine's with the MLP's norm folded too (whose launches it counts):
# runner -> (engine, the environment it loads and runs in)
PROFILED = {
    "profile-exllamav2": ("exllamav2", {}),
    "profile-exllamav3": ("exllamav3", {}),
    "profile-exllamav2-fold-both": KIT_VARIANTS["kit-exllamav2-fold-both"],
}


def profile(runner: str, folder: Path) -> dict:
    from benchmarks.profile_decode import profile_steps

    engine, variables = PROFILED[runner]
    with _environment(variables):
        session = Session()
        session.load(str(folder), engine=engine, cache_tokens=CACHE_TOKENS, progress=False)
        try:
            # the clock first: the profiler's hooks outlive it in the process (a clocked EXL3 step read 2.63 ms after
            # a profile, 2026-11-28, where the same step timed alone took 2.23)
            clocked = {"step_clock": clocked_steps(session), "step_clock_batch8": clocked_steps(session, batch=8)}
            metrics = profile_steps(session, tokens=8, extra=kernels_by_kind)
            # and 8 jobs' steps, where each group's product is cuBLAS's and the layouts part (folded_norm.py)
            metrics["batch8"] = profile_steps(session, tokens=8, batch=8, extra=kernels_by_kind)
            metrics.update({name: value for name, value in clocked.items() if value is not None})
            return {"metrics": metrics}
        finally:
            session.unload()
            free_memory()


CLOCKED_TOKENS = 128  # decode steps the step clock times, after a 256-token prompt


def clocked_steps(session: Session, batch: int = 1) -> dict | None:
    """Where a decode step's time goes without the profiler's overhead (exlnb/engines/step_clock.py), over one
    greedy job as the speed parts time it, or `batch` jobs submitted together as the batch-8 figure times them;
    None where the engine decodes without graphs (both graph decoders keep a clock)."""
    from exlnb.engines.step_clock import StepClock

    def start(engine) -> bool:
        decoder = getattr(engine, "graphs", None)
        if decoder is None:
            return False
        decoder.clock = StepClock()
        return True

    if not session.run_on_engine(start):
        return None
    try:
        if batch == 1:
            decode.session_decode(session, list(range(1000, 1256)), CLOCKED_TOKENS)
        else:
            decode.aggregate_throughput(session, batch, CLOCKED_TOKENS, seed=0)
        return session.run_on_engine(lambda engine: engine.graphs.clock.account())
    finally:
        session.run_on_engine(lambda engine: setattr(engine.graphs, "clock", None))
