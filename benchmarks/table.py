"""The performance table, ratios first, generated from result files: for the README and after every run.

python -m benchmarks table [--out FILE]     # every full run under benchmarks/results, as markdown
"""

from __future__ import annotations

import argparse
import json
import operator
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from exlnb.engines.registry import engine_names, engine_spec

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Target:
    compare: str  # ">=" or "<="
    value: float

    def met(self, measured: float) -> bool:
        return {">=": operator.ge, "<=": operator.le}[self.compare](measured, self.value)

    def __str__(self) -> str:
        return f"{self.compare} {self.value:g}"


@dataclass(frozen=True)
class Row:
    label: str
    read: Callable[[dict], float | str]
    gpu: Target | None = None  # the targets: the GPU run (ExLlamaV2 engine) and the CPU run
    cpu: Target | None = None


RATIOS = [
    Row(
        "kit stream / raw generator, decode tokens/s",
        lambda b: b["kit"]["ratio_decode_session_over_raw"],
        gpu=Target(">=", 0.97),
    ),
    Row(
        "session TTFT - raw generator TTFT, ms",
        lambda b: b["kit"]["ttft_overhead_ms"],
        gpu=Target("<=", 20),
        cpu=Target("<=", 20),
    ),
    Row(
        "`%%exl_generate` TTFT - raw generator TTFT, ms",
        lambda b: b["kit"]["magic"]["ttft_overhead_ms"],
        gpu=Target("<=", 20),
        cpu=Target("<=", 20),
    ),
    Row(
        "token view on (5 alternatives) / off, decode tokens/s",
        lambda b: b["kit"]["token_view"]["ratio_decode_on_over_off"],
    ),
    Row(
        "engine / transformers `generate`, decode tokens/s",
        lambda b: b["peer"]["ratio_decode_engine_over_hf"],
        gpu=Target(">=", 2.0),
        cpu=Target(">=", 0.9),
    ),
    Row("engine / transformers, prefill tokens/s", lambda b: b["peer"]["ratio_prefill_engine_over_hf"]),
    Row(
        "engine / exllamav3's own generator, decode tokens/s", lambda b: b["peer"]["ratio_decode_engine_over_exllamav3"]
    ),
    Row(
        "engine / exllamav3's own generator, prefill tokens/s",
        lambda b: b["peer"]["ratio_prefill_engine_over_exllamav3"],
    ),
    Row(
        "aggregate tokens/s at 8 jobs, engine / ExLlamaV3 engine",
        lambda b: (
            b["concurrency"]["aggregate_tokens_per_s"]["8"]["median"]
            / b["peer"]["exllamav3_engine"]["aggregate_tokens_per_s"]["8"]["median"]
        ),
    ),
    Row(
        "7B-shaped decode / weights-over-bandwidth floor",
        lambda b: b["hardware"]["ratio_over_floor"],
        gpu=Target("<=", 1.5),
    ),
    Row(
        "7B-shaped decode unpaged (exllamav2's own attention) / floor",
        lambda b: b["hardware"]["unpaged"]["ratio_over_floor"],
        gpu=Target("<=", 1.5),
    ),
    Row("7B-shaped decode, ExLlamaV3 engine / floor", lambda b: b["hardware"]["exllamav3_engine"]["ratio_over_floor"]),
    Row("7B-shaped GPU kernel time / floor (profiler)", lambda b: b["hardware"]["profile_kernel_ms_over_floor"]),
    Row("aggregate tokens/s, 4 jobs / 1 job", lambda b: b["concurrency"]["ratio_4_over_1"], cpu=Target(">=", 1.5)),
]


def _median_iqr(stats: dict) -> str:
    return f"{stats['median']:.1f} ± {stats['iqr'] / 2:.1f}"


RAW = [
    Row(
        "decode tokens/s through the session / by hand",
        lambda b: " / ".join(_median_iqr(b["kit"][side]["decode_tokens_per_s"]) for side in ("session", "raw")),
    ),
    Row(
        "TTFT ms through the session / by hand",
        lambda b: " / ".join(f"{1000 * b['kit'][side]['ttft_s']['median']:.1f}" for side in ("session", "raw")),
    ),
    Row(
        "decode tokens/s with the token view off / on",
        lambda b: " / ".join(_median_iqr(b["kit"]["token_view"][side]) for side in ("off", "on")),
    ),
    Row(
        "decode tokens/s, engine / transformers",
        lambda b: " / ".join(
            _median_iqr(b["peer"][k]) for k in ("engine_decode_tokens_per_s", "hf_decode_tokens_per_s")
        ),
    ),
    Row(
        "prefill tokens/s, engine / transformers",
        lambda b: (
            f"{b['peer']['prefill_prompt_tokens']} tokens: "
            + " / ".join(
                f"{b['peer'][k]['median']:.0f}" for k in ("engine_prefill_tokens_per_s", "hf_prefill_tokens_per_s")
            )
        ),
    ),
    Row(
        "decode tokens/s at the shortest / longest context",
        lambda b: " / ".join(
            f"{row['context_tokens']}: {row['decode_tokens_per_s']['median']:.1f}"
            for row in (b["context"]["rows"][0], b["context"]["rows"][-1])
        ),
    ),
    Row(
        "7B-shaped ms/token (floor)",
        lambda b: f"{b['hardware']['ms_per_token']['median']:.1f} ({b['hardware']['floor_ms_per_token']:.2f})",
    ),
    Row("7B-shaped ms/token, unpaged", lambda b: f"{b['hardware']['unpaged']['ms_per_token']['median']:.1f}"),
    Row(
        "7B-shaped ms/token, ExLlamaV3 engine",
        lambda b: f"{b['hardware']['exllamav3_engine']['ms_per_token']['median']:.1f}",
    ),
    Row(
        "aggregate tokens/s at 1 / 2 / 4 / 8 jobs",
        lambda b: " / ".join(f"{v['median']:.1f}" for v in b["concurrency"]["aggregate_tokens_per_s"].values()),
    ),
    Row(
        "ExLlamaV3 engine, aggregate tokens/s at 1 / 8 jobs",
        lambda b: " / ".join(
            f"{v['median']:.1f}" for v in b["peer"]["exllamav3_engine"]["aggregate_tokens_per_s"].values()
        ),
    ),
]


def full_runs(folder: Path = RESULTS) -> list[dict]:
    """Every full (not --quick) run of `python -m benchmarks` in the folder, oldest first."""
    runs = []
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        if "benchmarks" in record and not record.get("quick"):
            runs.append({**record, "file": path.name})
    return sorted(runs, key=lambda r: r["environment"]["date"])


def _cell(row: Row, run: dict) -> str:
    try:
        value = row.read(run["benchmarks"])
    except KeyError:
        return "not run"
    if isinstance(value, str):
        return value
    target = row.gpu if _on_gpu(run) else row.cpu
    verdict = "" if target is None else (" met" if target.met(value) else " **missed**")
    return f"{value:.2f}{verdict}"


def _on_gpu(run: dict) -> bool:
    """Whether a run's engine (its status line's first word) is one that needs CUDA, as the registry says."""
    name = run["engine"].split()[0]
    return name in engine_names() and engine_spec(name).needs_cuda


def markdown(runs: list[dict]) -> str:
    days = [r["environment"]["date"][:10] for r in runs]
    when = [
        r["environment"]["date"][:16].replace("T", " ") + " UTC" if days.count(day) > 1 else day
        for r, day in zip(runs, days)
    ]
    heads = [f"{r['engine'].split(' |')[0]}, {r['environment']['device']}, {w}" for r, w in zip(runs, when)]
    lines = [
        "| ratio (same machine, same run) | " + " | ".join(heads) + " | target GPU | target CPU |",
        "|---" * (len(runs) + 3) + "|",
    ]
    for row in RATIOS:
        cells = [_cell(row, r) for r in runs] + [str(row.gpu or ""), str(row.cpu or "")]
        lines.append(f"| {row.label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| medians (± half the interquartile range) | " + " | ".join(heads) + " |",
        "|---" * (len(runs) + 1) + "|",
    ]
    for row in RAW:
        lines.append(f"| {row.label} | " + " | ".join(_cell(row, r) for r in runs) + " |")
    lines += ["", "Sources: " + ", ".join(f"`benchmarks/results/{r['file']}`" for r in runs) + "."]
    skipped = {f"{head}: {name}": why for head, r in zip(heads, runs) for name, why in r.get("skipped", {}).items()}
    skipped |= {
        f"{head}: magic": r["benchmarks"]["kit"]["magic"]["skipped"]
        for head, r in zip(heads, runs)
        if "skipped" in r["benchmarks"].get("kit", {}).get("magic", {})
    }
    lines += [f"Not run: {where} ({why})." for where, why in skipped.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks table", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the markdown here as well as printing it")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of result files")
    args = parser.parse_args(argv)
    text = markdown(full_runs(args.results))
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
