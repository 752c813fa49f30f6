"""Serving latency under load: sweep request rates over the loaded engine, as vLLM's benchmark_serving does.

    python -m benchmarks.serving --rates 1,2,4,8,inf --requests 64 [--engine exllamav2 --paged off] [--out FILE.json]

Each rate sends the same seeded requests (random-token prompts, exact output lengths) through `exlnb.bench`
after one warm-up request, and the JSON keeps where it ran (device, driver, versions, commit, load, date),
the settings, every request's raw token times, and per rate the summary (TTFT, TPOT, ITL, E2E latency:
mean, median, std, p90, p99; throughputs; goodput where SLOs are given).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmarks.harness import device_slug, environment
from exlnb import bench, get_session
from exlnb.workload import length_argument, rates_argument, slo_argument

PAGED = {"auto": "auto", "on": True, "off": False}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=rates_argument, default=[1.0, 2.0, 4.0, 8.0, float("inf")],
                        help="requests per second, comma separated; inf sends all at once (default 1,2,4,8,inf)")
    parser.add_argument("--requests", type=int, default=64, help="requests per rate")
    parser.add_argument("--prompt-len", type=length_argument, default=128, help="tokens, or a range such as 64-256")
    parser.add_argument("--output-len", type=length_argument, default=64, help="exact output tokens, or a range")
    parser.add_argument("--max-concurrency", type=int, help="most requests in flight (default: no limit)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 is Poisson")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo", action="append", type=slo_argument, default=[], help="e.g. ttft_ms=500, repeatable")
    parser.add_argument("--engine", default="auto", choices=("auto", "exllamav2", "cpu"))
    parser.add_argument("--paged", default="auto", choices=tuple(PAGED), help="exllamav2: paged attention or not")
    parser.add_argument("--cache-tokens", type=int, help="KV cache size in tokens (default: the engine's)")
    parser.add_argument("--out", type=Path, help="JSON file (default benchmarks/results/serving-<engine>-...json)")
    args = parser.parse_args(argv)

    session = get_session()
    status = session.load("smollm2-135m-instruct", engine=args.engine, cache_tokens=args.cache_tokens,
                          paged=PAGED[args.paged], progress=False)
    print(status.line(), flush=True)
    options = dict(burstiness=args.burstiness, max_concurrency=args.max_concurrency, prompt_len=args.prompt_len,
                   output_len=args.output_len, seed=args.seed, slos=dict(args.slo) or None)
    bench(num_requests=1, progress=False, **options)  # warm-up, as vLLM's initial test request
    env = environment()
    result = bench(args.rates, num_requests=args.requests, **options)
    env["load_average_1min_at_end"] = os.getloadavg()[0]

    mode = "paged" if status.paged else "unpaged"
    stem = f"serving-{status.engine}-{mode}-{device_slug(env)}-{env['date'][:10]}"
    path = args.out or Path("benchmarks/results") / f"{stem}.json"
    record = {
        "benchmark": "serving",
        "command": " ".join(["python -m benchmarks.serving", *(sys.argv[1:] if argv is None else argv)]),
        "environment": env,
        "engine": status.line(),
        "paged": status.paged,
        **result.as_dict(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, allow_nan=False) + "\n")
    print(result.table())
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
