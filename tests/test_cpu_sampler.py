"""The CPU sampler against exllamav2 0.3.2's semantics."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from exlnb.engines.base import SamplerSettings
from exlnb.engines.cpu import candidates as steps
from exlnb.engines.cpu.candidates import Candidates
from exlnb.engines.cpu.dry import apply_dry
from exlnb.engines.cpu.sampler import SamplerState, apply_penalties, draw_token


def exllamav2_rep_penalty(logits, sequence, rep_p, sustain, decay, freq_p, pres_p):
    """A line-by-line port of exllamav2_ext/cpp/sampling.cpp apply_rep_penalty_cpu, as the reference."""
    logits = logits.clone().tolist()
    seen = set()
    d_rep = (1.0 - rep_p) / decay if decay else 0.0
    d_freq = (0.0 - freq_p) / decay if decay else 0.0
    d_pres = (0.0 - pres_p) / decay if decay else 0.0
    seq_len = len(sequence)
    sust = seq_len if sustain == -1 else sustain
    beg = max(seq_len - sust - decay, 0)
    i = seq_len
    while i > beg:
        i -= 1
        t = sequence[i]
        if t < len(logits):
            if t not in seen:
                logits[t] = logits[t] / rep_p if logits[t] > 0.0 else logits[t] * rep_p
                logits[t] -= pres_p
                seen.add(t)
            logits[t] -= freq_p
        sust -= 1
        if sust < 0:
            rep_p += d_rep
            freq_p += d_freq
            pres_p += d_pres
    return torch.tensor(logits)


@pytest.mark.parametrize(
    ("rep", "range_", "decay", "freq", "pres"),
    [
        (1.05, -1, 0, 0.0, 0.0),
        (1.11, -1, 0, 0.03, 0.0),
        (1.2, 16, 0, 0.0, 0.1),
        (1.3, 10, 12, 0.05, 0.2),
        (0.9, 5, 3, 0.0, 0.0),
    ],
)
def test_penalties_match_exllamav2s_loop(rep, range_, decay, freq, pres):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=gen) * 3
    sequence = torch.randint(0, 50, (60,), generator=gen)
    settings = SamplerSettings(
        token_repetition_penalty=rep,
        token_repetition_range=range_,
        token_repetition_decay=decay,
        token_frequency_penalty=freq,
        token_presence_penalty=pres,
    )
    expected = exllamav2_rep_penalty(logits, sequence.tolist(), rep, range_, decay, freq, pres)
    torch.testing.assert_close(apply_penalties(logits, sequence, settings), expected, atol=1e-5, rtol=1e-5)


def test_penalties_ignore_ids_outside_the_vocabulary():
    logits = torch.ones(10)
    out = apply_penalties(logits, torch.tensor([3, 99]), SamplerSettings(token_repetition_penalty=2.0))
    assert out[3] == 0.5 and out.sum() == 9.5


def test_greedy_picks_the_argmax_whatever_the_draw():
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    picks = {
        draw_token(logits, torch.tensor([0]), SamplerSettings.greedy(), torch.Generator().manual_seed(s)).token
        for s in range(20)
    }
    assert picks == {1}


def test_tiny_temperature_means_greedy_as_in_exllamav2():
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    settings = SamplerSettings(temperature=0.005, top_k=0, top_p=1.0, token_repetition_penalty=1.0)
    assert draw_token(logits, torch.tensor([0]), settings, torch.Generator().manual_seed(3)).token == 1


def _frequencies(logits, settings, n=4000):
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(logits.numel())
    for _ in range(n):
        counts[draw_token(logits, torch.tensor([0]), settings, gen).token] += 1
    return counts / n


def test_top_k_keeps_only_the_k_most_likely():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    freq = _frequencies(logits, SamplerSettings(temperature=1.0, top_k=2, top_p=1.0, token_repetition_penalty=1.0))
    assert freq[2] == 0 and freq[3] == 0
    assert freq[0] == pytest.approx(0.4 / 0.7, abs=0.03)


def test_top_p_keeps_the_head_whose_mass_stays_within_p():
    # exllamav2's top-p keeps {0.4, 0.3} for p=0.75 (adding 0.2 would exceed it)
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    freq = _frequencies(logits, SamplerSettings(temperature=1.0, top_k=0, top_p=0.75, token_repetition_penalty=1.0))
    assert freq[2] == 0 and freq[3] == 0 and freq[1] > 0


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    freq = _frequencies(
        logits, SamplerSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2, token_repetition_penalty=1.0)
    )
    assert freq[3] == 0 and freq[2] > 0


def test_temperature_one_samples_the_softmax():
    probs = torch.tensor([0.5, 0.25, 0.25])
    freq = _frequencies(
        torch.log(probs), SamplerSettings(temperature=1.0, top_k=0, top_p=1.0, token_repetition_penalty=1.0)
    )
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)


# -- the rest of exllamav2's sampler --------------------------------------------------------------------------

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def candidates(probs=PROBS):
    return Candidates(probs.clone(), torch.arange(probs.numel()))


def exllamav2_dry(logits, sequence, multiplier, base, allowed, breakers, range_, max_ngram):
    """exllamav2 0.3.2's ExLlamaV2Sampler.apply_dry with a fresh trie, line by line, as the reference."""
    logits = logits.clone()
    trie = {}
    seq_len = max(len(sequence) - 1, 0)
    new_beg = 0
    if range_:
        new_beg = max(new_beg, seq_len - range_)
    for i in range(new_beg, seq_len):
        node = trie
        for j in range(i, min(i + max_ngram, seq_len)):
            t = sequence[j]
            if t in breakers:
                break
            child = node.setdefault(t, [0, {}])
            child[0] += 1
            node = child[1]
    n = len(sequence)
    penalty_tokens = None
    for i in range(max(n - max_ngram, 0), max(n - allowed + 1, 0)):
        node = trie
        for j in range(i, n):
            if sequence[j] not in node:
                break
            node = node[sequence[j]][1]
        else:
            penalty_tokens, length = node, j - i + 1
            break
    if penalty_tokens:
        penalty = -multiplier * base ** (length - allowed)
        for t, (count, _) in penalty_tokens.items():
            logits[t] += penalty * count
    return logits


@pytest.mark.parametrize(
    ("seed", "allowed", "range_", "max_ngram"), [(0, 2, 0, 20), (1, 1, 0, 4), (2, 3, 30, 6), (3, 2, 0, 3)]
)
def test_dry_matches_exllamav2s_trie(seed, allowed, range_, max_ngram):
    gen = torch.Generator().manual_seed(seed)
    vocab = 6  # a small vocabulary repeats a lot
    motif = torch.randint(0, vocab, (7,), generator=gen)
    sequence = torch.cat([motif, torch.randint(0, vocab, (5,), generator=gen), motif, motif[:4]])
    logits = torch.randn(vocab, generator=gen)
    breakers = torch.zeros(vocab, dtype=torch.bool)
    breakers[5] = True
    settings = SamplerSettings(
        dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=allowed, dry_range=range_, dry_max_ngram=max_ngram
    )

    expected = exllamav2_dry(logits, sequence.tolist(), 0.8, 1.75, allowed, {5}, range_, max_ngram)
    torch.testing.assert_close(apply_dry(logits, sequence, settings, breakers), expected)


def test_dry_penalises_the_token_that_would_extend_a_repeat():
    sequence = torch.tensor([1, 2, 3, 4, 0, 1, 2, 3])  # "1 2 3" again: 4 would repeat the run
    out = apply_dry(
        torch.zeros(6), sequence, SamplerSettings(dry_multiplier=2.0, dry_base=3.0), torch.zeros(6, dtype=torch.bool)
    )
    assert out.tolist() == [0, 0, 0, 0, -2.0 * 3.0 ** (3 - 2), 0]


def test_dry_repeats_do_not_span_a_sequence_breaker():
    sequence = torch.tensor([1, 2, 3, 4, 0, 1, 2, 3])
    breakers = torch.zeros(6, dtype=torch.bool)
    breakers[2] = True
    out = apply_dry(torch.zeros(6), sequence, SamplerSettings(dry_multiplier=2.0), breakers)
    assert out.abs().sum() == 0  # the tail "3" alone is shorter than dry_allowed_length


def test_token_bias_and_blocked_tokens_move_the_greedy_pick():
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    gen = torch.Generator().manual_seed(0)
    biased = SamplerSettings.greedy(token_bias={1: -0.5, 3: 3.5})
    assert draw_token(logits, torch.tensor([0]), biased, gen).token == 3
    assert draw_token(logits, torch.tensor([0]), SamplerSettings.greedy(token_bias={1: float("-inf")}), gen).token == 2
    assert draw_token(logits, torch.tensor([0]), SamplerSettings.greedy(), gen, blocked=[1, 2]).token == 0


def test_top_a_drops_tokens_below_a_times_the_top_probability_squared():
    kept = steps.top_a(candidates(), 0.5)  # threshold 0.5 x 0.25 = 0.125
    assert kept.tokens.tolist() == [0, 1, 2]
    torch.testing.assert_close(kept.probs, PROBS[:3] / 0.95)


def test_tail_free_cuts_where_the_curvature_mass_passes_z():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])  # second differences 0.15 and 0.05: shares 0.75, 0.25
    assert steps.tail_free(candidates(probs), 0.5).tokens.tolist() == [0]
    assert steps.tail_free(candidates(probs), 0.9).tokens.tolist() == [0, 1]


def exllamav2_typical(probs, mass):
    """exllamav2_ext/cpp/sampling.cpp typical_cpu, line by line, on descending probabilities: the kept ids."""
    log_probs = [p + math.log(p + 1e-10) for p in probs]
    neg_entropy = sum(p * y for p, y in zip(probs, log_probs))
    order = sorted(range(len(probs)), key=lambda i: abs(log_probs[i] - neg_entropy))
    cumprob, num = 0.0, 0
    while True:
        cumprob += probs[order[num]]
        if cumprob >= mass:
            break
        num += 1
        if num >= len(probs):
            break
    return sorted(order[: max(num, 1)])


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.7, 0.95])
def test_typical_keeps_what_exllamav2_keeps(mass):
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    assert sorted(steps.typical(candidates(probs), mass).tokens.tolist()) == exllamav2_typical(probs.tolist(), mass)


def test_mirostat_keeps_tokens_at_least_two_to_the_minus_mu_likely_and_learns():
    assert steps.mirostat_truncate(candidates(), mu=2.0).tokens.tolist() == [0, 1]  # 2^-2 = 0.25
    # the drawn token was 1 bit surprising against a 1.5-bit target: mu rises by eta x 0.5
    assert steps.mirostat_update(3.0, tau=1.5, eta=0.1, chosen_prob=0.5) == pytest.approx(3.05)


def test_xtc_moves_mass_from_the_top_choices_but_the_least_likely_of_them():
    excludable = torch.ones(4, dtype=torch.bool)
    out = steps.exclude_top_choices(candidates(), probability=0.5, threshold=0.1, excludable=excludable)
    # 0.5 and 0.3 lose half; 0.15 (the least likely above the threshold) and 0.05 gain 0.4 in proportion
    expected = {0: 0.25, 1: 0.15, 2: 0.45, 3: 0.15}
    assert {int(t): round(float(p), 5) for t, p in zip(out.tokens, out.probs)} == expected


def test_xtc_never_excludes_protected_tokens():
    excludable = torch.tensor([False, True, True, True])  # token 0 is a newline, say
    out = steps.exclude_top_choices(candidates(), probability=1.0, threshold=0.1, excludable=excludable)
    assert dict(zip(out.tokens.tolist(), out.probs.tolist()))[0] > 0.5


def test_smoothing_factor_squashes_logits_quadratically_around_the_top():
    logits = torch.tensor([3.0, 2.0, 0.0])
    c = steps.softmax(logits, temperature=1.0, smoothing_factor=0.5)
    expected = torch.softmax(-0.5 * torch.tensor([0.0, 1.0, 9.0]), 0)
    torch.testing.assert_close(c.probs, expected)


def test_dynamic_temperature_follows_the_entropy():
    flat = candidates(torch.full((4,), 0.25))  # normalised entropy 1: the temperature is max_temp
    assert steps.temperature_after(flat, 1.0, 0.5, 2.0, 1.0).probs.tolist() == pytest.approx([0.25] * 4)
    peaked = steps.temperature_after(candidates(), 1.0, min_temp=0.5, max_temp=2.0, exponent=1.0)
    entropy = float(-(PROBS * PROBS.log()).sum()) / math.log(4)
    expected = PROBS ** (1 / (0.5 + 1.5 * entropy))
    torch.testing.assert_close(peaked.probs, expected / expected.sum())


def test_temperature_last_lets_min_p_see_the_untempered_distribution():
    logits = PROBS.log()
    hot_first = SamplerSettings(temperature=3.0, top_k=0, top_p=1.0, min_p=0.2, token_repetition_penalty=1.0)
    hot_last = replace(hot_first, temperature_last=True)
    assert _frequencies(logits, hot_first, n=2000)[3] > 0
    assert _frequencies(logits, hot_last, n=2000)[3] == 0


def test_skew_moves_the_draw_towards_less_likely_tokens():
    c = candidates()  # cumulative 0.5, 0.8, 0.95, 1.0
    assert steps.draw(c, 0.4, skew=0.0) == 0
    assert steps.draw(c, 0.4, skew=1.0) == 1  # 0.4 ** exp(-1) = 0.71
    assert steps.draw(c, 0.6, skew=-1.0) == 0  # 0.6 ** e = 0.25


def test_mirostat_sampling_carries_mu_in_the_jobs_state():
    state = SamplerState()
    settings = SamplerSettings(temperature=1.0, top_k=0, top_p=1.0, token_repetition_penalty=1.0, mirostat=True)
    draw_token(PROBS.log(), torch.tensor([0]), settings, torch.Generator().manual_seed(0), state=state)
    assert state.mirostat_mu is not None and state.mirostat_mu != 2 * settings.mirostat_tau
