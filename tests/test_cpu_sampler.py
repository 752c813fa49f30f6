"""The CPU sampler against exllamav2 0.3.2's semantics."""

from __future__ import annotations

import pytest
import torch

from exlnb.engines.base import SamplerSettings
from exlnb.engines.cpu.sampler import apply_penalties, sample_token


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
    picks = {sample_token(logits, torch.tensor([0]), SamplerSettings.greedy(), torch.Generator().manual_seed(s)) for s in range(20)}
    assert picks == {1}


def test_tiny_temperature_means_greedy_as_in_exllamav2():
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    settings = SamplerSettings(temperature=0.005, top_k=0, top_p=1.0, token_repetition_penalty=1.0)
    assert sample_token(logits, torch.tensor([0]), settings, torch.Generator().manual_seed(3)) == 1


def _frequencies(logits, settings, n=4000):
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(logits.numel())
    for _ in range(n):
        counts[sample_token(logits, torch.tensor([0]), settings, gen)] += 1
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
    freq = _frequencies(logits, SamplerSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2, token_repetition_penalty=1.0))
    assert freq[3] == 0 and freq[2] > 0


def test_temperature_one_samples_the_softmax():
    probs = torch.tensor([0.5, 0.25, 0.25])
    freq = _frequencies(torch.log(probs), SamplerSettings(temperature=1.0, top_k=0, top_p=1.0, token_repetition_penalty=1.0))
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)
