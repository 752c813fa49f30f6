"""Per-token records of a finished job, for `--out` results and the token view: what arrived, how sure, when.

Built from the events of a job that asked for `top_tokens`; a job without it has none (nothing was computed).
Tokens delivered in one event arrived together: the later ones have a latency of zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from exlnb.engines.base import StreamEvent
from exlnb.engines.token_info import TokenInfo

COLUMNS = (
    "position",
    "token_id",
    "text",
    "probability",
    "sampled_probability",
    "alternatives",
    "arrival_s",
    "latency_s",
)


@dataclass(frozen=True)
class TokenRecord:
    """One generated token: its engine record and its arrival after the job was submitted."""

    position: int  # 0 for the first new token
    info: TokenInfo
    arrival_s: float  # submit -> the event that carried it
    latency_s: float  # since the previous token arrived (for the first: the time to first token)
    forced: bool = False  # given to the job (a branch's forced token), not drawn: it arrived with the prompt


def token_records(events: Iterable[StreamEvent]) -> tuple[TokenRecord, ...]:
    records: list[TokenRecord] = []
    previous = None
    for event in events:
        arrival = event.time_produced - event.time_enqueued
        for info in event.token_info:
            latency = arrival if previous is None else arrival - previous
            records.append(TokenRecord(len(records), info, arrival, latency))
            previous = arrival
    return tuple(records)


def token_frame(records: Sequence[TokenRecord]):
    """The records as a pandas DataFrame, one row per token: `probability` is the model's own, `sampled_probability`
    the sampler's (token_info.py), `alternatives` the model's likeliest as (id, text, probability) tuples."""
    import pandas as pd  # only here: the streaming layer stays free of pandas

    if not records:
        raise ValueError("this result has no per-token data: generate with tokens=N (--tokens N) to record it")
    return pd.DataFrame(
        [
            (
                r.position,
                r.info.token_id,
                r.info.text,
                r.info.probability,
                r.info.sampled_probability,
                r.info.alternatives,
                r.arrival_s,
                r.latency_s,
            )
            for r in records
        ],
        columns=list(COLUMNS),
    )
