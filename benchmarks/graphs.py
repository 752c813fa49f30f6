"""Eager against CUDA-graph decode on both GPU engines, with the peers, in one run; JSON out.

    python -m benchmarks graphs [--quick] [--models bundled,7b-shaped] [--engines exllamav2,exllamav3] [--out DIR]

Per model and engine, the engine loaded twice side by side, with `graphs="off"` and with `graphs="auto"`, and the
two timed in turns (so that whatever else the machine does slows both alike): batch-1 decode (the engine's
generator driven by hand, as `raw_decode` does, ms per token) and the aggregate new tokens/s of 8 jobs submitted
together; whether the two gave the same greedy tokens (one job, and 8 together); the status lines (graphs
captured, their memory). The 7B-shaped model against weights / copy bandwidth, the fastest a batch-1 token can
be; the bundled model also against transformers `generate`, eager and at its best settings (a static cache,
which `generate` compiles with torch.compile), batch 1, greedy. The goals this answers (the ratios under
"goals", on the ExLlamaV2 engine, where they were first set): 7B-shaped batch-1 decode at most 1.5x the floor;
the bundled model at least 3x the eager tokens/s; the engine at least 2x transformers at its best.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from benchmarks import decode
from benchmarks.harness import clock, device_slug, environment, new_result_path, summarise, write_json
from benchmarks.suites import _or_its_error
from exlnb.engines.job_options import JobOptions
from exlnb.models import BUNDLED_MODEL, resolve_model
from exlnb.random_model import SEVEN_B_SHAPED, cannot_make_here, seven_b_shaped
from exlnb.session import Session

MODELS = ("bundled", SEVEN_B_SHAPED)
ENGINES = ("exllamav2", "exllamav3")
CACHE_TOKENS = 4096
BATCH = 8
CHECK_TOKENS = 64  # greedy tokens compared between eager and graphs


def plan(quick: bool) -> dict:
    return {
        "warmup": 1 if quick else 2,
        "repeats": 2 if quick else 5,
        "new_tokens": 16 if quick else 128,
        "batch_new_tokens": 16 if quick else 64,
    }


@contextlib.contextmanager
def model_folder(model: str) -> Iterator[tuple[Path, int | None]]:
    if model == SEVEN_B_SHAPED:
        with seven_b_shaped() as (folder, weight_bytes):
            yield folder, weight_bytes
    else:
        yield resolve_model(BUNDLED_MODEL, progress=False), None


def greedy_tokens(session: Session) -> list[tuple[int, ...]]:
    """One job's greedy tokens, then 8 jobs' submitted together: what graphs must not change."""
    prompts = [decode.random_prompt(32, 7000 + i) for i in range(BATCH)]
    job = JobOptions(max_new_tokens=CHECK_TOKENS, sampler=decode.GREEDY, stop_at_eos=False)
    specs = [session.spec_for(p, job) for p in prompts]
    alone = [session.submit_together(specs[:1])[0].result().token_ids]
    return alone + [s.result().token_ids for s in session.submit_together(specs)]


def engine_rows(folder: Path, p: dict, engine: str) -> dict:
    """Eager and graphed sessions of one engine, loaded side by side and timed in turns: batch-1 ms/token and
    8-job aggregate tokens/s after warm-up runs (which also capture the graphs each shape needs)."""
    sessions = {}
    try:
        for mode in ("off", "auto"):
            sessions[mode] = Session()
            sessions[mode].load(str(folder), engine=engine, cache_tokens=CACHE_TOKENS, graphs=mode, progress=False)
        status = {mode: s.status().line() for mode, s in sessions.items()}
        tokens = {mode: greedy_tokens(s) for mode, s in sessions.items()}
        ms: dict[str, list[float]] = {"off": [], "auto": []}
        batched: dict[str, list[float]] = {"off": [], "auto": []}
        for run in range(p["warmup"] + p["repeats"]):
            for mode, session in sessions.items():
                rate = decode.raw_decode(session, decode.random_prompt(32, run), p["new_tokens"]).decode_tokens_per_s
                ms[mode].append(1000 / rate)
                batched[mode].append(decode.aggregate_throughput(session, BATCH, p["batch_new_tokens"], seed=run))
        after = {mode: s.status() for mode, s in sessions.items()}
    finally:
        for session in sessions.values():
            session.unload()
    key = f"aggregate_tokens_per_s_{BATCH}_jobs"
    rows = {
        "eager" if mode == "off" else "graphs": {
            "status_at_load": status[mode],
            "status_after": after[mode].line(),
            "notes": list(after[mode].notes),
            "warmup_ms_per_token": ms[mode][: p["warmup"]],
            "ms_per_token": summarise(ms[mode][p["warmup"] :]),
            key: summarise(batched[mode][p["warmup"] :]),
        }
        for mode in sessions
    }
    rows["same_greedy_tokens"] = {
        "alone": tokens["off"][0] == tokens["auto"][0],
        f"{BATCH}_together": tokens["off"][1:] == tokens["auto"][1:],
    }
    rows["speedup_batch_1"] = rows["eager"]["ms_per_token"]["median"] / rows["graphs"]["ms_per_token"]["median"]
    rows[f"speedup_batch_{BATCH}"] = rows["graphs"][key]["median"] / rows["eager"][key]["median"]
    return rows


class _TokenTimes:
    """A `generate` streamer that reads the clock at each token it is handed (the first call is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(clock())

    def end(self) -> None:
        pass


@torch.inference_mode()
def hf_generate_decode(model, prompt: list[int], new_tokens: int, **options) -> float:
    """Decode tokens/s of one `generate` call: tokens after the first over the time after the first."""
    ids = torch.tensor([prompt], device=model.device)
    times = _TokenTimes()
    model.generate(
        ids,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        streamer=times,
        **options,
    )
    produced = times.times[1:]  # times[0]: the prompt
    return (len(produced) - 1) / (produced[-1] - produced[0])


def transformers_peer(folder: Path, p: dict) -> dict:
    """transformers `generate` on the same model, batch 1, greedy: eager (dynamic cache) and with a static cache
    (which `generate` compiles; the first call pays the compilation and is timed apart)."""
    model = decode.load_hf_peer(folder)
    out = {}
    try:
        for name, options in (("eager", {}), ("static_cache_compiled", {"cache_implementation": "static"})):
            decode_rates, seconds = [], []
            for run in range(p["warmup"] + p["repeats"]):
                start = clock()
                decode_rates.append(
                    hf_generate_decode(model, decode.random_prompt(32, 500 + run), p["new_tokens"], **options)
                )
                seconds.append(clock() - start)
            out[name] = {
                "tokens_per_s": summarise(decode_rates[p["warmup"] :]),
                "first_call_s": seconds[0],
                "all_calls_s": sum(seconds),
                "warmup_tokens_per_s": decode_rates[: p["warmup"]],
            }
    finally:
        del model
        torch.cuda.empty_cache()
    return out


def measure(model: str, p: dict, engines: list[str]) -> dict:
    from benchmarks.hardware import copy_bandwidth

    row: dict = {}
    with model_folder(model) as (folder, weight_bytes):
        for engine in engines:
            row[engine] = _or_its_error(lambda: engine_rows(folder, p, engine))
        if model == "bundled":
            row["transformers"] = _or_its_error(lambda: transformers_peer(folder, p))
    if weight_bytes:
        bandwidth = copy_bandwidth()
        floor_ms = 1000 * weight_bytes / bandwidth
        row |= {
            "copy_bandwidth_bytes_per_s": bandwidth,
            "weight_bytes_read_per_token": weight_bytes,
            "floor_ms_per_token": floor_ms,
        }
        for engine in engines:
            for mode in ("eager", "graphs"):
                if mode in row[engine]:
                    row[engine][f"{mode}_over_floor"] = row[engine][mode]["ms_per_token"]["median"] / floor_ms
    hf = row.get("transformers", {})
    if "static_cache_compiled" in hf:
        best = max(hf[k]["tokens_per_s"]["median"] for k in ("eager", "static_cache_compiled"))
        for engine in engines:
            for mode in ("eager", "graphs"):
                if mode in row[engine]:
                    row[engine][f"{mode}_over_transformers_best"] = (
                        1000 / row[engine][mode]["ms_per_token"]["median"]
                    ) / best
    return row


def goals(rows: dict) -> dict:
    """The three goals the graphs were built for, on the ExLlamaV2 engine, each with its ratio and whether met."""
    out = {}
    seven_b = rows.get(SEVEN_B_SHAPED, {}).get("exllamav2", {})
    if "graphs_over_floor" in seven_b:
        ratio = seven_b["graphs_over_floor"]
        out["7b_batch_1_over_floor_at_most_1.5"] = {"ratio": ratio, "met": ratio <= 1.5}
    bundled = rows.get("bundled", {}).get("exllamav2", {})
    if "speedup_batch_1" in bundled:
        ratio = bundled["speedup_batch_1"]
        out["bundled_batch_1_speedup_at_least_3"] = {"ratio": ratio, "met": ratio >= 3}
    if "graphs_over_transformers_best" in bundled:
        ratio = bundled["graphs_over_transformers_best"]
        out["engine_over_transformers_best_at_least_2"] = {"ratio": ratio, "met": ratio >= 2}
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m benchmarks graphs", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs, to check the script")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma separated: {', '.join(MODELS)}")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma separated: {', '.join(ENGINES)}")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    models, engines = args.models.split(","), args.engines.split(",")
    if unknown := set(models) - set(MODELS):
        parser.error(f"unknown models {sorted(unknown)}: choose from {', '.join(MODELS)}")
    if unknown := set(engines) - set(ENGINES):
        parser.error(f"unknown engines {sorted(unknown)}: choose from {', '.join(ENGINES)}")
    if not torch.cuda.is_available() or not all(importlib.util.find_spec(e) for e in engines):
        parser.exit(2, f"python -m benchmarks graphs needs a CUDA GPU and {' and '.join(engines)}\n")
    if SEVEN_B_SHAPED in models and (reason := cannot_make_here()):
        parser.exit(2, reason + "\n")
    env, p = environment(), plan(args.quick)
    rows = {}
    for model in models:
        rows[model] = measure(model, p, engines)
        for engine in engines:
            row = rows[model][engine]
            if "error" in row:
                print(f"{model} on {engine}: {row['error']}", flush=True)
                continue
            print(
                f"{model} on {engine}: eager {row['eager']['ms_per_token']['median']:.2f} ms/token, graphs "
                f"{row['graphs']['ms_per_token']['median']:.2f} ({row['speedup_batch_1']:.2f}x); batch {BATCH} "
                f"{row[f'speedup_batch_{BATCH}']:.2f}x; same greedy tokens {row['same_greedy_tokens']}; "
                f"{row['graphs']['status_after']}",
                flush=True,
            )
    result = {"environment": env, "plan": p, "cache_tokens": CACHE_TOKENS, "models": rows, "goals": goals(rows)}
    path = new_result_path(args.out, f"graphs-{device_slug(env)}-{env['date'][:10]}")
    write_json(path, result, indent=2)
    print(json.dumps(result["goals"], indent=2))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
