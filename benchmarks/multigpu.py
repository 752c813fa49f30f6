"""Several GPUs of one host: a model larger than one card, loaded split, and the 7B-shaped model on one card,
split over two, and tensor parallel over two (and four): greedy agreement and decode speed.

    python -m benchmarks multigpu [--engines exllamav2,exllamav3] [--out benchmarks/results]

exlnb grows no distributed engine of its own: it drives each library's layer split (`gpu_split`) and tensor
parallelism (`tensor_parallel`, exllamav2's `load_tp`, exllamav3's `tensor_p`). This suite says what those give
through exlnb's session. It writes `multigpu-<device>-<date>.json` with the raw numbers and a `goals` object
(each goal `{"ratio": x, "met": bool}`, from the engine that reaches furthest, every engine's beside it), and a
figure beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import allreduce
from benchmarks.decode import GREEDY, aggregate_throughput, random_prompt, session_decode
from benchmarks.harness import device_slug, environment
from exlnb import get_session
from exlnb.engines.library_engine import used_per_gpu
from exlnb.engines.registry import engine_spec
from exlnb.experiments.record import write_atomically
from exlnb.random_model import LLAMA_7B, random_llama, shape_larger_than, tokenizer_folder

LARGER_THAN_CARD = 1.2  # the goal: a model at least this many times one card's memory
LARGE_MODEL_RATIO = 1.22  # what the suite writes, a little above the goal
GREEDY_TOKENS = 64
DECODE_TOKENS = 128
BATCH = 8
GOALS = {  # name -> (what is compared, at least, the engine it is asked of or None for the best)
    "tp2_7b_batch1_speedup_at_least_1.5": ("tp2", "batch1_tokens_per_s", 1.5, None),
    "tp2_7b_batch8_speedup_at_least_1.6": ("tp2", "batch8_tokens_per_s", 1.6, None),
    "tp4_7b_batch1_speedup_at_least_2.2": ("tp4", "batch1_tokens_per_s", 2.2, None),
    "split2_over_one_card_batch1_at_least_0.9": ("split2", "batch1_tokens_per_s", 0.9, "exllamav2"),
}


def layouts(gpus: int, card_gib: float, model_gib: float, backends: tuple[str, ...] = ()) -> dict[str, dict]:
    """How the 7B-shaped model is laid out: `load()` keywords per layout. The split puts about half of the
    layers on each of the first two cards (exllamav2 fills a card up to its share, then the next). Tensor
    parallelism runs with the library's default all-reduce, and again with each other one it has (`backends`,
    the engine's, its default first): "tp2-nccl"."""
    ways = {
        "one_card": dict(gpu_split=None),
        "split2": dict(gpu_split=(round(model_gib / 2, 1), math.floor(card_gib))),
    }
    for cards in (2, 4) if gpus >= 4 else (2,):
        ways[f"tp{cards}"] = dict(gpu_split=(math.floor(card_gib),) * cards, tensor_parallel=True)
        for backend in backends[1:]:
            ways[f"tp{cards}-{backend}"] = dict(ways[f"tp{cards}"], tp_backend=backend)
    return ways


def cards_of(name: str) -> int | None:
    """How many cards a tensor-parallel layout spreads each layer over ("tp4-nccl": 4); None for the others."""
    return int(name[2:].split("-")[0]) if name.startswith("tp") else None


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def memory_per_gpu() -> list[float]:
    """GiB in use on each GPU, as the driver counts it (every process and library allocator included)."""
    return [round(used / 2**30, 2) for used in used_per_gpu()]


def measure_layout(folder: Path, engine: str, load_options: dict, repeats: int) -> dict:
    """Load one layout, take its greedy tokens and its decode speed at batch 1 and batch 8, unload."""
    session = get_session()
    row: dict = {"load_options": dict(load_options)}
    start = time.perf_counter()
    session.load(str(folder), engine=engine, cache_tokens=8192, max_batch_size=BATCH, progress=False, **load_options)
    row["load_s"] = time.perf_counter() - start
    row["status"] = session.status().line()
    row["memory_gib_per_gpu"] = memory_per_gpu()
    try:
        prompt = random_prompt(32, seed=1)
        result = session.complete(prompt, max_new_tokens=GREEDY_TOKENS, sampler=GREEDY, stop_at_eos=False)
        row["greedy_tokens"] = list(result.token_ids)
        session_decode(session, random_prompt(64, seed=2), 16)  # warm-up: graphs captured, kernels tuned
        aggregate_throughput(session, BATCH, 16, seed=3)  # and at batch 8 (its first timed run once held a capture)
        batch1 = [
            session_decode(session, random_prompt(64, seed=10 + i), DECODE_TOKENS).decode_tokens_per_s
            for i in range(repeats)
        ]
        batch8 = [aggregate_throughput(session, BATCH, DECODE_TOKENS, seed=20 + i) for i in range(repeats)]
        row["batch1_tokens_per_s_samples"] = batch1
        row["batch8_tokens_per_s_samples"] = batch8
        row["batch1_tokens_per_s"] = statistics.median(batch1)
        row["batch8_tokens_per_s"] = statistics.median(batch8)
    finally:
        session.unload()
    return row


def measure_layouts(
    folder: Path,
    engine: str,
    gpus: int,
    card_bytes: int,
    weight_bytes: int,
    repeats: int,
    *,
    only_tensor_parallel: bool = False,
) -> dict:
    """Every layout of one engine on one model, and how far each layout's greedy tokens agree with one card's."""
    data: dict = {"layouts": {}, "agreement": {}}
    ways = layouts(gpus, card_bytes / 2**30, weight_bytes / 2**30, engine_spec(engine).tensor_parallel_backends)
    for name, options in ways.items():
        if only_tensor_parallel and name == "split2":
            continue
        say(f"{engine}: {folder.name}, {name}")
        try:
            data["layouts"][name] = measure_layout(folder, engine, options, repeats)
        except Exception as error:
            data["layouts"][name] = {"load_options": options, "error": f"{type(error).__name__}: {error}"}
            say(f"{engine} {name}: {data['layouts'][name]['error']}")
        say(
            json.dumps(
                {k: v for k, v in data["layouts"][name].items() if not k.endswith("samples") and k != "greedy_tokens"}
            )
        )
    reference = data["layouts"].get("one_card", {}).get("greedy_tokens")
    for name, row in data["layouts"].items():
        if reference and name != "one_card" and "greedy_tokens" in row:
            data["agreement"][name] = agreement(reference, row["greedy_tokens"])
    return data


def nccl_timings(gpus: int) -> dict[int, dict[str, float]]:
    """NCCL's all-reduce of one step's hidden state (7B-shaped, fp16) at batch 1 and 8, over 2 (and 4) cards."""
    out = {}
    for cards in (2, 4) if gpus >= 4 else (2,):
        say(f"NCCL all-reduce over {cards} cards")
        out[cards] = {
            f"batch{rows}": allreduce.nccl_allreduce_us(cards, rows, LLAMA_7B["hidden_size"]) for rows in (1, BATCH)
        }
    return out


def agreement(reference: list[int], other: list[int]) -> dict:
    """How far two greedy runs agree: the first position where they part, and the share of equal positions."""
    same = [a == b for a, b in zip(reference, other)]
    first = same.index(False) if False in same else len(same)
    return {"equal_positions": sum(same), "of": len(same), "first_difference": first}


def measure_larger_model(engines: list[str], card_bytes: int, gpus: int) -> dict[str, dict]:
    """A model larger than one card, written once: on each engine, loaded split over the cards it needs (and
    tensor parallel over all of them where there are four), asked a question through the API and streamed
    through `%%exl_generate`."""
    from IPython.core.interactiveshell import InteractiveShell

    vocab = json.loads((tokenizer_folder() / "config.json").read_text())["vocab_size"]
    shape = shape_larger_than(card_bytes, LARGE_MODEL_RATIO, vocab)
    say(f"writing a {shape['num_hidden_layers']}-layer Llama-70B-wide model")
    outs: dict[str, dict] = {}
    with random_llama(shape, distinct_layers=False) as (folder, weight_bytes):
        session = get_session()
        shell = InteractiveShell.instance()
        shell.extension_manager.load_extension("exlnb")
        ways = (("split", dict(gpu_split=None)), *((("tp4", dict(tensor_parallel=True)),) if gpus >= 4 else ()))
        for engine, (name, options) in ((engine, way) for engine in engines for way in ways):
            out = outs.setdefault(
                engine, {"shape": shape, "weights_bytes": weight_bytes, "ratio_to_one_card": weight_bytes / card_bytes}
            )
            say(f"{engine}: larger model, {name}")
            row: dict = {}
            out[name] = row
            try:
                start = time.perf_counter()
                session.load(
                    str(folder), engine=engine, cache_tokens=4096, max_batch_size=BATCH, progress=False, **options
                )
                row["load_s"] = time.perf_counter() - start
                row["status"] = session.status().line()
                row["memory_gib_per_gpu"] = memory_per_gpu()
                answer = session.complete(
                    "The capital of France is", max_new_tokens=16, sampler=GREEDY, stop_at_eos=False
                )
                row["answer_tokens"] = answer.new_tokens
                row["answer_decode_tokens_per_s"] = answer.decode_tokens_per_s
                shell.user_ns.pop("streamed", None)
                shell.run_cell_magic(
                    "exl_generate",
                    "--max-new-tokens 16 --display text --template raw --out streamed",
                    "The capital of France is",
                )
                streamed = shell.user_ns.get("streamed")
                row["magic_new_tokens"] = streamed.new_tokens if streamed is not None else 0
                row["batch1_tokens_per_s"] = session_decode(
                    session, random_prompt(64, seed=3), DECODE_TOKENS
                ).decode_tokens_per_s
            except Exception as error:  # one layout failing says why and leaves the others to run
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            finally:
                session.unload()
            say(json.dumps(row))
    return outs


def goals_from(engines: dict[str, dict], gpus: int) -> dict:
    """Each goal from the engine that reaches furthest towards it, naming that engine and every engine's ratio:
    the libraries differ in what they can split (exllamav2 0.3.2 splits only quantized weights with tensor
    parallelism), and the goal asks what exlnb can give, on whichever engine gives it."""
    candidates: dict[str, dict[str, dict]] = {}
    for engine, data in engines.items():
        large = data.get("larger_model", {})
        split = large.get("split", {})
        ratio = large.get("ratio_to_one_card")
        answered = split.get("answer_tokens", 0) > 0 and split.get("magic_new_tokens", 0) > 0
        candidates.setdefault("split_model_larger_than_one_card_answers", {})[engine] = (
            {"ratio": ratio, "met": answered and ratio is not None and ratio >= LARGER_THAN_CARD}
            if ratio is not None
            else {"ratio": None, "met": False, "why": split.get("error", "not run")}
        )
        for name, (layout, key, least, asked_of) in GOALS.items():
            if (layout == "tp4" and gpus < 4) or asked_of not in (None, engine):
                continue
            one, other = data["layouts"].get("one_card", {}), data["layouts"].get(layout, {})
            if key in one and key in other:
                value = other[key] / one[key]
                candidates.setdefault(name, {})[engine] = {"ratio": value, "met": value >= least}
            else:
                candidates.setdefault(name, {})[engine] = {
                    "ratio": None,
                    "met": False,
                    "why": other.get("error") or one.get("error"),
                }
        agreed = data.get("agreement", {}).get("split2")
        candidates.setdefault("split_greedy_matches_one_card", {})[engine] = (
            {"ratio": agreed["equal_positions"] / agreed["of"], "met": agreed["equal_positions"] == agreed["of"]}
            if agreed
            else {"ratio": None, "met": False, "why": "no split run to compare"}
        )
    goals = {}
    for name, by_engine in candidates.items():
        measured = {e: g for e, g in by_engine.items() if g["ratio"] is not None}
        best = max(measured, key=lambda e: measured[e]["ratio"]) if measured else next(iter(by_engine))
        goals[name] = {**by_engine[best], "engine": best, "by_engine": by_engine}
    return goals


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "batch1_tokens_per_s", "batch 1"), (axes[1], "batch8_tokens_per_s", "batch 8")):
        labels, values = [], []
        for engine, data in result["engines"].items():
            for name, row in data["layouts"].items():
                if key in row:
                    labels.append(f"{engine}\n{name}")
                    values.append(row[key])
        ax.bar(range(len(values)), values, color="C0")
        ax.set_xticks(range(len(values)), labels, fontsize=7)
        ax.set(ylabel="tokens/s", title=f"7B-shaped fp16, {title}")
    fig.suptitle(result["environment"].get("device", ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save(result: dict, path: Path) -> None:
    """The record so far, replacing the last one whole; its ratios may be NaN where a layout did not run."""
    write_atomically(path, json.dumps(result, indent=2, default=str))


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m benchmarks multigpu", description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="exllamav2", help="comma-separated: exllamav2, exllamav3")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-large", action="store_true", help="leave out the model larger than one card")
    parser.add_argument(
        "--exl3",
        type=Path,
        help="an EXL3 7B-shaped folder (the speed suite's) to split too, "
        "one card against tensor parallelism with each all-reduce",
    )
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        sys.exit(f"python -m benchmarks multigpu needs two or more CUDA GPUs; this machine has {gpus}")
    card_bytes = min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus))
    env = environment()
    result: dict = {
        "environment": env,
        "gpus": [
            {"name": torch.cuda.get_device_name(i), "memory_bytes": torch.cuda.get_device_properties(i).total_memory}
            for i in range(gpus)
        ],
        "engines": {},
    }
    engines = [name for name in args.engines.split(",") if name]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"multigpu-{device_slug(env)}-x{gpus}-{env['date'][:10]}-{'-'.join(engines)}"
    path = args.out / f"{stem}.json"
    with random_llama(LLAMA_7B) as (folder, weight_bytes):
        result["seven_b_weights_bytes"] = weight_bytes
        for engine in engines:
            result["engines"][engine] = measure_layouts(folder, engine, gpus, card_bytes, weight_bytes, args.repeats)
            result["engines"][engine]["layers"] = LLAMA_7B["num_hidden_layers"]
            save(result, path)  # what has run survives a time limit
    if args.exl3:
        exl3_bytes = sum(f.stat().st_size for f in args.exl3.glob("*.safetensors"))
        result["exl3"] = {
            "folder": str(args.exl3),
            "layers": json.loads((args.exl3 / "config.json").read_text())["num_hidden_layers"],
            **measure_layouts(
                args.exl3, "exllamav3", gpus, card_bytes, exl3_bytes, args.repeats, only_tensor_parallel=True
            ),
        }
        save(result, path)
    measured = [*result["engines"].values(), *([result["exl3"]] if "exl3" in result else [])]
    nccl_us = nccl_timings(gpus) if any("-nccl" in n for data in measured for n in data["layouts"]) else {}
    result["nccl_allreduce_us"] = nccl_us
    for data in measured:
        data["tensor_parallel_check"] = allreduce.check(
            data["layouts"],
            layers=data["layers"],
            cards_of={name: cards_of(name) for name in data["layouts"] if cards_of(name)},
            nccl_us=nccl_us,
        )
    if not args.skip_large:
        for engine, large in measure_larger_model(engines, card_bytes, gpus).items():
            result["engines"][engine]["larger_model"] = large
    result["goals"] = goals_from(result["engines"], gpus)
    save(result, path)
    plot(result, args.out / f"{stem}.png")
    say(f"wrote {path}")
    say(json.dumps(result["goals"], indent=1))
    return path


if __name__ == "__main__":
    main()
