"""The token view: an answer as its tokens, each shaded by how probable the model found it (or how long it
took), with a popover of its figures and the model's likeliest alternatives.

Two probabilities per token (token_info.py): the model's own, which the shade shows, and the one the sampler
drew it with, which under top-k or top-p is often 1.000 while the model hesitated. The popover is part of the
markup, not a `title`: it opens on hover and on keyboard focus (each token is a tab stop), its text can be
selected and copied, and it works in the static record a saved notebook keeps, where no script runs.

Once its answer has ended, a view whose answer a `BranchChoices` holds (widgets/branches.py) names it, and the
alternatives other than the drawn token carry their position and id: choosing one there branches the answer,
while the kernel that drew the view runs; the popover says whether it can (view.js marks the view).

One shade scale for both JupyterLab themes: a red laid translucently over the theme's background, more opaque
the more a token deserves a look, under the theme's text colour, so the text keeps its contrast in light and
dark (the browser test measures it). Special tokens are always marked, whitespace on request.
"""

from __future__ import annotations

import html
import math
import statistics
from collections.abc import Collection, Sequence

from exlnb.engines.token_info import TokenInfo
from exlnb.generation import Sample
from exlnb.near_ties import margin
from exlnb.token_records import TokenRecord

# upper probability limit of each band, most doubtful first; their shades are .exlnb-p0 to -p3 in exlnb.css.
# Five bands are told apart at a glance, a continuous ramp is not
BANDS = (0.1, 0.3, 0.6, 0.9)
# lower limit of each latency band, slowest first, in multiples of the sample's median time between tokens
LATENCY_BANDS = (4.0, 2.0, 1.5, 1.2)
# upper limit of each margin band in nats (near_ties.py), nearest tie first: under a hundredth a greedy run parts
# where rounding moves a logit that far
MARGIN_BANDS = (0.01, 0.1, 0.5, 1.0)
VISIBLE = {"\n": "↵\n", "\t": "→", " ": "·"}


def sample_token_records(sample: Sample) -> tuple[TokenRecord, ...]:
    """A sample's records, each at its place in the result's `token_ids` (a branch's forced token comes first)."""
    return sample.result().token_records


def band(probability: float) -> int:
    """0 for the most doubtful tokens up to len(BANDS) for the near-certain ones; a probability not known (a
    forced token outside the model's likeliest) counts as doubtful."""
    if math.isnan(probability):
        return 0
    return next((i for i, limit in enumerate(BANDS) if probability < limit), len(BANDS))


def margin_band(info: TokenInfo) -> int:
    """0 for the nearest ties up to len(MARGIN_BANDS) for a clear lead."""
    lead = margin(info)
    return next((i for i, m in enumerate(MARGIN_BANDS) if lead is not None and lead < m), len(MARGIN_BANDS))


def probability_words(info: TokenInfo) -> str:
    if math.isnan(info.probability):
        return f"below {info.alternatives[-1][2]:.3f} (not among its {len(info.alternatives)} likeliest)"
    return f"{info.probability:.3f}"


def latency_bands(records: Sequence[TokenRecord]) -> list[int]:
    """0 for the slowest tokens up to len(LATENCY_BANDS) for those near the median time between tokens (the
    first token's latency is the time to first token, so the median is taken over the others)."""
    timed = [r for r in records if not r.forced] or list(records)  # a forced token came with the prompt
    median = statistics.median(r.latency_s for r in timed[1:] or timed)
    return [
        next((i for i, m in enumerate(LATENCY_BANDS) if r.latency_s >= m * median), len(LATENCY_BANDS)) for r in records
    ]


def visible(text: str, special: bool, whitespace: bool) -> str:
    """A token's text, specials as ⟦name⟧, with `whitespace` its spaces, tabs and newlines as marks; ∅ for none."""
    if special:
        return f"⟦{text}⟧"
    return ("".join(VISIBLE.get(ch, ch) for ch in text) if whitespace else text) or "∅"


def sampled_words(record: TokenRecord) -> str:
    """The sampler's probability, as the popover says it (a forced token had none)."""
    info = record.info
    if record.forced:
        return "forced here by the branch: the sampler did not draw it"
    if info.sampled_probability is None:
        return "the sampler's probability is not reported by this engine"
    return f"sampled with {info.sampled_probability:.3f} (after penalties, temperature and truncation)"


# what the popover of a view that can branch says, both ways: exlnb.css shows the first only while view.js marks
# the view .exlnb-branching (its kernel runs), the second otherwise (a record, a kernel gone)
BRANCH_HINT = (
    '<span class="exlnb-branch-on"> (click one, or ↓ to it and Enter, to branch here)</span>'
    '<span class="exlnb-branch-off"> (branching here needs the live kernel that drew this view)</span>'
)


def alternative_html(record: TokenRecord, token_id: int, text: str, branching: bool, refused: bool = False) -> str:
    """An alternative's text; where the view can branch, a choice of the branch at the record's position (not for
    the drawn token: that branch is the answer again); where the engine refuses branches, greyed out."""
    words = html.escape(repr(text))
    if token_id == record.info.token_id or not (branching or refused):
        return words
    if refused:
        return f'<span class="exlnb-alt-off">{words}</span>'
    return f'<span class="exlnb-alt" data-at="{record.position}" data-token="{token_id}" tabindex="-1">{words}</span>'


def margin_words(info: TokenInfo) -> str:
    lead = margin(info)
    return "" if lead is None else f"margin {lead:.4g} nats over the runner-up (the top logit minus the second)<br>"


def popover_html(record: TokenRecord, branching: bool = False, refusal: str | None = None) -> str:
    """A token's figures, each named, and the model's k likeliest tokens with the drawn one marked; with
    `branching`, each other one a choice of a branch; with `refusal`, why none is (a chat server), said once and
    the alternatives greyed out, rather than a choice that would fail."""
    info = record.info
    branching, mark = branching and not record.forced, "← forced" if record.forced else "← drawn"
    rows = "".join(
        f"<tr><td>{p:.3f}</td><td>{alternative_html(record, i, text, branching, refusal is not None)}</td>"
        f"<td>{mark if i == info.token_id else ''}</td></tr>"
        for i, text, p in info.alternatives
    )
    hint = (
        BRANCH_HINT
        if branching
        else f'<span class="exlnb-branch-refused"> ({html.escape(refusal)})</span>'
        if refusal
        else ""
    )
    return (
        f'<span class="exlnb-popover" role="tooltip">'
        f"<b>token {info.token_id} {html.escape(repr(info.text))}</b><br>"
        f"model's probability {probability_words(info)} (its softmax at temperature 1, before sampling)<br>"
        f"{margin_words(info)}"
        f"{sampled_words(record)}<br>"
        + ("" if record.forced else f"arrived {record.latency_s * 1000:.0f} ms after the previous token<br>")
        + f"the model's {len(info.alternatives)} likeliest tokens{hint}:<table>{rows}</table></span>"
    )


def tokens_html(
    records: Sequence[TokenRecord],
    specials: Collection[int],
    whitespace: bool,
    colour: str,
    answer: str | None = None,
    refusal: str | None = None,
) -> str:
    """The answer as token chips shaded by `colour` ("probability": the model's, or "latency"), each with its
    popover, and a legend of the bands; with `answer` (`branches.branch_key`), a view whose alternatives branch;
    with `refusal` (`Engine.branch_refusal`), one whose alternatives cannot."""
    if colour == "latency":
        bands = latency_bands(records)
        labels = [f"≥{m}× median" for m in LATENCY_BANDS] + ["faster"]
        shade = "time since the previous token"
    elif colour == "margin":
        bands = [margin_band(r.info) for r in records]
        labels = [f"&lt;{m} nats" for m in MARGIN_BANDS] + [f"≥{MARGIN_BANDS[-1]} nats"]
        shade = "the top logit's margin over the runner-up's"
    else:
        bands = [band(r.info.probability) for r in records]
        labels = [f"&lt;{limit}" for limit in BANDS] + [f"≥{BANDS[-1]}"]
        shade = "the model's probability"
    chips = "".join(
        f'<span class="exlnb-chip exlnb-p{b}{" exlnb-special" if r.info.token_id in specials else ""}'
        f'{" exlnb-forced" if r.forced else ""}" tabindex="0">'
        f"{html.escape(visible(r.info.text, r.info.token_id in specials, whitespace))}"
        f"{popover_html(r, answer is not None, refusal)}</span>"
        for r, b in zip(records, bands)
    )
    legend = "".join(f'<span class="exlnb-chip exlnb-p{i}">{label}</span>' for i, label in enumerate(labels))
    named = f' data-exlnb-answer="{answer}"' if answer else ""
    return (
        f'<div class="exlnb-tokens exlnb-token-view"{named}>{chips}</div>'
        f'<div class="exlnb-legend exlnb-muted">shade: {shade} {legend} · hover or Tab to a token for its '
        "probabilities and alternatives</div>"
    )


def text_figure(record: TokenRecord, colour: str) -> str:
    """A token's figure in the plain view: its latency, or the model's probability and the sampler's ("?" where
    the engine does not report it); a branch's forced token says so."""
    if record.forced:
        return "forced"
    if colour == "latency":
        return f"{record.latency_s * 1000:.0f}ms"
    if colour == "margin":
        return f"{margin(record.info):.3g}n"
    sampled = record.info.sampled_probability
    return f"{record.info.probability:.2f}/" + ("?" if sampled is None else f"{sampled:.2f}")


def tokens_text(records: Sequence[TokenRecord], specials: Collection[int], whitespace: bool, colour: str) -> str:
    """The plain-text token view, with a head saying what its figures are."""
    head = {"latency": "ms since the previous token", "margin": "nats over the runner-up"}.get(
        colour, "the model's probability/sampled with"
    )
    tokens = " ".join(
        f"[{visible(r.info.text, r.info.token_id in specials, whitespace)} {text_figure(r, colour)}]" for r in records
    )
    return f"tokens [text {head}]: {tokens}"
