"""Where a batch-1 decode step of the ExLlamaV2 engine spends its time: GPU kernels or the host.

    python -m benchmarks.profile_decode [--model 7b|bundled] [--out benchmarks/results]

Profiles decode steps of exllamav2's dynamic generator with the torch profiler and writes, per token:
wall time, GPU kernel time, kernel launches, and the busiest kernels. If kernel time is far below wall
time, the step is bound by launching kernels from Python, not by the GPU.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import decode
from benchmarks.harness import environment
from exlnb.models import resolve_model
from exlnb.session import Session


def profile_steps(session: Session, tokens: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    def run(engine) -> dict:
        from exllamav2.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

        generator = engine.generator
        prompt = decode.random_prompt(session, 32, seed=0)
        generator.enqueue(ExLlamaV2DynamicJob(input_ids=torch.tensor([prompt]), max_new_tokens=tokens + 20,
                                              gen_settings=ExLlamaV2Sampler.Settings.greedy(), stop_conditions=[]))
        for _ in range(10):  # prefill and warm-up steps
            generator.iterate()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(tokens):
                generator.iterate()
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        generator.clear_queue()
        events = [e for e in prof.key_averages() if e.device_time_total > 0 and e.count > 0]
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        kernel_us = sum(e.device_time for e in kernels)
        top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:8]
        return {
            "tokens": tokens,
            "wall_ms_per_token": 1000 * wall / tokens,
            "gpu_kernel_ms_per_token": kernel_us / 1000 / tokens,
            "kernel_launches_per_token": len(kernels) / tokens,
            "gpu_busy_fraction": (kernel_us / 1e6) / wall,
            "top_kernels": [{"name": e.key[:80], "ms_per_token": e.self_device_time_total / 1000 / tokens,
                             "calls_per_token": e.count / tokens} for e in top],
        }

    return session.run_on_engine(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("7b", "bundled"), default="7b")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    session = Session()
    with tempfile.TemporaryDirectory(prefix="exlnb-7b-") as tmp:
        if args.model == "7b":
            from benchmarks.hardware import make_random_llama

            make_random_llama(Path(tmp), resolve_model("smollm2-135m-instruct"))
            folder = tmp
        else:
            folder = str(resolve_model("smollm2-135m-instruct"))
        session.load(folder, engine="exllamav2", cache_tokens=2048, progress=False)
        result = {"environment": environment(), "model": args.model, **profile_steps(session, args.tokens)}
        session.unload()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"profile-decode-{args.model}-{result['environment']['date'][:10]}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
