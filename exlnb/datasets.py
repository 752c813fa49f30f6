"""The prompts and question sets in the repository's `data/` folder, read the same way everywhere."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from exlnb.engines.base import Tokenizer

DATA_DIR = Path(__file__).resolve().parents[1] / "data"


def data_file(relative: str) -> Path:
    path = DATA_DIR / relative
    if not path.is_file():
        raise FileNotFoundError(
            f"no data file at {path}: the investigations read prompts from the data/ folder of an exlnb "
            "checkout; run them from a clone of the repository"
        )
    return path


def load_prompts(name: str) -> list[str]:
    """`data/prompts/<name>.json`: {"description": ..., "prompts": [...]}."""
    return list(json.loads(data_file(f"prompts/{name}.json").read_text())["prompts"])


def load_questions(name: str = "short_answers") -> pd.DataFrame:
    """`data/questions/<name>.csv`: id, question, answers (accepted answers separated by "|"), topic."""
    table = pd.read_csv(data_file(f"questions/{name}.csv"))
    table["answers"] = table["answers"].str.split("|")
    return table


def filler_ids(tokenizer: Tokenizer, length: int, *, label: str) -> list[int]:
    """A prompt of exactly `length` tokens of ordinary text, starting with `label` so that no two prompts
    share a cached prefix (a shared prefix would skip the prefill being measured)."""
    sentences = [*load_questions().question, *load_prompts("long_answers")]
    text, n, chars = label + ".", 0, 5 * length  # about 4 characters per token: usually one encode is enough
    while True:
        while len(text) < chars:
            text += f" Note {n}: {sentences[n % len(sentences)]}"
            n += 1
        ids = tokenizer.encode(text, special=False)
        if len(ids) >= length:
            return ids[:length]
        chars *= 2
