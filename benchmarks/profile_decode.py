"""Where a decode step spends its time, by the torch profiler: on the GPU, kernels against the host issuing
them; on the CPU, which operators.

    python -m benchmarks profile-decode [--model 7b|bundled] [--engine auto|exllamav2|cpu] [--batch N]

Writes, per step (one token of each job): wall time, the busiest operators (and on the GPU: kernel time, kernel
launches, and the fraction of the wall time the GPU was busy). If kernel time is far below wall time, the step is
bound by launching kernels from Python, not by the GPU. Wall times under the profiler are inflated by the profiler.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch

from benchmarks import decode
from benchmarks.harness import environment, new_result_path, sync, write_json
from exlnb.engines.base import JobSpec
from exlnb.engines.options import ENGINE_NAMES
from exlnb.models import BUNDLED_MODEL
from exlnb.random_model import seven_b_shaped
from exlnb.session import Session


def profile_steps(session: Session, tokens: int, batch: int = 1, *, extra=None) -> dict:
    """Profile `tokens` decode steps of `batch` jobs, after their prefill and a few warm-up steps; `extra(prof,
    wall_s, steps)` adds its own summary of the same profile (the speed suite's kernel kinds)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]

    def run(engine) -> dict:
        step, clear = _decoding_jobs(engine, batch, tokens + 20)
        for _ in range(10):  # prefill and warm-up steps
            step()
        sync()
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(tokens):
                step()
            sync()
            wall = time.perf_counter() - start
        clear()
        summary = {"engine": engine.name, "batch": batch, "steps": tokens, "wall_ms_per_step": 1000 * wall / tokens}
        summary |= _gpu_summary(prof, wall, tokens) if cuda else _cpu_summary(prof, wall, tokens)
        return summary | (extra(prof, wall, tokens) if extra else {})

    return session.run_on_engine(run)


def _decoding_jobs(engine, batch: int, new_tokens: int):
    """Start `batch` greedy jobs on the engine; returns (one step, drop the jobs)."""
    prompts = [decode.random_prompt(32, seed) for seed in range(batch)]
    if engine.name in decode.LIBRARY_ENGINES:
        generator = engine.generator
        for prompt in prompts:
            generator.enqueue(decode.library_job(engine.name, prompt, new_tokens))
        return generator.iterate, generator.clear_queue
    ids = [engine.enqueue(JobSpec(tuple(p), max_new_tokens=new_tokens, sampler=decode.GREEDY)) for p in prompts]
    return engine.step, lambda: [engine.cancel(i) for i in ids]


def _gpu_summary(prof, wall: float, steps: int) -> dict:
    events = [e for e in prof.key_averages() if e.device_time_total > 0 and e.count > 0]
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    kernel_us = sum(e.device_time for e in kernels)
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:24]  # the small ones count too
    return {
        "gpu_kernel_ms_per_step": kernel_us / 1000 / steps,
        "kernel_launches_per_step": len(kernels) / steps,
        "gpu_busy_fraction": (kernel_us / 1e6) / wall,
        "top_kernels": [
            {
                "name": e.key[:80],
                "ms_per_step": e.self_device_time_total / 1000 / steps,
                "calls_per_step": e.count / steps,
            }
            for e in top
        ],
    } | _cpu_summary(prof, wall, steps)  # where the host's time goes: decode of small models is host-bound


def _cpu_summary(prof, wall: float, steps: int) -> dict:
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    return {
        "top_operators": [
            {
                "name": e.key[:80],
                "self_ms_per_step": e.self_cpu_time_total / 1000 / steps,
                "share_of_wall": e.self_cpu_time_total / 1e6 / wall,
                "calls_per_step": e.count / steps,
            }
            for e in events
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks profile-decode", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("7b", "bundled"), default="bundled")
    parser.add_argument("--engine", choices=ENGINE_NAMES, default="auto")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    session = Session()
    with contextlib.ExitStack() as stack:
        if args.model == "7b":
            folder, _ = stack.enter_context(seven_b_shaped())
        else:
            folder = BUNDLED_MODEL
        session.load(str(folder), engine=args.engine, cache_tokens=2048, progress=False)
        result = {"environment": environment(), "model": args.model, **profile_steps(session, args.tokens, args.batch)}
        session.unload()
    engine = result["engine"]
    path = new_result_path(
        args.out, f"profile-decode-{engine}-{args.model}-batch{args.batch}-{result['environment']['date'][:10]}"
    )
    write_json(path, result, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
