"""The speed suite: exlnb's engines against the raw libraries, transformers and the memory floor, in one record.

    python -m benchmarks speed [--quick] [--only PARTS] [--profile] [--layers N] [--budget-s S] [--out DIR]

One run on one machine times the same models with the same cache size: the bundled model; a Llama-2-7B-shaped
model with random fp16 weights (`exlnb.random_model`); the same model at 4.0 bits per weight as EXL3 and as
EXL2, quantized with `exlnb.quantize`. Each is driven by exlnb's engines through the public `Session` API
(`kit-*`), by the libraries' own generators as their examples drive them (`raw-*`: exllamav2's
`ExLlamaV2DynamicGenerator`, exllamav3's `Generator`), and by transformers `generate` with a static cache (which
`generate` compiles with torch.compile). Per setup: batch-1 decode ms/token at 256 and 4,096 tokens of context,
the aggregate new tokens/s of 8 jobs (and, for exlnb and transformers, their ramp: the slowest job's first
token, and the decode rate after it), time to first token of a 2,048-token prompt. The floor of a model is its
own weight bytes read per token over the device's copy bandwidth, measured in the same run. Setups compared by a
goal are loaded together and timed in turns (a part `a+b+c@model`), so that a ratio against a peer comes from
one process start, each side with its spread.

The run is a list of parts (`PARTS`, named `runner@model`); each is saved as soon as it ends into
`speed-<device>-<date>.json`, and a later run of the same day, device and plan resumes that file, skipping the
parts it already holds, so that a run split over calls of ten minutes (`--budget-s`) adds up to one record.
The models live in the exlnb cache (`$EXLNB_HOME`, else ~/.cache/exlnb) between calls; a quantization stopped
by the budget resumes where it stopped. `goals` holds each goal of `GOALS` with its ratio, whether it was met,
and why not where it was not measured.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.harness import device_slug, environment, new_result_path, write_json
from benchmarks.speed_setups import (
    BATCH,
    BATCHED,
    CACHE_TOKENS,
    KIT_VARIANTS,
    PROFILED,
    copy_bandwidth,
    free_memory,
    measure,
    profile,
    setup_apart,
    weight_bytes_read_per_token,
)
from benchmarks.suites import _or_its_error
from exlnb.models import BUNDLED_MODEL, cache_root, resolve_model
from exlnb.quantize import DEFAULT_HEAD_BITS, QuantizedModel
from exlnb.random_model import LLAMA_7B, cannot_make_here, make_random_llama, tokenizer_folder

CONTEXTS = (256, 4096)
TTFT_PROMPT = 2048
BITS = 4.0
LAYERS = LLAMA_7B["num_hidden_layers"]  # --layers makes the 7B shape shallower, for a quantization that must fit
QUANTIZED = {"7b-exl3": "exl3", "7b-exl2": "exl2"}
RUNNER_LIBRARY = {
    "kit-exllamav2": "exllamav2",
    "raw-exllamav2": "exllamav2",
    "kit-exllamav3": "exllamav3",
    "raw-exllamav3": "exllamav3",
    **{runner: library for runner, (library, _) in PROFILED.items()},
    "transformers": "transformers",
    "kit-cpu": None,
    **{runner: library for runner, (library, _) in KIT_VARIANTS.items()},
}
PARTS = (  # the goals' parts first (7B-shaped fp16, then EXL3), so that a short lease measures them; setups a goal
    # compares are one part, timed in turns
    [
        "bandwidth",
        "floor@7b-fp16",
        "kit-exllamav2+kit-exllamav3+transformers@7b-fp16",
        # each engine with its fp16 projections fused and without (engines/fused_products.py)
        "kit-exllamav2-fused+kit-exllamav2-unfused+kit-exllamav3-fused+kit-exllamav3-unfused@7b-fp16",
        # the ExLlamaV2 engine with each step queued ahead and without (queue_ahead.py), and each engine with its
        # steps' tokens embedded on the card and on the host (token_feed.py)
        "kit-exllamav2-ahead-on+kit-exllamav2-ahead-off@7b-fp16",
        "kit-exllamav2-feed-on+kit-exllamav2-feed-off+kit-exllamav3-feed-on+kit-exllamav3-feed-off@7b-fp16",
        # the ExLlamaV3 engine queuing each step before exllamav3's generator waits, and after (queue_ahead.py)
        "kit-exllamav3-before-wait+kit-exllamav3-after-wait@7b-fp16",
        # each engine prefilling the prompts that arrive together in one pass, and one pass each
        # (prefill_together.py): the batch-8 ramp
        "kit-exllamav2-prefill-together+kit-exllamav2-prefill-apart+kit-exllamav3-prefill-together"
        "+kit-exllamav3-prefill-apart@7b-fp16",
        # the ExLlamaV2 engine with its MLPs' tails in two kernels, its attentions' RoPE in one launch and residual in
        # o (mlp_tail.py, attention_tail.py), each alone, both, and as exllamav2 runs them, no norm folded
        "kit-exllamav2-mlp-tail+kit-exllamav2-attention-tail+kit-exllamav2-tails+kit-exllamav2-tails-apart@7b-fp16",
        # with both tails, the attention's norm folded into q, k and v (the default), both norms, none, both with the
        # activation's kernel in its former shape, and both launched dependent (folded_norm.py, normed_gemv.py,
        # dependent_launch.py)
        "kit-exllamav2-fold-attention+kit-exllamav2-fold-both+kit-exllamav2-fold-none+kit-exllamav2-fold-both-g4k512"
        "+kit-exllamav2-fold-both-dependent@7b-fp16",
        # each engine's decode attention with fewer, longer splits, and with its default (triton_decode.py): the
        # context ratio
        "kit-exllamav2-split512+kit-exllamav2-split256+kit-exllamav3-split512+kit-exllamav3-split256@7b-fp16",
        # each engine's decode attention with the call's new keys in tiles of their own (triton_decode.py): the
        # context ratio again
        "kit-exllamav2-fresh-apart+kit-exllamav2-fresh-inline+kit-exllamav3-fresh-apart+kit-exllamav3-fresh-inline"
        "@7b-fp16",
        # each engine with exlnb's kernels launched dependent on the one before, and apart (dependent_launch.py)
        "kit-exllamav2-dependent+kit-exllamav2-independent+kit-exllamav3-dependent+kit-exllamav3-independent@7b-fp16",
        # each engine's decode attention with 8 warps a program and with 4 (triton_decode.py)
        "kit-exllamav2-warps8+kit-exllamav2-warps4+kit-exllamav3-warps8+kit-exllamav3-warps4@7b-fp16",
        "raw-exllamav2+raw-exllamav3@7b-fp16",
    ]
    # the engine with each step queued ahead and without, beside exllamav3's own loop
    + ["quantize@7b-exl3", "floor@7b-exl3", "kit-exllamav3+kit-exllamav3-ahead-off+raw-exllamav3@7b-exl3"]
    + [
        "floor@bundled",
        "kit-cpu@bundled",
        "kit-exllamav2+kit-exllamav3+transformers@bundled",
        "raw-exllamav2+raw-exllamav3@bundled",
    ]
    + ["quantize@7b-exl2", "floor@7b-exl2", "kit-exllamav2+raw-exllamav2@7b-exl2"]
)
PROFILE_PARTS = (
    "profile-exllamav2@7b-fp16",
    "profile-exllamav2-fold-both@7b-fp16",
    "profile-exllamav3@7b-fp16",
    "profile-exllamav3@7b-exl3",
)


@dataclass(frozen=True)
class Goal:
    """One goal of issue 42: numerator / denominator, each a (part, metric) of the record (no denominator: the
    numerator alone, a ratio already); the name ends with `at_most_X` or `at_least_X`, then an optional engine
    suffix (`_v2`, `_v3`), and X is the threshold (said once, in the name)."""

    name: str
    numerator: tuple[str, str]
    denominator: tuple[str, str] | None = None

    @property
    def threshold(self) -> float:
        return float(self.name.removesuffix("_v2").removesuffix("_v3").rsplit("_", 1)[1])

    @property
    def at_most(self) -> bool:
        return "_at_most_" in self.name

    def sides(self) -> tuple[tuple[str, str], ...]:
        return (self.numerator,) if self.denominator is None else (self.numerator, self.denominator)

    def how(self) -> str:
        a, x = self.numerator
        ratio = f"{a} {x}" if self.denominator is None else f"{a} {x} / {self.denominator[0]} {self.denominator[1]}"
        return f"{ratio}, {'<=' if self.at_most else '>='} {self.threshold:g}"


V2, V3, HF = "kit-exllamav2@7b-fp16", "kit-exllamav3@7b-fp16", "transformers@7b-fp16"
FLOOR = ("floor@7b-fp16", "ms_per_token")
MS, TOKENS_S = "ms_per_token_256", "tokens_per_s_256"
GOALS = (
    Goal("v3_fp16_7b_batch1_over_floor_at_most_1.5", (V3, MS), FLOOR),
    Goal("v2_fp16_7b_batch1_over_floor_at_most_1.3", (V2, MS), FLOOR),
    Goal(
        "v3_exl3_7b_kit_over_raw_exllamav3_batch1_at_least_1.15",
        ("kit-exllamav3@7b-exl3", TOKENS_S),
        ("raw-exllamav3@7b-exl3", TOKENS_S),
    ),
    Goal("over_transformers_compiled_7b_batch1_at_least_1.2_v2", (V2, TOKENS_S), (HF, TOKENS_S)),
    Goal("over_transformers_compiled_7b_batch1_at_least_1.2_v3", (V3, TOKENS_S), (HF, TOKENS_S)),
    Goal("over_transformers_compiled_7b_batch8_at_least_1.2_v2", (V2, BATCHED), (HF, BATCHED)),
    Goal("over_transformers_compiled_7b_batch8_at_least_1.2_v3", (V3, BATCHED), (HF, BATCHED)),
    Goal("v3_fp16_7b_repeat_spread_at_most_1.1", (V3, f"{MS}_spread")),
    Goal("context_4096_over_256_per_token_at_most_1.15", (V2, "ms_per_token_4096"), (V2, MS)),
    Goal("batch8_aggregate_over_batch1_at_least_5", (V2, BATCHED), (V2, TOKENS_S)),
)


def plan(quick: bool) -> dict:
    if quick:  # checks that every part runs (CI, on the CPU): one short context, short runs
        return {"contexts": [64], "ttft_prompt": 64, "new_tokens": 8, "warmup": 1, "repeats": 2}
    return {"contexts": list(CONTEXTS), "ttft_prompt": TTFT_PROMPT, "new_tokens": 128, "warmup": 2, "repeats": 5}


def against_a_peer(goal: Goal) -> str | None:
    """The other setup a goal compares with (its denominator's runner), if it is one: not a floor, not itself."""
    if goal.denominator is None:
        return None
    runner, other = goal.numerator[0].partition("@")[0], goal.denominator[0].partition("@")[0]
    return None if other in (runner, "floor") else other


def goals(parts: dict) -> dict:
    """Each goal's ratio and whether it was met; where a side was not measured, why (that part's own reason)."""
    out = {}
    for goal in GOALS:
        values, why = [], []
        for part, metric in goal.sides():
            record = parts.get(part, {})
            if metric in record.get("metrics", {}):
                values.append(record["metrics"][metric])
            else:
                reason = (
                    record.get("why")
                    or record.get("error")
                    or (f"{metric} is not in this plan (--quick)" if "metrics" in record else "not run yet")
                )
                why.append(f"{part}: {reason}")
        if why:
            out[goal.name] = {"ratio": None, "met": False, "why": "; ".join(dict.fromkeys(why))}
            continue
        ratio = values[0] / values[1] if len(values) == 2 else values[0]
        result = out[goal.name] = {
            "ratio": ratio,
            "met": ratio <= goal.threshold if goal.at_most else ratio >= goal.threshold,
            "calls": sorted({parts[p]["call"] for p, _ in goal.sides()}),
        }
        if (peer := against_a_peer(goal)) is not None:  # a ratio against another setup counts only timed in turns
            result["timed_in_turns"] = peer in parts[goal.numerator[0]].get("timed_with", ())
            if not result["timed_in_turns"]:
                result |= {
                    "met": False,
                    "why": f"{goal.numerator[0]} and {goal.denominator[0]} were not timed in turns",
                }
    return out


# -- what can run here ------------------------------------------------------------------------------------------


def runners(part: str) -> list[str]:
    """The setups a part times: one, or several in turns (`a+b@model`)."""
    return part.partition("@")[0].split("+")


def cannot_run(part: str, layers: int = LAYERS) -> str | None:
    """Why a part cannot run on this machine, in a line; None where it can (every setup of a part in turns)."""
    runner, _, model = part.partition("@")
    if "+" in runner:
        return next((why for r in runners(part) if (why := cannot_run(f"{r}@{model}", layers))), None)
    if runner == "kit-cpu":
        return "the CPU engine is timed where there is no CUDA" if torch.cuda.is_available() else None
    if runner == "bandwidth" or (runner == "floor" and model == "bundled"):
        return None
    if not torch.cuda.is_available():
        return "no CUDA here"
    if model != "bundled" and not seven_b_folder_exists(layers) and (reason := cannot_make_here()):
        return reason
    library = RUNNER_LIBRARY.get(runner) or {"exl3": "exllamav3", "exl2": "exllamav2"}.get(QUANTIZED.get(model, ""))
    if library and importlib.util.find_spec(library) is None:
        return f"{library} is not installed"
    if runner == "quantize" and model == "7b-exl2" and importlib.util.find_spec("fastparquet") is None:
        return "exllamav2's converter imports fastparquet, which is not installed"
    return None


def select(only: str | None, profile: bool) -> list[str]:
    """The parts named by --only, in run order: a part, a runner or a model names every part it is in (a model
    its profile parts only with --profile)."""
    if not only:
        return PARTS + (list(PROFILE_PARTS) if profile else [])
    every = PARTS + list(PROFILE_PARTS)
    wanted = set(only.split(","))

    def names(part: str) -> set[str]:
        model = part.partition("@")[2]
        return {part, model, *runners(part), *(f"{r}@{model}" for r in runners(part))}

    if unknown := wanted - {name for part in every for name in names(part)}:
        raise ValueError(f"--only {','.join(sorted(unknown))}: not a part, runner or model; parts: {', '.join(every)}")

    def named(part: str) -> bool:
        runner, _, model = part.partition("@")
        members = {f"{r}@{model}" for r in runners(part)} | set(runners(part))
        return bool(({part} | members) & wanted) or (model in wanted and (profile or not runner.startswith("profile-")))

    chosen = [part for part in every if named(part)]
    if any(part.startswith("floor@") for part in chosen) and "bandwidth" not in chosen:
        chosen.insert(0, "bandwidth")  # a floor is read against the copy bandwidth of the same call
    return chosen


# -- models -----------------------------------------------------------------------------------------------------


def speed_cache() -> Path:
    """Where the suite keeps its models between calls: $EXLNB_SPEED_CACHE, else the exlnb cache."""
    return Path(os.environ.get("EXLNB_SPEED_CACHE") or cache_root() / "speed")


def seven_b_folder(layers: int = LAYERS) -> Path:
    return speed_cache() / f"llama-7b-shaped-{layers}-layers"


def seven_b_folder_exists(layers: int = LAYERS) -> bool:
    return (seven_b_folder(layers) / "written.json").is_file()


def seven_b_fp16(layers: int) -> Path:
    """The 7B-shaped fp16 model (`layers` of Llama-2-7B's), written once (seeded: the same weights every time)."""
    folder = seven_b_folder(layers)
    if not seven_b_folder_exists(layers):
        written = make_random_llama(folder, tokenizer_folder(), dict(LLAMA_7B, num_hidden_layers=layers))
        os.sync()  # no page-cache writeback competing with what is timed next
        (folder / "written.json").write_text(json.dumps({"weight_bytes_read_per_token": written}))
    return folder


class NotReady(Exception):
    """A part that needs another part's result first; recorded as why, not as an error."""


def model_folder(model: str, layers: int) -> Path:
    if model == "bundled":
        return resolve_model(BUNDLED_MODEL, progress=False)
    if model == "7b-fp16":
        return seven_b_fp16(layers)
    output = QuantizedModel(seven_b_folder(layers), QUANTIZED[model], BITS, DEFAULT_HEAD_BITS).output
    if not (output / "config.json").is_file():
        raise NotReady(
            f"its {QUANTIZED[model].upper()} quantization has not finished: run quantize@{model} "
            "(it resumes where it stopped)"
        )
    return output


# -- one part ---------------------------------------------------------------------------------------------------


def quantize_within(source: Path, model: str, deadline: float, before: dict) -> dict:
    """`exlnb.quantize` in a process of its own, stopped at `deadline` (a `perf_counter` time): the converter
    resumes from its work folder on the next run."""
    target = QuantizedModel(source, QUANTIZED[model], BITS, DEFAULT_HEAD_BITS)
    code = (
        f"from exlnb.quantize import quantize; quantize({str(source)!r}, {QUANTIZED[model]!r}, {BITS}, progress=False)"
    )
    start = time.perf_counter()
    spent = before.get("seconds_so_far", 0.0)
    with subprocess.Popen([sys.executable, "-c", code], start_new_session=True) as process:
        try:
            process.wait(timeout=max(deadline - start, 1))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)  # the converter too: it is in this process group
            process.wait()
            return {
                "why": f"stopped by the budget after {spent + time.perf_counter() - start:.0f} s in all; "
                "it resumes on the next run",
                "seconds_so_far": spent + time.perf_counter() - start,
            }
    if process.returncode:
        raise RuntimeError(
            f"quantize exited with status {process.returncode}; the converter's log: {target.folder / 'convert.log'}"
        )
    return {"metrics": {"seconds": spent + time.perf_counter() - start}, "folder": str(target.output)}


def expected_s(part: str, record: dict) -> float:
    """How long a part should take: its last try's time where there was one (a quantization takes what is left);
    else a guess a little above what an H200 took on 2026-11-29 (a 7B-shaped setup of exlnb or a library 40-50 s
    in turns, transformers with its compile about 120 s)."""
    earlier = record["parts"].get(part, {})
    if part.startswith("quantize@"):
        return 60
    if "elapsed_s" in earlier and "error" not in earlier:
        return earlier["elapsed_s"]
    if part.endswith("@bundled") or part == "bandwidth":
        return 60 * len(runners(part))
    if part.startswith("floor@"):
        return 150  # floor@7b-fp16 writes the model
    return sum(150 if r == "transformers" else 60 for r in runners(part))


def run_part(part: str, record: dict, p: dict, layers: int, deadline: float) -> dict:
    runner, _, model = part.partition("@")
    if runner == "bandwidth":
        return {"metrics": {"copy_bandwidth_bytes_per_s": copy_bandwidth()}}
    try:
        if runner == "quantize":
            return quantize_within(seven_b_fp16(layers), model, deadline, record["parts"].get(part, {}))
        folder = model_folder(model, layers)
    except NotReady as reason:
        return {"why": str(reason)}
    if runner == "floor":
        weights = weight_bytes_read_per_token(folder)
        bandwidth = record["parts"]["bandwidth"]["metrics"]["copy_bandwidth_bytes_per_s"]
        return {
            "metrics": {
                "weight_bytes_read_per_token": weights,
                "copy_bandwidth_bytes_per_s": bandwidth,
                "ms_per_token": 1000 * weights / bandwidth,
            }
        }
    if runner.startswith("profile-"):
        return profile(runner, folder)
    # transformers compiles anew for each length: it is timed at the shortest context alone
    contexts = {r: p["contexts"][:1] if r == "transformers" else p["contexts"] for r in runners(part)}
    try:
        with contextlib.ExitStack() as stack:
            timed = {r: stack.enter_context(setup_apart(r, folder)) for r in runners(part)}
            return {"setups": measure(timed, p, contexts)}
    finally:
        free_memory()  # the next part loads its own models into this process


# -- the record -------------------------------------------------------------------------------------------------


def open_record(out: Path, env: dict, p: dict, layers: int, fresh: bool) -> tuple[Path, dict]:
    """Today's record on this device with the same plan and shape, to resume; else a new one."""
    stem = f"speed-{device_slug(env)}-{env['date'][:10]}"
    if not fresh:
        for path in sorted(out.glob(f"{stem}*.json"), key=lambda f: f.stat().st_mtime, reverse=True):
            record = json.loads(path.read_text())
            if record.get("plan") == p and record.get("layers") == layers:
                return path, record
    shape = dict(LLAMA_7B, num_hidden_layers=layers)
    return new_result_path(out, stem), {
        "environment": env,
        "plan": p,
        "layers": layers,
        "shape_7b": shape,
        "cache_tokens": CACHE_TOKENS,
        "bits": BITS,
        "batch": BATCH,
        "goal_definitions": {goal.name: goal.how() for goal in GOALS},
        "calls": [],
        "parts": {},
        "goals": {},
    }


def save(path: Path, record: dict) -> None:
    """The record with its goals and what it still lacks that some machine could run (`complete` once nothing)."""
    record["goals"] = goals(record["parts"])
    record["remaining"] = [
        part
        for part in record["parts_asked"]
        if "metrics" not in record["parts"].get(part, {}) and not record["parts"].get(part, {}).get("cannot_run")
    ]
    record["complete"] = not record["remaining"]
    write_json(path, record, indent=2)


def figure(path: Path, record: dict) -> Path | None:
    """Batch-1 ms/token at the shortest context, per model and setup, beside each model's floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    context = record["plan"]["contexts"][0]
    metric = f"ms_per_token_{context}"
    rows = [(part, r["metrics"][metric]) for part, r in record["parts"].items() if metric in r.get("metrics", {})]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
    ax.barh([part for part, _ in rows], [ms for _, ms in rows], color="#4c72b0")
    for i, (part, _) in enumerate(rows):
        floor = record["parts"].get(f"floor@{part.partition('@')[2]}", {}).get("metrics", {}).get("ms_per_token")
        if floor:
            ax.plot([floor, floor], [i - 0.4, i + 0.4], color="#c44e52", linewidth=2)
    ax.invert_yaxis()
    ax.set_xlabel(f"batch-1 decode, ms/token at {context} tokens of context (red: weights / copy bandwidth)")
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m benchmarks speed", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs, to check that every part runs")
    parser.add_argument(
        "--only", help="comma separated parts, runners or models (e.g. 7b-exl3, transformers, kit-exllamav2@7b-fp16)"
    )
    parser.add_argument("--profile", action="store_true", help="also profile one 7B-shaped decode token per engine")
    parser.add_argument("--layers", type=int, default=LAYERS, help="layers of the 7B shape (32: Llama-2-7B's)")
    parser.add_argument("--budget-s", type=float, default=540, help="start no part after this many seconds")
    parser.add_argument("--fresh", action="store_true", help="start a new record instead of resuming today's")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    try:
        parts = select(args.only, args.profile)
    except ValueError as error:
        parser.error(str(error))
    reasons = {part: cannot_run(part, args.layers) for part in dict.fromkeys(PARTS + parts)}
    if args.only and all(reasons[part] for part in parts):
        why = "; ".join(f"{part}: {reasons[part]}" for part in parts)
        parser.exit(2, f"python -m benchmarks speed: {why}\n")
    env = environment()
    path, record = open_record(args.out, env, plan(args.quick), args.layers, args.fresh)
    for part, why in reasons.items():  # what this machine cannot run is said for every part, asked or not
        model = part.partition("@")[2]
        for name in dict.fromkeys([part, *(f"{r}@{model}" for r in runners(part))]):  # and for its setups
            if why and "metrics" not in record["parts"].get(name, {}):
                record["parts"][name] = {"why": why, "cannot_run": True}
    record["parts_asked"] = list(dict.fromkeys(record.get("parts_asked", []) + PARTS + parts))  # --profile's too
    run_call(path, record, [part for part in parts if not reasons[part]], env, args)
    png = figure(path, record)
    for name, goal in record["goals"].items():
        said = (
            f"{goal['ratio']:.3f} ({'met' if goal['met'] else 'missed'})"
            if goal["ratio"] is not None
            else (f"not measured ({goal['why']})")
        )
        print(f"  {name}: {said}")
    if record["remaining"]:
        print(f"not done yet (run again to resume): {', '.join(record['remaining'])}")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return path


def run_call(path: Path, record: dict, parts: list[str], env: dict, args: argparse.Namespace) -> None:
    """This call's share of the record: the parts not measured yet, each saved as it ends, until the budget."""
    started, call = time.perf_counter(), len(record["calls"])
    record["calls"].append({key: env[key] for key in ("date", "device", "exlnb_commit", "load_average_1min")})
    done = record["calls"][call]["parts"] = []
    for part in parts:
        if "metrics" in record["parts"].get(part, {}):
            continue
        if done and time.perf_counter() - started + expected_s(part, record) > args.budget_s:
            break  # the next call resumes here; each call runs at least one part
        print(f"speed: {part} ...", flush=True)
        record["parts"][part] = record["parts"].get(part, {}) | {  # what a call killed at its time limit leaves
            "why": f"started in call {call}, which ended before it did",
            "call": call,
        }
        save(path, record)
        begin = time.perf_counter()
        result = _or_its_error(lambda: run_part(part, record, record["plan"], args.layers, started + args.budget_s))
        stamp = {"call": call, "elapsed_s": time.perf_counter() - begin}
        setups = result.pop("setups", {})
        record["parts"][part] = result | stamp | ({"metrics": {"setups_timed": len(setups)}} if setups else {})
        model = part.partition("@")[2]
        if "error" in result and len(runners(part)) > 1:  # each setup says why it has no numbers
            setups = {r: {"why": f"{part} failed: {result['error']}"} for r in runners(part)}
        for runner, measured in setups.items():  # each setup's record, as a goal reads it
            record["parts"][f"{runner}@{model}"] = (
                measured | stamp | {"timed_with": [other for other in setups if other != runner]}
            )
        done.append(part)
        save(path, record)
    save(path, record)


if __name__ == "__main__":
    main()
