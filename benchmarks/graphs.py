"""Eager against CUDA-graph decode on the ExLlamaV2 engine, with the peers, in one run; JSON out.

    python -m benchmarks graphs [--quick] [--models bundled,7b-shaped] [--out benchmarks/results]

Per model, the ExLlamaV2 engine loaded with `graphs="off"` and with `graphs="auto"`: batch-1 decode (the
engine's generator driven by hand, as `raw_decode` does, ms per token) and the aggregate new tokens/s of 8 jobs
submitted together; the status line (graphs captured, their memory). The ExLlamaV3 engine on the same weights
where exllamav3 is installed (it has graph code of its own). The 7B-shaped model against weights / copy
bandwidth, the fastest a batch-1 token can be; the bundled model also against transformers `generate`, eager
and at its best settings (a static cache, which `generate` compiles with torch.compile), batch 1, greedy.
The goals this answers (the ratios under "goals"): 7B-shaped batch-1 decode at most 1.5x the floor; the
bundled model at least 3x the eager tokens/s; the engine at least 2x transformers at its best.
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
from exlnb.models import BUNDLED_MODEL, resolve_model
from exlnb.random_model import SEVEN_B_SHAPED, cannot_make_here, seven_b_shaped
from exlnb.session import Session

MODELS = ("bundled", SEVEN_B_SHAPED)
CACHE_TOKENS = 4096
BATCH = 8


def plan(quick: bool) -> dict:
    return {"warmup": 1 if quick else 2, "repeats": 2 if quick else 5, "new_tokens": 16 if quick else 128,
            "batch_new_tokens": 16 if quick else 64}


@contextlib.contextmanager
def model_folder(model: str) -> Iterator[tuple[Path, int | None]]:
    if model == SEVEN_B_SHAPED:
        with seven_b_shaped() as (folder, weight_bytes):
            yield folder, weight_bytes
    else:
        yield resolve_model(BUNDLED_MODEL, progress=False), None


def engine_decode(folder: Path, p: dict, *, engine: str = "exllamav2", graphs: str = "auto") -> dict:
    """Batch-1 ms/token and 8-job aggregate tokens/s of one engine setup, after warm-up runs (which also
    capture the graphs each shape needs)."""
    session = Session()
    options = {"graphs": graphs} if engine == "exllamav2" else {}
    status = session.load(str(folder), engine=engine, cache_tokens=CACHE_TOKENS, progress=False, **options)
    try:
        runs = [decode.raw_decode(session, decode.random_prompt(32, run), p["new_tokens"])
                for run in range(p["warmup"] + p["repeats"])]
        decode.aggregate_throughput(session, BATCH, p["batch_new_tokens"], seed=99)  # warm-up, captures batch 8
        batched = [decode.aggregate_throughput(session, BATCH, p["batch_new_tokens"], seed=run) for run in range(p["repeats"])]
        after = session.status()
    finally:
        session.unload()
    ms = [1000 / r.decode_tokens_per_s for r in runs]
    return {"status_at_load": status.line(), "status_after": after.line(), "notes": list(after.notes),
            "warmup_ms_per_token": ms[: p["warmup"]], "ms_per_token": summarise(ms[p["warmup"]:]),
            f"aggregate_tokens_per_s_{BATCH}_jobs": summarise(batched)}


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
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                   streamer=times, **options)
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
                decode_rates.append(hf_generate_decode(model, decode.random_prompt(32, 500 + run), p["new_tokens"], **options))
                seconds.append(clock() - start)
            out[name] = {"tokens_per_s": summarise(decode_rates[p["warmup"]:]), "first_call_s": seconds[0],
                         "all_calls_s": sum(seconds), "warmup_tokens_per_s": decode_rates[: p["warmup"]]}
    finally:
        del model
        torch.cuda.empty_cache()
    return out


def measure(model: str, p: dict) -> dict:
    from benchmarks.hardware import copy_bandwidth

    row: dict = {}
    with model_folder(model) as (folder, weight_bytes):
        row["eager"] = engine_decode(folder, p, graphs="off")
        row["graphs"] = engine_decode(folder, p, graphs="auto")
        if importlib.util.find_spec("exllamav3") is not None:
            row["exllamav3_engine"] = _or_its_error(lambda: engine_decode(folder, p, engine="exllamav3"))
        if model == "bundled":
            row["transformers"] = _or_its_error(lambda: transformers_peer(folder, p))
    eager_ms, graph_ms = (row[k]["ms_per_token"]["median"] for k in ("eager", "graphs"))
    row["speedup_batch_1"] = eager_ms / graph_ms
    key = f"aggregate_tokens_per_s_{BATCH}_jobs"
    row[f"speedup_batch_{BATCH}"] = row["graphs"][key]["median"] / row["eager"][key]["median"]
    if weight_bytes:
        bandwidth = copy_bandwidth()
        floor_ms = 1000 * weight_bytes / bandwidth
        row |= {"copy_bandwidth_bytes_per_s": bandwidth, "weight_bytes_read_per_token": weight_bytes,
                "floor_ms_per_token": floor_ms, "eager_over_floor": eager_ms / floor_ms,
                "graphs_over_floor": graph_ms / floor_ms}
    hf = row.get("transformers", {})
    if "static_cache_compiled" in hf:
        best = max(hf[k]["tokens_per_s"]["median"] for k in ("eager", "static_cache_compiled"))
        row["graphs_over_transformers_best"] = (1000 / graph_ms) / best
        row["eager_over_transformers_best"] = (1000 / eager_ms) / best
    return row


def goals(rows: dict) -> dict:
    """The issue's three goals, each with its measured ratio and whether it was met."""
    out = {}
    if SEVEN_B_SHAPED in rows:
        ratio = rows[SEVEN_B_SHAPED]["graphs_over_floor"]
        out["7b_batch_1_over_floor_at_most_1.5"] = {"ratio": ratio, "met": ratio <= 1.5}
    if "bundled" in rows:
        ratio = rows["bundled"]["speedup_batch_1"]
        out["bundled_batch_1_speedup_at_least_3"] = {"ratio": ratio, "met": ratio >= 3}
        if "graphs_over_transformers_best" in rows["bundled"]:
            ratio = rows["bundled"]["graphs_over_transformers_best"]
            out["engine_over_transformers_best_at_least_2"] = {"ratio": ratio, "met": ratio >= 2}
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m benchmarks graphs", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs, to check the script")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma separated: {', '.join(MODELS)}")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    models = args.models.split(",")
    if unknown := set(models) - set(MODELS):
        parser.error(f"unknown models {sorted(unknown)}: choose from {', '.join(MODELS)}")
    if not torch.cuda.is_available() or importlib.util.find_spec("exllamav2") is None:
        parser.exit(2, "python -m benchmarks graphs needs a CUDA GPU and exllamav2 0.3.2\n")
    if SEVEN_B_SHAPED in models and (reason := cannot_make_here()):
        parser.exit(2, reason + "\n")
    env, p = environment(), plan(args.quick)
    rows = {}
    for model in models:
        rows[model] = measure(model, p)
        print(f"{model}: eager {rows[model]['eager']['ms_per_token']['median']:.2f} ms/token, graphs "
              f"{rows[model]['graphs']['ms_per_token']['median']:.2f} ms/token ({rows[model]['speedup_batch_1']:.2f}x); "
              f"batch {BATCH} {rows[model][f'speedup_batch_{BATCH}']:.2f}x", flush=True)
    result = {"environment": env, "plan": p, "cache_tokens": CACHE_TOKENS, "models": rows, "goals": goals(rows)}
    path = new_result_path(args.out, f"graphs-{device_slug(env)}-{env['date'][:10]}")
    write_json(path, result, indent=2)
    print(json.dumps(result["goals"], indent=2))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
