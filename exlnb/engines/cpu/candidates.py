"""The steps of exllamav2 0.3.2's `sample_basic` (exllamav2_ext/cpp/sampling.cpp), one function each.

Candidates are probabilities in descending order with their token ids. exllamav2 keeps them in whatever
order its last step left them; the kept set and the distribution are the same, only which token a given
uniform draw lands on differs. Each truncating step renormalises what it keeps, as `normalize_cpu` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

EPSILON = 1e-8  # exllamav2's pre_sort_descending drops candidates below this before tfs, typical and mirostat


@dataclass(frozen=True)
class Candidates:
    probs: torch.Tensor  # descending, summing to 1
    tokens: torch.Tensor

    def __len__(self) -> int:
        return self.probs.numel()

    def keep(self, mask_or_count: torch.Tensor | int) -> Candidates:
        if isinstance(mask_or_count, int):
            probs, tokens = self.probs[:mask_or_count], self.tokens[:mask_or_count]
        else:
            probs, tokens = self.probs[mask_or_count], self.tokens[mask_or_count]
        return Candidates(probs / probs.sum(), tokens)

    def sorted(self) -> Candidates:
        probs, order = torch.sort(self.probs, descending=True)
        return Candidates(probs, self.tokens[order])


def softmax(
    logits: torch.Tensor,
    temperature: float,
    smoothing_factor: float,
    top_k: int = 0,
    allowed: torch.Tensor | None = None,
) -> Candidates:
    """exllamav2's softmax_cpu: with a smoothing factor the exponent is -(l - max)^2 x factor / temperature.

    Sorting SmolLM2's 49152 probabilities takes 3.4 ms on one core, per job and token, so only what the next
    step keeps is sorted. With `allowed` (a constraint's mask) the candidates are the allowed tokens alone,
    renormalised, even those whose probability rounds to 0: a draw rounded past the end still lands on one. With
    `top_k` (where nothing comes between the softmax and the top-k step) they are what that step leaves, the k
    likeliest renormalised, found by `torch.topk` (0.09 ms). Either way the same numbers as sorting everything
    first; only tokens of exactly equal probability may come in another order, as exllamav2 leaves it open.
    """
    shifted = logits - logits.max()
    if smoothing_factor > 0:
        shifted = -shifted * shifted
        temperature = temperature / smoothing_factor
    probs = torch.softmax(shifted / temperature, dim=-1)
    if allowed is not None:
        tokens = allowed.nonzero().squeeze(1)
        kept, order = torch.sort(probs[tokens], descending=True)
        return Candidates(kept / kept.sum(), tokens[order])
    if 0 < top_k < probs.numel():
        return Candidates(*torch.topk(probs, top_k)).keep(top_k)
    return Candidates(*torch.sort(probs, descending=True))


def top_k(c: Candidates, k: int) -> Candidates:
    return c.keep(k) if 0 < k < len(c) else c


def top_p(c: Candidates, p: float) -> Candidates:
    """The largest head of the distribution whose mass stays within p (at least one token)."""
    if not 0 < p < 1:
        return c
    return c.keep(max(1, int((torch.cumsum(c.probs, 0) <= p).sum())))


def top_a(c: Candidates, a: float) -> Candidates:
    return c.keep(c.probs >= a * c.probs[0] ** 2) if a > 0 else c


def min_p(c: Candidates, p: float) -> Candidates:
    return c.keep(c.probs >= c.probs[0] * p) if 0 < p < 1 else c


def tail_free(c: Candidates, z: float) -> Candidates:
    """Cut where the normalised absolute second difference of the sorted probabilities first passes z."""
    if not 0 < z < 1 or len(c) < 3:
        return c
    probs = c.probs[c.probs >= EPSILON]
    curvature = (probs[:-2] - 2 * probs[1:-1] + probs[2:]).abs()
    crossed = torch.nonzero(torch.cumsum(curvature / curvature.sum(), 0) > z)
    return c.keep(int(crossed[0]) + 1 if crossed.numel() else max(1, probs.numel() - 1))


def typical(c: Candidates, mass: float) -> Candidates:
    """Tokens ordered by how far their log-probability lies from the entropy, kept while their mass is below `mass`.

    exllamav2's typical_cpu scores p + log(p) against sum(p * (p + log p)), and stops before the token that
    reaches the mass (keeping at least one); both quirks are kept so the engines agree.
    """
    if not 0 < mass < 1:
        return c
    live = c.keep(c.probs >= EPSILON)
    score = live.probs + torch.log(live.probs + 1e-10)
    deviation = (score - (live.probs * score).sum()).abs()
    order = torch.sort(deviation, stable=True).indices
    probs, tokens = live.probs[order], live.tokens[order]
    reached = torch.nonzero(torch.cumsum(probs, 0) >= mass)
    count = max(1, int(reached[0])) if reached.numel() else probs.numel()
    return Candidates(probs[:count] / probs[:count].sum(), tokens[:count]).sorted()


def mirostat_truncate(c: Candidates, mu: float) -> Candidates:
    """Keep the tokens at least 2^-mu likely (at least one)."""
    target = 2.0**-mu
    return c.keep(max(1, int((c.probs[c.probs >= EPSILON] >= target).sum())))


def mirostat_update(mu: float, tau: float, eta: float, chosen_prob: float) -> float:
    """mirostat_post_cpu: move mu by eta times how far the drawn token's surprise was from tau."""
    return mu + eta * (tau - -math.log2(chosen_prob))


def temperature_after(
    c: Candidates, temperature: float, min_temp: float, max_temp: float, exponent: float
) -> Candidates:
    """post_softmax_temperature: p^(1/T), with T from the normalised entropy when dynamic (max_temp > min_temp)."""
    if max_temp > min_temp:
        entropy = float(-(c.probs * torch.log(c.probs.clamp(min=1e-30))).sum())
        max_entropy = math.log(len(c)) or 1.0
        temperature = min_temp + (max_temp - min_temp) * (entropy / max_entropy) ** exponent
    probs = c.probs ** (1.0 / temperature)
    return Candidates(probs / probs.sum(), c.tokens).sorted()


def exclude_top_choices(c: Candidates, probability: float, threshold: float, excludable: torch.Tensor) -> Candidates:
    """XTC as exllamav2 does it: in expectation, not by a coin flip.

    The tokens at or above the threshold, but the least likely of them, lose `probability` of their mass,
    which goes to the other tokens in proportion. Tokens outside `excludable` (newlines, special tokens)
    never lose mass. exllamav2 0.3.2's xtc_cpu tests `temp_probs[i + 1]` and `i != min_prob` where it means
    `temp_probs[i]` and `i != min_index`; this follows what the code sets out to do.
    """
    top = (c.probs >= threshold) & excludable[c.tokens]
    if int(top.sum()) <= 1:
        return c
    least = int(torch.nonzero(top)[-1])  # descending order: the last of them is the least likely
    top[least] = False
    mass = float(c.probs[top].sum())
    if mass >= 1.0:
        return c
    boost = 1.0 + probability * mass / (1.0 - mass)
    probs = torch.where(top, c.probs * (1.0 - probability), c.probs * boost)
    return Candidates(probs / probs.sum(), c.tokens).sorted()


def draw(c: Candidates, uniform: float, skew: float) -> int:
    """The first candidate whose cumulative probability reaches the draw; skew raises it to exp(-skew)."""
    point = uniform ** math.exp(-skew) if skew else uniform
    index = int(torch.searchsorted(torch.cumsum(c.probs, 0), torch.tensor(point)))
    return min(index, len(c) - 1)
