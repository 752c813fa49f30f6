"""The token view: an answer as its tokens, each shaded by how probable it was (or how long it took), its
alternatives on hover.

One shade scale for both JupyterLab themes: a red laid translucently over the theme's background, more opaque
the more a token deserves a look, under the theme's text colour, so the text keeps its contrast in light and
dark (the browser test measures it). Special tokens are always marked, whitespace on request.
"""

from __future__ import annotations

import html
import statistics
from collections.abc import Collection, Sequence

from exlnb.generation import Sample
from exlnb.token_records import TokenRecord, token_records

# upper probability limit of each band, most doubtful first; their shades are .exlnb-p0 to -p3 in exlnb.css.
# Five bands are told apart at a glance, a continuous ramp is not
BANDS = (0.1, 0.3, 0.6, 0.9)
# lower limit of each latency band, slowest first, in multiples of the sample's median time between tokens
LATENCY_BANDS = (4.0, 2.0, 1.5, 1.2)
VISIBLE = {"\n": "↵\n", "\t": "→", " ": "·"}


def sample_token_records(sample: Sample) -> tuple[TokenRecord, ...]:
    return token_records(sample.events)


def band(probability: float) -> int:
    """0 for the most doubtful tokens up to len(BANDS) for the near-certain ones."""
    return next((i for i, limit in enumerate(BANDS) if probability < limit), len(BANDS))


def latency_bands(records: Sequence[TokenRecord]) -> list[int]:
    """0 for the slowest tokens up to len(LATENCY_BANDS) for those near the median time between tokens (the
    first token's latency is the time to first token, so the median is taken over the others)."""
    median = statistics.median(r.latency_s for r in records[1:] or records)
    return [next((i for i, m in enumerate(LATENCY_BANDS) if r.latency_s >= m * median), len(LATENCY_BANDS))
            for r in records]


def visible(text: str, special: bool, whitespace: bool) -> str:
    """A token's text, specials as ⟦name⟧, with `whitespace` its spaces, tabs and newlines as marks; ∅ for none."""
    if special:
        return f"⟦{text}⟧"
    return ("".join(VISIBLE.get(ch, ch) for ch in text) if whitespace else text) or "∅"


def hover_text(record: TokenRecord) -> str:
    info = record.info
    lines = [f"token {info.token_id} {info.text!r}: p={info.probability:.3f}, after {record.latency_s * 1000:.0f} ms",
             "alternatives:"]
    lines += [f"{p:7.3f}  {text!r}" + ("  ←" if i == info.token_id else "") for i, text, p in info.alternatives]
    return "\n".join(lines)


def tokens_html(records: Sequence[TokenRecord], specials: Collection[int], whitespace: bool, colour: str) -> str:
    """The answer as token chips shaded by `colour` ("probability" or "latency"), with a legend of the bands."""
    if colour == "latency":
        bands = latency_bands(records)
        labels = [f"≥{m}× median" for m in LATENCY_BANDS] + ["faster"]
    else:
        bands = [band(r.info.probability) for r in records]
        labels = [f"&lt;{limit}" for limit in BANDS] + [f"≥{BANDS[-1]}"]
    chips = "".join(
        f'<span class="exlnb-chip exlnb-p{b}{" exlnb-special" if r.info.token_id in specials else ""}"'
        f' title="{html.escape(hover_text(r))}">{html.escape(visible(r.info.text, r.info.token_id in specials, whitespace))}</span>'
        for r, b in zip(records, bands)
    )
    legend = "".join(f'<span class="exlnb-chip exlnb-p{i}">{label}</span>' for i, label in enumerate(labels))
    return (f'<div class="exlnb-tokens exlnb-token-view">{chips}</div>'
            f'<div class="exlnb-legend exlnb-muted">{colour} {legend} · hover a token for its alternatives</div>')


def tokens_text(records: Sequence[TokenRecord], specials: Collection[int], whitespace: bool, colour: str) -> str:
    """The plain-text token view: each token with its probability, or its latency in milliseconds."""
    def figure(r: TokenRecord) -> str:
        return f"{r.latency_s * 1000:.0f}ms" if colour == "latency" else f"{r.info.probability:.2f}"

    return "tokens: " + " ".join(f"[{visible(r.info.text, r.info.token_id in specials, whitespace)} {figure(r)}]"
                                 for r in records)
