"""Run every benchmark this machine can run, print a table, write JSON (and the context curve as PNG).

    python -m benchmarks [--quick] [--only kit,peer,context,concurrency,hardware] [--out benchmarks/results]

GPU benchmarks run where CUDA and exllamav2 are available; the default engine is chosen as in the kit
(ExLlamaV2 on CUDA, else CPU). Numbers are medians of repeats after warm-ups, clocks read after device
synchronisation; raw samples are kept in the JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import decode
from benchmarks.harness import device_slug, environment, repeat, summarise
from exlnb import get_session
from exlnb.models import resolve_model
from exlnb.session import Session

ALL = ("kit", "peer", "context", "concurrency", "hardware")


@dataclass(frozen=True)
class Plan:
    repeats: int
    warmup: int
    new_tokens: int
    prompt_tokens: int
    context_lengths: tuple[int, ...]
    concurrency: tuple[int, ...]

    @classmethod
    def for_mode(cls, quick: bool, cuda: bool) -> Plan:
        if quick:
            return cls(repeats=2, warmup=1, new_tokens=8, prompt_tokens=32, context_lengths=(128, 512), concurrency=(1, 2))
        if not cuda:  # a 2-core CPU prefills about 200 tokens/s: stop the context sweep at 2048
            return cls(
                repeats=3, warmup=1, new_tokens=64, prompt_tokens=128,
                context_lengths=(128, 256, 512, 1024, 2048), concurrency=(1, 2, 4, 8),
            )
        return cls(
            repeats=5, warmup=2, new_tokens=128, prompt_tokens=128,
            context_lengths=(128, 256, 512, 1024, 2048, 4096, 8160), concurrency=(1, 2, 4, 8),
        )


def bench_kit(session: Session, plan: Plan) -> dict:
    """Kit overhead: the same job through the session's stream and by hand over the engine's generator."""
    samples = {"session": [], "raw": []}
    for run in range(plan.warmup + plan.repeats):
        prompt = decode.random_prompt(session, plan.prompt_tokens, seed=run)
        pair = {"session": decode.session_decode(session, prompt, plan.new_tokens),
                "raw": decode.raw_decode(session, decode.random_prompt(session, plan.prompt_tokens, 1000 + run), plan.new_tokens)}
        if run >= plan.warmup:
            for key in samples:
                samples[key].append(pair[key])
    out = {k: {m: summarise([s[m] for s in v]) for m in ("decode_tokens_per_s", "ttft_s")} for k, v in samples.items()}
    out["ratio_decode_session_over_raw"] = out["session"]["decode_tokens_per_s"]["median"] / out["raw"]["decode_tokens_per_s"]["median"]
    out["ttft_overhead_ms"] = 1000 * (out["session"]["ttft_s"]["median"] - out["raw"]["ttft_s"]["median"])
    out["magic_ttft"] = "not measured: the %%exl_generate magic is not part of this build yet"
    return out


def bench_peer(session: Session, plan: Plan) -> dict:
    """The engine against transformers `generate` on the same device and model (batch 1, greedy)."""
    model = decode.load_hf_peer(resolve_model("smollm2-135m-instruct"))
    prefill_tokens = 4 * plan.prompt_tokens
    engine_runs, hf_runs, engine_prefill, hf_prefill = [], [], [], []
    for run in range(plan.warmup + plan.repeats):
        prompt = decode.random_prompt(session, plan.prompt_tokens, seed=2000 + run)
        long_prompt = decode.random_prompt(session, prefill_tokens, seed=3000 + run)
        e, h = decode.session_decode(session, prompt, plan.new_tokens), decode.hf_decode(model, prompt, plan.new_tokens)
        ep, hp = decode.engine_prefill(session, long_prompt), decode.hf_prefill(model, long_prompt)
        if run >= plan.warmup:
            engine_runs.append(e["decode_tokens_per_s"]), hf_runs.append(h["decode_tokens_per_s"])
            engine_prefill.append(ep), hf_prefill.append(hp)
    del model
    out = {
        "engine_decode_tokens_per_s": summarise(engine_runs),
        "hf_decode_tokens_per_s": summarise(hf_runs),
        "engine_prefill_tokens_per_s": summarise(engine_prefill),
        "hf_prefill_tokens_per_s": summarise(hf_prefill),
        "prefill_prompt_tokens": prefill_tokens,
        "hf_dtype": "float16" if torch.cuda.is_available() else "float32",
    }
    out["ratio_decode_engine_over_hf"] = out["engine_decode_tokens_per_s"]["median"] / out["hf_decode_tokens_per_s"]["median"]
    out["ratio_prefill_engine_over_hf"] = out["engine_prefill_tokens_per_s"]["median"] / out["hf_prefill_tokens_per_s"]["median"]
    return out


def bench_context(session: Session, plan: Plan) -> dict:
    """Decode and prefill speed against context length (field reports 4 and 5)."""
    rows = []
    for length in plan.context_lengths:
        decode_rates, prefill_rates = [], []
        for run in range(plan.repeats):
            prompt = decode.random_prompt(session, length, seed=length * 10 + run)
            decode_rates.append(decode.session_decode(session, prompt, min(plan.new_tokens, 32))["decode_tokens_per_s"])
            prefill_rates.append(decode.engine_prefill(session, decode.random_prompt(session, length, seed=-length - run)))
        rows.append({"context_tokens": length, "decode_tokens_per_s": summarise(decode_rates),
                     "prefill_tokens_per_s": summarise(prefill_rates)})
    return {"rows": rows}


def bench_concurrency(session: Session, plan: Plan) -> dict:
    """Aggregate tokens/s with 1, 2, 4, 8 jobs submitted together (continuous batching)."""
    rows = {n: summarise([decode.aggregate_throughput(session, n, plan.new_tokens, seed=run)
                          for run in range(plan.repeats)]) for n in plan.concurrency}
    out = {"aggregate_tokens_per_s": {str(n): r for n, r in rows.items()}}
    if 4 in rows:
        out["ratio_4_over_1"] = rows[4]["median"] / rows[1]["median"]
    if 8 in rows:
        out["ratio_8_over_1"] = rows[8]["median"] / rows[1]["median"]
    return out


def bench_hardware(plan: Plan) -> dict:
    from benchmarks.hardware import copy_bandwidth, make_random_llama

    bandwidth = copy_bandwidth()
    with tempfile.TemporaryDirectory(prefix="exlnb-7b-") as tmp:
        weight_bytes = make_random_llama(Path(tmp), resolve_model("smollm2-135m-instruct"))
        session = Session()
        session.load(tmp, engine="exllamav2", cache_tokens=2048, progress=False)
        try:
            rates = [decode.raw_decode(session, decode.random_prompt(session, 32, run), plan.new_tokens)["decode_tokens_per_s"]
                     for run in range(plan.warmup + plan.repeats)][plan.warmup:]
        finally:
            session.unload()
    ms_per_token = [1000 / r for r in rates]
    floor_ms = 1000 * weight_bytes / bandwidth
    return {
        "copy_bandwidth_bytes_per_s": bandwidth,
        "weight_bytes_read_per_token": weight_bytes,
        "floor_ms_per_token": floor_ms,
        "ms_per_token": summarise(ms_per_token),
        "ratio_over_floor": summarise(ms_per_token)["median"] / floor_ms,
    }


def table(results: dict) -> str:
    b = results["benchmarks"]
    lines = ["| measurement | value | target |", "|---|---|---|"]

    def add(name, value, target=""):
        lines.append(f"| {name} | {value} | {target} |")

    if "kit" in b:
        add("kit stream / raw generator decode tokens/s", f"{b['kit']['ratio_decode_session_over_raw']:.3f}", ">= 0.97 (GPU)")
        add("TTFT overhead of the session", f"{b['kit']['ttft_overhead_ms']:.1f} ms", "<= 20 ms")
    if "peer" in b:
        add("engine / transformers decode tokens/s", f"{b['peer']['ratio_decode_engine_over_hf']:.2f}",
            ">= 2.0 (GPU), >= 0.9 (CPU)")
        add("engine / transformers prefill tokens/s", f"{b['peer']['ratio_prefill_engine_over_hf']:.2f}")
    if "hardware" in b:
        add("7B-shaped decode / weights-over-bandwidth floor", f"{b['hardware']['ratio_over_floor']:.2f}x", "<= 1.5x")
    if "concurrency" in b and "ratio_4_over_1" in b["concurrency"]:
        add("aggregate tokens/s, 4 jobs / 1 job", f"{b['concurrency']['ratio_4_over_1']:.2f}", ">= 1.5 (CPU)")
    return "\n".join(lines)


def plot_context(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [r["context_tokens"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].plot(lengths, [r["decode_tokens_per_s"]["median"] for r in rows], marker="o")
    axes[0].set(xscale="log", xlabel="context tokens", ylabel="decode tokens/s", title="decode")
    axes[1].plot(lengths, [r["prefill_tokens_per_s"]["median"] for r in rows], marker="o", color="C1")
    axes[1].set(xscale="log", xlabel="prompt tokens", ylabel="prefill tokens/s", title="prefill")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few, short runs: checks that everything runs")
    parser.add_argument("--only", default=",".join(ALL), help=f"comma-separated subset of {','.join(ALL)}")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--engine", default="auto", choices=("auto", "exllamav2", "cpu"))
    args = parser.parse_args(argv)
    chosen = [name for name in args.only.split(",") if name]
    unknown = set(chosen) - set(ALL)
    if unknown:
        parser.error(f"unknown benchmarks {sorted(unknown)}: choose from {', '.join(ALL)}")
    plan = Plan.for_mode(args.quick, torch.cuda.is_available())

    session = get_session()
    status = session.load("smollm2-135m-instruct", engine=args.engine, cache_tokens=8448, progress=False)
    env = environment()
    results = {"environment": env, "engine": status.line(), "quick": args.quick, "plan": plan.__dict__, "benchmarks": {}, "skipped": {}}
    runners = {"kit": bench_kit, "peer": bench_peer, "context": bench_context, "concurrency": bench_concurrency}
    for name in chosen:
        if name == "hardware":
            if status.engine != "exllamav2":
                results["skipped"][name] = "needs the ExLlamaV2 engine on CUDA"
                continue
            results["benchmarks"][name] = bench_hardware(plan)
        else:
            print(f"running {name} ...", flush=True)
            results["benchmarks"][name] = runners[name](session, plan)

    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{status.engine}-{device_slug(env)}-{env['date'][:10]}" + ("-quick" if args.quick else "")
    path = args.out / f"{stem}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    if "context" in results["benchmarks"]:
        plot_context(results["benchmarks"]["context"]["rows"], args.out / f"{stem}-context.png", status.line())
    print(table(results))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
