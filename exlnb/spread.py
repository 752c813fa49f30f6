"""How much each investigation's effects moved across runs, and which of them every run agrees on.

    python -m exlnb.spread RUN [RUN ...] [--out FILE]

A RUN is a folder holding the investigations' JSON summaries, as `--publish` writes them (`data/results/gpu/`)
or as `python -m exlnb.report --out DIR` leaves them (`DIR/<notebook>/<notebook>.json`). For every effect that
at least two runs measured: the range of its two sides and of their ratio across runs, and each run's verdict
(the symptom's 95% interval wholly above the fix's, wholly below, or overlapping it). A finding stands only
where every run gives the same verdict; one machine start can be an outlier (a GPU host slower than the
last, a CPU shared with other work), which is why GPU findings are stated from several.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from exlnb.experiments.notebooks import NOTEBOOKS
from exlnb.experiments.record import read_summary, write_atomically

VERDICTS = ("higher", "lower", "overlap")  # the symptom's interval against the fix's


@dataclass(frozen=True)
class Measured:
    """One effect as one run measured it."""

    run: str
    symptom: float
    fix: float
    ratio: float | None
    verdict: str


def verdict(effect: dict) -> str:
    """ "higher" or "lower" where the two 95% intervals do not overlap, else "overlap"."""
    (s_low, s_high), (f_low, f_high) = effect["symptom"]["ci95"], effect["fix"]["ci95"]
    if s_low > f_high:
        return "higher"
    if s_high < f_low:
        return "lower"
    return "overlap"


def effect_key(effect: dict) -> str:
    """An effect's name with its two sides: one notebook measures one quantity under several comparisons."""
    return f"{effect['name']}, {effect['symptom_label']} -> {effect['fix_label']}"


def summaries(run: Path) -> dict[str, dict]:
    """The investigations' summaries in one run folder, by notebook name."""
    found = {}
    for name in NOTEBOOKS:
        for path in (run / f"{name}.json", run / name / f"{name}.json"):
            if path.is_file():
                summary, error = read_summary(path)
                if error:
                    print(f"skipping {name} in {run}: {error}", file=sys.stderr)
                else:
                    found[name] = summary
                break
    if not found:
        raise FileNotFoundError(
            f"{run} holds no investigation summary (<notebook>.json): give a --publish folder "
            "or a report's --out folder"
        )
    return found


def spread(runs: list[Path]) -> list[dict]:
    """One row per (notebook, effect) measured by at least two runs, in notebook order."""
    by_run = {str(run): summaries(run) for run in runs}
    rows = []
    for name in NOTEBOOKS:
        effects: dict[str, list[Measured]] = {}
        environments = set()
        for run, found in by_run.items():
            if name not in found:
                continue
            env = found[name].get("environment", {})
            environments.add((env.get("engine"), env.get("model"), env.get("device")))
            for effect in found[name]["effects"]:
                ratio = (effect.get("ratio") or {}).get("value")
                effects.setdefault(effect_key(effect), []).append(
                    Measured(run, effect["symptom"]["value"], effect["fix"]["value"], ratio, verdict(effect))
                )
        for effect_name, measured in effects.items():
            if len(measured) < 2:
                continue
            verdicts = [m.verdict for m in measured]
            ratios = [m.ratio for m in measured if m.ratio is not None]
            rows.append(
                {
                    "notebook": name,
                    "effect": effect_name,
                    "runs": len(measured),
                    "symptom": [min(m.symptom for m in measured), max(m.symptom for m in measured)],
                    "fix": [min(m.fix for m in measured), max(m.fix for m in measured)],
                    "ratio": [min(ratios), max(ratios)] if ratios else None,
                    "verdicts": verdicts,
                    "agree": len(set(verdicts)) == 1,
                    "mixed_setups": len(environments) > 1,  # engine, model or device differ between the runs
                }
            )
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| notebook | effect | runs | symptom | fix | ratio | verdicts | all agree |", "|---" * 8 + "|"]
    for row in rows:
        ratio = "" if row["ratio"] is None else _range(row["ratio"], "x")
        agree = ("yes" if row["agree"] else "**no**") + (" (mixed setups)" if row["mixed_setups"] else "")
        lines.append(
            f"| {row['notebook']} | {row['effect']} | {row['runs']} | {_range(row['symptom'])} | "
            f"{_range(row['fix'])} | {ratio} | {', '.join(row['verdicts'])} | {agree} |"
        )
    return "\n".join(lines)


def _range(values: list[float], unit: str = "") -> str:
    low, high = values
    return f"{low:.3g}{unit}" if low == high else f"{low:.3g}-{high:.3g}{unit}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exlnb.spread", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="folders of investigation summaries, one per run")
    parser.add_argument("--out", type=Path, help="also write the table (markdown) and FILE.json with every row")
    args = parser.parse_args(argv)
    if len(args.runs) < 2:
        parser.exit(2, "exlnb.spread: give at least two runs; a spread needs more than one\n")
    try:
        rows = spread(args.runs)
    except FileNotFoundError as error:
        parser.exit(2, f"exlnb.spread: {error}\n")
    text = markdown(rows)
    print(text)
    if args.out:
        write_atomically(args.out, text + "\n")
        write_atomically(args.out.with_suffix(".json"), json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
