"""The near-tie map: how far the model's top choice led its runner-up at every position, against how much this
engine's own arithmetic moves that lead.

Greedy decoding takes the argmax. Where the two likeliest tokens are nearly tied, any change in rounding (another
batch shape, another kernel, a quantized cache, another split of the model) can swap them, and the answer parts
from there (exllamav3 issue 353, vLLM's batch-invariance threads; exlnb's own tensor-parallel run parted at the
first token). The margin is the difference of the two largest logits, in nats: log p1 - log p2 of the model's two
likeliest tokens, which a token view records (`tokens=N`, N >= 2), since a softmax keeps differences of logits.
The noise floor is the largest change of a margin this engine showed when the same steps ran again another way
(`exlnb.noise_floor` measures it); a position whose margin is at or under it is marked as likely to flip.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from exlnb.engines.token_info import TokenInfo
from exlnb.token_records import TokenRecord

MARGIN_COLUMNS = ("position", "token_id", "text", "top_id", "runner_up_id", "runner_up_text", "margin", "likely_flip")


def margin(info: TokenInfo) -> float | None:
    """The model's top logit minus its second, in nats (None where fewer than two alternatives were recorded;
    infinite where the runner-up's probability underflowed to 0)."""
    if len(info.alternatives) < 2:
        return None
    (_, _, first), (_, _, second) = info.alternatives[:2]
    return math.inf if second <= 0 else math.log(first) - math.log(second)


def pair_margin(info: TokenInfo, top: int, runner_up: int) -> float | None:
    """log p(top) - log p(runner_up) in this record, for a pair another run ranked first and second: how a margin
    moved, and its sign when the two swapped; None where either token is not among the recorded alternatives."""
    probabilities = {token: p for token, _, p in info.alternatives}
    if (
        top not in probabilities
        or runner_up not in probabilities
        or min(probabilities[top], probabilities[runner_up]) <= 0
    ):
        return None
    return math.log(probabilities[top]) - math.log(probabilities[runner_up])


@dataclass(frozen=True)
class FloorComparison:
    """The same greedy steps run two ways: how far the margins moved, at the positions both runs shared (up to and
    including each probe's first parting, after which they follow different text)."""

    name: str  # "alone against a batch of 8", "decode against a whole-sequence pass", ...
    probes: int
    positions: int
    max_shift: float  # the largest |margin change|, nats
    parted: int  # probes whose greedy tokens parted

    def line(self) -> str:
        return (
            f"{self.name}: largest margin shift {self.max_shift:.3g} nats over {self.positions} positions, "
            f"{self.parted} of {self.probes} probes parted"
        )


@dataclass(frozen=True)
class NoiseFloor:
    """How much this engine's arithmetic moves a margin, measured on one loaded model: each comparison made, and
    one line for those it could not make here."""

    engine: str
    model: str
    comparisons: tuple[FloorComparison, ...]
    not_compared: str = ""  # "not compared here: ..." in one line, or empty

    @property
    def value(self) -> float:
        """The largest shift of any comparison, nats: a margin at or under it may flip on this engine."""
        if not self.comparisons:
            raise ValueError(f"no comparison measured a noise floor on the {self.engine} engine: {self.not_compared}")
        return max(c.max_shift for c in self.comparisons)

    def table(self) -> str:
        lines = [f"noise floor on the {self.engine} engine ({self.model}): {self.value:.3g} nats"]
        lines += [f"  {c.line()}" for c in self.comparisons]
        return "\n".join([*lines, *([f"  {self.not_compared}"] if self.not_compared else [])])

    def __float__(self) -> float:
        return self.value


def floor_value(floor: float | NoiseFloor) -> float:
    """A floor as given: a NoiseFloor, or a number of nats (0 or more)."""
    if isinstance(floor, bool) or not isinstance(floor, (int, float, NoiseFloor)):
        raise TypeError(f"floor={floor!r}: give a NoiseFloor (exlnb.noise_floor.noise_floor(session)) or nats")
    value = float(floor)
    if not value >= 0:
        raise ValueError(f"floor={value}: a noise floor is a margin shift in nats, 0 or more")
    return value


def margin_rows(records: Sequence[TokenRecord], floor: float | None) -> list[tuple]:
    """One row per generated token (MARGIN_COLUMNS), `likely_flip` where its margin is at or under `floor`."""
    if not records:
        raise ValueError(
            "this result has no per-token data: generate with tokens=2 or more (--tokens 2) to map margins"
        )
    if len(records[0].info.alternatives) < 2:
        raise ValueError(
            f"a margin needs each token's two likeliest alternatives and this result recorded "
            f"{len(records[0].info.alternatives)}: generate with tokens=2 or more (--tokens 2)"
        )
    rows = []
    for r in records:
        (top, _, _), (second, second_text, _) = r.info.alternatives[:2]
        m = margin(r.info)
        rows.append(
            (r.position, r.info.token_id, r.info.text, top, second, second_text, m, floor is not None and m <= floor)
        )
    return rows


def margin_frame(records: Sequence[TokenRecord], floor: float | None = None):
    """The records' margins as a pandas DataFrame (MARGIN_COLUMNS)."""
    import pandas as pd  # only here: the session layer stays free of pandas

    return pd.DataFrame(margin_rows(records, floor), columns=list(MARGIN_COLUMNS))
