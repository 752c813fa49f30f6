"""The token view: an answer as its tokens, each shaded by how probable it was, its alternatives on hover.

One shade scale for both JupyterLab themes: a red laid translucently over the theme's background, more opaque
the less probable the token, under the theme's text colour, so the text keeps its contrast in light and dark
(the browser test measures it). Special tokens are always marked, whitespace on request.
"""

from __future__ import annotations

import html
from collections.abc import Collection, Sequence

from exlnb.engines.token_info import TokenInfo
from exlnb.generation import Sample

# upper probability limit of each band, most doubtful first; their shades are .exlnb-p0 to -p3 in exlnb.css.
# Five bands are told apart at a glance, a continuous ramp is not
BANDS = (0.1, 0.3, 0.6, 0.9)
VISIBLE = {"\n": "↵\n", "\t": "→", " ": "·"}


def sample_token_info(sample: Sample) -> list[TokenInfo]:
    return [info for event in sample.events for info in event.token_info]


def band(probability: float) -> int:
    """0 for the most doubtful tokens up to len(BANDS) for the near-certain ones."""
    return next((i for i, limit in enumerate(BANDS) if probability < limit), len(BANDS))


def visible(text: str, special: bool, whitespace: bool) -> str:
    """A token's text, specials as ⟦name⟧, with `whitespace` its spaces, tabs and newlines as marks; ∅ for none."""
    if special:
        return f"⟦{text}⟧"
    return ("".join(VISIBLE.get(ch, ch) for ch in text) if whitespace else text) or "∅"


def hover_text(info: TokenInfo) -> str:
    lines = [f"token {info.token_id} {info.text!r}: p={info.probability:.3f}", "alternatives:"]
    lines += [f"{p:7.3f}  {text!r}" + ("  ←" if i == info.token_id else "") for i, text, p in info.alternatives]
    return "\n".join(lines)


def tokens_html(infos: Sequence[TokenInfo], specials: Collection[int], whitespace: bool) -> str:
    """The answer as token chips with a legend of the probability bands."""
    chips = "".join(
        f'<span class="exlnb-chip exlnb-p{band(info.probability)}{" exlnb-special" if info.token_id in specials else ""}"'
        f' title="{html.escape(hover_text(info))}">{html.escape(visible(info.text, info.token_id in specials, whitespace))}</span>'
        for info in infos
    )
    labels = [f"&lt;{limit}" for limit in BANDS] + [f"≥{BANDS[-1]}"]
    legend = "".join(f'<span class="exlnb-chip exlnb-p{i}">{label}</span>' for i, label in enumerate(labels))
    return (f'<div class="exlnb-tokens exlnb-token-view">{chips}</div>'
            f'<div class="exlnb-legend exlnb-muted">probability {legend} · hover a token for its alternatives</div>')


def tokens_text(infos: Sequence[TokenInfo], specials: Collection[int], whitespace: bool) -> str:
    """The plain-text token view: each token with its probability."""
    return "tokens: " + " ".join(f"[{visible(i.text, i.token_id in specials, whitespace)} {i.probability:.2f}]" for i in infos)

