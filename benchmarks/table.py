"""The README's performance table, generated from the committed result files (ratios first).

    python -m benchmarks.table            # prints markdown for every full run under benchmarks/results
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"

# (label, how to read it from a run, target for the GPU run, target for the CPU run)
RATIOS = [
    ("kit stream / raw generator, decode tokens/s", lambda b: b["kit"]["ratio_decode_session_over_raw"], ">= 0.97", ""),
    ("session TTFT overhead, ms", lambda b: b["kit"]["ttft_overhead_ms"], "<= 20", "<= 20"),
    ("engine / transformers generate, decode tokens/s", lambda b: b["peer"]["ratio_decode_engine_over_hf"], ">= 2.0", ">= 0.9"),
    ("engine / transformers, prefill tokens/s", lambda b: b["peer"]["ratio_prefill_engine_over_hf"], "", ""),
    ("7B-shaped decode / weights-over-bandwidth floor", lambda b: b["hardware"]["ratio_over_floor"], "<= 1.5", ""),
    ("aggregate tokens/s, 4 jobs / 1 job", lambda b: b["concurrency"]["ratio_4_over_1"], "", ">= 1.5"),
]

RAW = [
    ("decode tokens/s, engine through the session (peer run)", lambda b: b["peer"]["engine_decode_tokens_per_s"]["median"]),
    ("decode tokens/s, transformers generate (peer run)", lambda b: b["peer"]["hf_decode_tokens_per_s"]["median"]),
    ("prefill tokens/s (512-token prompt)", lambda b: b["peer"]["engine_prefill_tokens_per_s"]["median"]),
    ("7B-shaped ms/token (floor)", lambda b: f"{b['hardware']['ms_per_token']['median']:.1f} ({b['hardware']['floor_ms_per_token']:.2f})"),
    ("aggregate tokens/s at 1 / 2 / 4 / 8 jobs",
     lambda b: " / ".join(f"{v['median']:.1f}" for v in b["concurrency"]["aggregate_tokens_per_s"].values())),
]


def full_runs() -> list[dict]:
    runs = []
    for path in sorted(RESULTS.glob("*.json")):
        record = json.loads(path.read_text())
        if "benchmarks" in record and not record.get("quick"):
            runs.append({**record, "file": path.name})
    return runs


def _cell(read, benchmarks) -> str:
    try:
        value = read(benchmarks)
    except KeyError:
        return "not run"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def markdown(runs: list[dict]) -> str:
    heads = [f"{r['engine'].split(' |')[0]}, {r['environment']['device']}" for r in runs]
    lines = ["| ratio (same machine, same run) | " + " | ".join(heads) + " | target GPU | target CPU |",
             "|---" * (len(runs) + 3) + "|"]
    for label, read, gpu, cpu in RATIOS:
        lines.append(f"| {label} | " + " | ".join(_cell(read, r["benchmarks"]) for r in runs) + f" | {gpu} | {cpu} |")
    lines += ["", "| raw medians | " + " | ".join(heads) + " |", "|---" * (len(runs) + 1) + "|"]
    for label, read in RAW:
        lines.append(f"| {label} | " + " | ".join(_cell(read, r["benchmarks"]) for r in runs) + " |")
    lines += ["", "Sources: " + ", ".join(f"`benchmarks/results/{r['file']}`" for r in runs) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(full_runs()))
