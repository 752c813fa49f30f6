"""Serving latency under load, and where each engine saturates: request-rate sweeps on the bundled model.

Each sweep runs through `exlnb.bench`, as vLLM's benchmark_serving runs one against a server.

    python -m benchmarks serving --engine exllamav2,exllamav3 --paged on,off --out DIR   # the GPU saturation sweep
    python -m benchmarks serving --engine cpu --quick --out DIR                          # a short run: does it work
    python -m benchmarks serving --url http://127.0.0.1:5000/v1 --api-key-env KEY_VAR    # a server (the openai engine)

Each setup (an engine, paged or not: exllamav2 runs in each mode asked for, an engine that always pages runs
once) is loaded in turn and sent the same seeded requests (random-token prompts, exact output lengths) at
each rate, after one warm-up request. One JSON under --out keeps where it ran (device, driver, versions,
commit, load, date), the settings, and per setup its status line, every request's raw token times, each
rate's summary (TTFT, TPOT, ITL, E2E latency: mean, median, std, p90, p99; throughputs; goodput with SLOs)
and where it saturated (`benchmarks.saturation`); a PNG beside it draws completed requests per second, p99
TTFT and median TPOT against the offered rate, a line per setup. Both are rewritten after each setup, so a
setup that fails keeps the ones before it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from benchmarks.harness import device_slug, environment, new_result_path, write_json
from benchmarks.saturation import figure, saturation
from exlnb import bench, get_session
from exlnb.bench_result import plain_json
from exlnb.engines.formats import engine_for, model_format
from exlnb.engines.options import ENGINE_NAMES, PAGED_MODES, UNPAGED_ENGINES, cuda_available
from exlnb.engines.registry import engine_spec, engines_loading
from exlnb.models import BUNDLED_MODEL, resolve_model
from exlnb.workload import length_argument, rate_label, rates_argument, slo_argument

INF = float("inf")
# rising rates, to find each setup's saturation; 32 requests a rate should keep the three GPU setups near 6 minutes
SWEEP = dict(rates=[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, INF], requests=32, prompt_len=128, output_len=64)
QUICK = dict(rates=[2.0, 8.0, INF], requests=4, prompt_len=32, output_len=8)


def choices_argument(choices):
    """'a,b' -> ["a", "b"], each one of `choices`."""

    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",")]
        wrong = [name for name in names if name not in choices]
        if wrong:
            raise argparse.ArgumentTypeError(f"{', '.join(wrong)}: choose from {', '.join(choices)}")
        return names

    return parse


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks serving", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--engine",
        type=choices_argument(ENGINE_NAMES),
        default=["auto"],
        help=f"engines, comma separated: {', '.join(ENGINE_NAMES)} (default auto)",
    )
    parser.add_argument(
        "--paged",
        type=choices_argument(tuple(PAGED_MODES)),
        default=["auto"],
        help=f"{', '.join(PAGED_MODES)}, comma separated: each mode a setup, for "
        f"{', '.join(UNPAGED_ENGINES)} (the other engines always page; default auto)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a short run: rates {_rates(QUICK)}, {QUICK['requests']} requests of "
        f"{QUICK['prompt_len']} + {QUICK['output_len']} tokens",
    )
    parser.add_argument(
        "--rates",
        type=rates_argument,
        help=f"requests per second, comma separated; inf sends all at once (default {_rates(SWEEP)})",
    )
    parser.add_argument("--requests", type=int, help=f"requests per rate (default {SWEEP['requests']})")
    parser.add_argument(
        "--prompt-len", type=length_argument, help=f"tokens, or a range such as 64-256 (default {SWEEP['prompt_len']})"
    )
    parser.add_argument(
        "--output-len", type=length_argument, help=f"exact output tokens, or a range (default {SWEEP['output_len']})"
    )
    parser.add_argument("--max-concurrency", type=int, help="most requests in flight (default: no limit)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 is Poisson")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo", action="append", type=slo_argument, default=[], help="e.g. ttft_ms=500, repeatable")
    parser.add_argument("--cache-tokens", type=int, help="KV cache size in tokens (default: the engine's)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for the JSON and PNG")
    server = parser.add_argument_group("a server (the openai engine; --url alone chooses it)")
    server.add_argument("--url", help="the server's OpenAI API base, e.g. http://127.0.0.1:8000/v1")
    server.add_argument("--served-model", help="the server's name for the model (default: the one it serves)")
    server.add_argument("--api-key-env", help="environment variable holding the server's API key")
    server.add_argument("--api", choices=("chat", "completions"), default="chat")
    args = parser.parse_args(argv)
    servers = [spec.name for spec in engines_loading("url")]  # the engines that measure a server at its url
    if args.url and args.engine == ["auto"]:
        args.engine = servers[:1]
    if any(engine in servers for engine in args.engine) != bool(args.url):
        parser.error(
            f"--engine {' or '.join(servers)} and --url go together: the {servers[0]} engine measures "
            "the server at --url"
        )
    for key, value in (QUICK if args.quick else SWEEP).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.setups = setups(args.engine, args.paged)
    except ValueError as error:
        parser.error(str(error))
    return args


def setups(engines: list[str], modes: list[str]) -> list[tuple[str, str]]:
    """(engine, paged mode) pairs: an engine with an unpaged mode in each mode asked for, any other once."""
    chosen = []
    for name in engines:
        engine = (
            name if name != "auto" else engine_for(model_format(resolve_model(BUNDLED_MODEL)), cuda=cuda_available())
        )
        if engine in UNPAGED_ENGINES:
            chosen += [(engine, mode) for mode in modes]
        elif modes == ["off"]:
            raise ValueError(f"the {engine} engine always pages: --paged off needs {' or '.join(UNPAGED_ENGINES)}")
        else:
            chosen.append((engine, "auto"))
    return list(dict.fromkeys(chosen))


def main(argv: list[str] | None = None) -> Path:
    args = parse_arguments(argv)
    env = environment()
    engines = "-".join(dict.fromkeys(engine for engine, _ in args.setups))
    stem = f"serving-{engines}-{device_slug(env)}-{env['date'][:10]}{'-quick' if args.quick else ''}"
    path = new_result_path(args.out, stem)
    record = {
        "benchmark": "serving",
        "command": " ".join(["python -m benchmarks serving", *(sys.argv[1:] if argv is None else argv)]),
        "environment": env,
        "quick": args.quick,
        "setups": [],
    }
    options = dict(
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        seed=args.seed,
        slos=dict(args.slo) or None,
    )
    for engine, mode in args.setups:
        record["setups"].append(run_setup(engine, mode, args, options))
        record["environment"]["load_average_1min_at_end"] = os.getloadavg()[0]
        write(path, record)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return path


def run_setup(engine: str, mode: str, args: argparse.Namespace, options: dict) -> dict:
    """Load one setup, warm it up, sweep the rates; its record for the JSON."""
    started = time.perf_counter()
    remote = dict(url=args.url, served_model=args.served_model, api_key_env=args.api_key_env, api=args.api)
    serves = args.url is not None and "url" in engine_spec(engine).loads
    status = get_session().load(
        BUNDLED_MODEL,
        engine=engine,
        cache_tokens=args.cache_tokens,
        progress=False,
        **(remote if serves else {"paged": PAGED_MODES[mode]}),
    )
    name = f"{status.engine} at {args.url}" if serves else f"{status.engine} {'paged' if status.paged else 'unpaged'}"
    print(status.line(), flush=True)
    bench(num_requests=1, progress=False, **options)  # warm-up, as vLLM's initial test request
    result = bench(args.rates, num_requests=args.requests, **options)
    print(result.table(), flush=True)
    return plain_json(
        {
            "setup": name,
            "paged": status.paged,
            "notes": list(status.notes),
            "elapsed_s": time.perf_counter() - started,
            "saturation": saturation(result),
            **result.as_dict(),
        }
    )


def write(path: Path, record: dict) -> None:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, record, indent=1)
    env = record["environment"]
    title = f"{env['device']} · {env['date'][:10]}" + (" · quick" if record["quick"] else "")
    fig = figure(record["setups"], title=title)
    fig.savefig(path.with_suffix(".png"), dpi=120)
    plt.close(fig)


def _rates(preset: dict) -> str:
    return ",".join(rate_label(rate) for rate in preset["rates"])


if __name__ == "__main__":
    main()
