"""The device sampler (exlnb/engines/device_sampling.py) against the host sampler whose semantics it takes
(engines/cpu/sampler.py, exllamav2's): greedy picks the same token, sampled draws follow the same distribution
(a chi-square test over many draws on a small vocabulary), seeds reproduce whatever shares the batch, and the
penalty counts follow the sequence. Plain tensor operations, so they run here on the CPU as on a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from exlnb.engines.base import JobSpec
from exlnb.engines.cpu import candidates as steps
from exlnb.engines.cpu.sampler import SamplerState, adjust_logits, apply_penalties, draw_token, truncate
from exlnb.engines.device_sampling import (
    DeviceDraws,
    DeviceSampler,
    PenaltyCounts,
    Row,
    host_only,
    penalised,
    sample_rows,
    uniform,
)
from exlnb.engines.sampling import SamplerSettings

VOCAB = 24
CPU = torch.device("cpu")
# on the GPU machine (`pytest -m gpu`) the same draws run on CUDA, where the graphs run them
DEVICES = [CPU, pytest.param(torch.device("cuda"), marks=pytest.mark.gpu, id="cuda")]


def host_distribution(logits: torch.Tensor, sequence: torch.Tensor, s: SamplerSettings) -> torch.Tensor:
    """The probability of each token under the host sampler: its candidates after every step, as a full row."""
    adjusted = adjust_logits(logits, sequence, s, (), None)
    c = truncate(steps.softmax(adjusted.float(), s.temperature, s.smoothing_factor, top_k=s.top_k), s, SamplerState())
    full = torch.zeros(VOCAB, dtype=torch.float64)
    full[c.tokens] = c.probs.double()
    return full


def device_draws(
    logits: torch.Tensor,
    sequence: torch.Tensor,
    s: SamplerSettings,
    draws: int,
    seed: int = 7,
    device: torch.device = CPU,
):
    """`draws` tokens of one row, each at its own step, through the device sampler's staging."""
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA here")
    counts = PenaltyCounts(1, VOCAB, device)
    sampler = DeviceSampler(draws, VOCAB, device, counts)
    slot = counts.take(sequence.tolist())
    sampler.stage([Row(s, seed, step, slot) for step in range(draws)])
    return sampler.sample(logits.to(device).expand(draws, VOCAB)).cpu()


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability 0.001 (Wilson-Hilferty; z is that tail's normal quantile)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


SAMPLED = {
    "temperature only": SamplerSettings(temperature=0.9, top_k=0, top_p=1.0, token_repetition_penalty=1.0),
    "defaults (top-k 50, top-p 0.8, repetition 1.025)": SamplerSettings(),
    "top-k 6": SamplerSettings(temperature=1.3, top_k=6, top_p=1.0, token_repetition_penalty=1.0),
    "top-p 0.6 after top-k 6": SamplerSettings(temperature=1.0, top_k=6, top_p=0.6),
    "min-p 0.08": SamplerSettings(temperature=1.5, top_k=0, top_p=1.0, min_p=0.08),
    "penalties and bias": SamplerSettings(
        temperature=1.1,
        top_k=0,
        top_p=0.95,
        token_repetition_penalty=1.4,
        token_frequency_penalty=0.6,
        token_presence_penalty=0.5,
        token_bias={3: 2.0, 5: float("-inf")},
    ),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", SAMPLED)
def test_sampled_draws_follow_the_host_sampler_s_distribution(name, device):
    """In the mode the settings ask for: top-k ones sort only the likeliest candidates, the others everything."""
    s = SAMPLED[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    logits = torch.randn(VOCAB, generator=gen)
    sequence = torch.cat([torch.randint(0, VOCAB, (9,), generator=gen), torch.tensor([2, 2, 2, 7, 7])])  # repeats
    expected = host_distribution(logits, sequence, s)
    draws = 6000

    tokens = device_draws(logits, sequence, s, draws, device=device)

    observed = torch.bincount(tokens, minlength=VOCAB).double()
    support = expected > 0
    assert observed[~support].sum() == 0, f"drew tokens the host sampler never keeps: {observed[~support]}"
    counted = expected[support] * draws
    statistic = float(((observed[support] - counted) ** 2 / counted).sum())
    df = int(support.sum()) - 1
    if df >= 1:
        assert statistic < chi_square_critical(df), f"chi-square {statistic:.1f} over {df} degrees of freedom"


@pytest.mark.parametrize(
    "settings",
    [
        SamplerSettings.greedy(),
        SamplerSettings(temperature=0.0, token_repetition_penalty=1.3, token_presence_penalty=0.7, token_bias={1: 3.0}),
        SamplerSettings(temperature=0.7, top_k=1, token_frequency_penalty=0.4),
    ],
    ids=["greedy", "greedy with penalties and bias", "top-k 1 with frequency penalty"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_picks_the_host_sampler_s_token(settings, device):
    gen = torch.Generator().manual_seed(11)
    for _ in range(20):
        logits = torch.randn(VOCAB, generator=gen) * 3
        sequence = torch.randint(0, VOCAB, (12,), generator=gen)
        host = draw_token(logits, sequence, settings, torch.Generator().manual_seed(0)).token
        assert int(device_draws(logits, sequence, settings, 1, device=device)[0]) == host


def test_the_modes_draw_the_same_tokens_where_each_applies():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(6, VOCAB * 4, generator=gen) * 2  # a vocabulary wider than the top-k mode's candidates
    counts = PenaltyCounts(6, VOCAB * 4, CPU)
    sampler = DeviceSampler(6, VOCAB * 4, CPU, counts)
    slot = counts.take([1, 2])
    top_k = SamplerSettings(temperature=0.9, top_k=40, top_p=0.85, min_p=0.01)
    sampler.stage([Row(top_k, seed, 0, slot) for seed in range(6)])
    assert sampler.mode == "top-k"
    assert torch.equal(sampler.sample(logits), sampler.sample(logits, "full"))
    sampler.stage([Row(SamplerSettings.greedy(), seed, 0, slot) for seed in range(6)])
    assert sampler.mode == "greedy"
    assert torch.equal(sampler.sample(logits), sampler.sample(logits, "full")) and torch.equal(
        sampler.sample(logits), logits.argmax(1)
    )
    sampler.stage([Row(SamplerSettings(top_k=0, top_p=0.9), 0, 0, slot), Row(top_k, 1, 0, slot)])
    assert sampler.mode == "full"


def test_penalties_from_counts_equal_the_host_s_over_the_sequence():
    gen = torch.Generator().manual_seed(2)
    for _ in range(50):
        s = SamplerSettings(
            token_repetition_penalty=float(torch.rand((), generator=gen)) * 2 + 0.5,
            token_frequency_penalty=float(torch.rand((), generator=gen)),
            token_presence_penalty=float(torch.rand((), generator=gen)),
        )
        logits = torch.randn(VOCAB, generator=gen) * 3
        sequence = torch.randint(0, VOCAB // 3, (int(torch.randint(1, 40, (), generator=gen)),), generator=gen)
        counts = torch.bincount(sequence, minlength=VOCAB)[None].int()
        device = penalised(
            logits[None],
            counts,
            torch.tensor([s.token_repetition_penalty]),
            torch.tensor([s.token_frequency_penalty]),
            torch.tensor([s.token_presence_penalty]),
        )
        assert torch.allclose(device[0], apply_penalties(logits, sequence, s), atol=1e-5)


def test_a_seed_gives_the_same_draws_alone_or_in_any_batch():
    s = SamplerSettings(temperature=1.2, top_k=0, top_p=1.0, token_repetition_penalty=1.0)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, VOCAB, generator=gen)
    counts = PenaltyCounts(8, VOCAB, CPU)
    sampler = DeviceSampler(8, VOCAB, CPU, counts)
    slots = [counts.take([1, 2]) for _ in range(4)]
    rows = [Row(s, seed, step=3, slot=slot) for seed, slot in zip((10, 20, 30, 40), slots)]

    sampler.stage(rows)
    together = sampler.sample(logits).tolist()
    alone = []
    for i, row in enumerate(rows):
        sampler.stage([row])
        alone.append(int(sampler.sample(logits[i : i + 1])[0]))
    sampler.stage(rows[::-1])
    reversed_batch = sampler.sample(logits.flip(0)).tolist()[::-1]

    assert together == alone == reversed_batch
    steps_later = [Row(s, 10, step, slots[0]) for step in range(40)]
    sampler.stage(steps_later[:8])
    assert len(set(sampler.sample(logits[:1].expand(8, VOCAB)).tolist())) > 1  # the step moves the draw


def test_uniform_numbers_are_the_same_for_the_same_seed_and_step_and_spread_evenly():
    seeds = torch.arange(50_000) % 7 + 2**40  # seeds above 32 bits hash by their low word
    steps_ = torch.arange(50_000)
    u = uniform(seeds, steps_)
    assert torch.equal(u, uniform(seeds.clone(), steps_.clone()))
    assert float(u.min()) >= 0 and float(u.max()) < 1
    deciles = torch.bincount((u * 10).long(), minlength=10).double()
    assert float(((deciles - 5000) ** 2 / 5000).sum()) < chi_square_critical(9)


def test_penalty_counts_follow_each_slot_s_sequence():
    counts = PenaltyCounts(3, VOCAB, CPU)
    a, b = counts.take([1, 1, 2]), counts.take([5, 30])  # 30 is past the vocabulary: its own column
    counts.count(torch.tensor([a, b]), torch.tensor([2, 5]))
    assert counts.counts[a, :6].tolist() == [0, 2, 2, 0, 0, 0]
    assert counts.counts[b, 5] == 2 and counts.counts[b, VOCAB] == 1
    counts.give_back(a)
    assert counts.counts[counts.take([4]), :6].tolist() == [0, 0, 0, 0, 1, 0]  # a reused slot starts afresh


def test_blocked_tokens_are_never_drawn():
    s = SamplerSettings(temperature=1.0, top_k=0, top_p=1.0, token_repetition_penalty=1.0)
    logits = torch.zeros(VOCAB)
    logits[0] = 8.0  # nearly always token 0, unless it is blocked
    counts = PenaltyCounts(1, VOCAB, CPU)
    sampler = DeviceSampler(200, VOCAB, CPU, counts)
    slot = counts.take([3])
    sampler.stage([Row(s, 1, step, slot, blocked=(0,)) for step in range(200)])
    assert 0 not in sampler.sample(logits.expand(200, VOCAB)).tolist()


def test_settings_the_device_does_not_take_are_named():
    assert host_only(SamplerSettings()) == []
    assert host_only(SAMPLED["penalties and bias"]) == []
    assert host_only(SamplerSettings(dry_multiplier=0.8, mirostat=True, token_repetition_range=64)) == [
        "mirostat=True",
        "token_repetition_range=64",
        "dry_multiplier=0.8",
    ]
    many = SamplerSettings(token_bias={t: 1.0 for t in range(100)})
    assert host_only(many) == ["token_bias with 100 entries (the device takes 64)"]


def test_sample_rows_is_one_fixed_shape_computation_for_any_mix_of_settings():
    """What a CUDA graph needs: no branch on values, so greedy and sampled rows share the kernels."""
    rows = 3
    logits = torch.randn(rows, VOCAB)
    tokens = sample_rows(
        logits,
        torch.zeros(rows, VOCAB, dtype=torch.int32),
        temperature=torch.tensor([0.0, 0.8, 1.5]),
        top_p=torch.tensor([1.0, 0.8, 0.5]),
        min_p=torch.tensor([0.0, 0.0, 0.1]),
        repetition=torch.ones(rows),
        frequency=torch.zeros(rows),
        presence=torch.zeros(rows),
        greedy=torch.tensor([True, False, False]),
        top_k=torch.tensor([0, 5, 0]),
        seeds=torch.tensor([1, 2, 3]),
        steps=torch.tensor([0, 0, 0]),
        bias_ids=torch.full((rows, 2), VOCAB),
        bias=torch.zeros(rows, 2),
    )
    assert tokens.shape == (rows,) and int(tokens[0]) == int(logits[0].argmax())


# -- an engine's draws: rows by job, slots, and the draw of a step that ran eagerly ------------------------------


def job(prompt=(1, 2, 3), **options) -> JobSpec:
    return JobSpec(tuple(prompt), max_new_tokens=8, **options)


def test_a_job_takes_a_penalty_slot_at_its_first_draw_and_gives_it_back_at_its_end():
    draws = DeviceDraws(2, VOCAB, CPU)
    draw = DeviceDraws.start(job((4, 4, 9), seed=3))
    assert draw.slot is None  # waiting in the queue holds nothing
    row = draws.row(draw, 0)
    assert row.slot == draw.slot and draws.penalties.counts[draw.slot, 4] == 2
    draws.end(draw)
    assert draw.slot is None and row.slot in draws.penalties._free


def test_stop_tokens_are_blocked_until_min_new_tokens():
    draws = DeviceDraws(1, VOCAB, CPU)
    draw = DeviceDraws.start(job(stop_token_ids=frozenset({7, 2}), min_new_tokens=2))
    assert draws.row(draw, 1).blocked == (2, 7) and draws.row(draw, 2).blocked == ()


def test_a_step_s_draws_are_found_by_job_counted_and_the_same_as_a_draw_alone():
    draws = DeviceDraws(3, VOCAB, CPU)
    s = SamplerSettings(temperature=1.0, top_k=0, top_p=1.0)
    a, b = DeviceDraws.start(job(sampler=s, seed=1)), DeviceDraws.start(job(sampler=s, seed=2))
    rows = [("a", draws.row(a, 0)), ("host", None), ("b", draws.row(b, 0))]
    logits = torch.randn(3, VOCAB + 5)  # a library's logits may run past the vocabulary

    assert not draws.stage(rows, batch=2)  # not the batch's rows: nothing drawn in the graph
    assert not draws.stage([("host", None)], batch=1)
    assert draws.stage(rows, batch=3)
    tokens = draws.batch.sample(logits)
    draws.remember(tokens)

    assert int(draws.token("a")) == draws.host_token("a") == int(tokens[0])
    assert draws.token("host") is None and draws.host_token("b") == int(tokens[2])
    assert draws.penalties.counts[a.slot, int(tokens[0])] == 1 + (int(tokens[0]) in (1, 2, 3))
    twin = DeviceDraws(3, VOCAB, CPU)
    assert int(twin.draw_alone(twin.row(DeviceDraws.start(job(sampler=s, seed=1)), 0), logits[0])) == int(tokens[0])
    draws.forget_step()
    assert draws.token("a") is None


def test_jobs_the_device_cannot_draw_say_why():
    assert DeviceDraws.drawable(job()) == []
    assert DeviceDraws.drawable(job(banned_strings=("no",), sampler=SamplerSettings(xtc_probability=0.5))) == [
        "xtc_probability=0.5 (sampled on the host)",
        "banned_strings (rewinds on the host)",
    ]


@pytest.mark.gpu
def test_a_cuda_graph_of_the_sampler_draws_what_it_draws_eagerly():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA here")
    cuda = torch.device("cuda")
    counts = PenaltyCounts(4, VOCAB, cuda)
    sampler = DeviceSampler(4, VOCAB, cuda, counts)
    s = SamplerSettings(temperature=1.1, top_k=8, top_p=0.9, min_p=0.02, token_frequency_penalty=0.2)
    slots = [counts.take([1, 2, 2]) for _ in range(4)]
    logits = torch.randn(4, VOCAB, device=cuda)
    graph = torch.cuda.CUDAGraph()
    sampler.stage([Row(s, seed, 0, slot) for seed, slot in enumerate(slots)])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sampler.sample(logits)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        replayed = sampler.sample(logits)
    for step in range(20):  # new rows staged into the same buffers each step, as the decoders do
        sampler.stage([Row(s, seed, step, slot) for seed, slot in enumerate(slots)])
        graph.replay()
        assert torch.equal(replayed, sampler.sample(logits))
