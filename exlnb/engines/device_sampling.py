"""Sampling a batch of rows on the device, every row with its own settings, in tensor operations a CUDA graph
can record: what the GPU engines' graph decoders run after the model's last layer, so that only the sampled ids
leave the GPU.

exllamav2 0.3.2 copies every row's logits to the host and samples there in C++ (1.5 ms of a 7B token's 7.8 ms
was host time, speed record of 2026-11-26); exllamav3 1.6.5 samples each job on the GPU with launches of its
own, one job after another. Here a whole batch is one set of kernels over static buffers, with exllamav2's
semantics for what it covers (`engines/cpu/sampler.py` is their reference, and the tests hold the two against
each other): on the raw logits the repetition, presence and frequency penalties over the whole sequence (prompt
included; exllamav2's defaults of range -1 and decay 0), blocked tokens and token bias; then greedy (temperature
below 0.01, or top-k 1), or a softmax at the temperature, top-k, top-p and min-p, each renormalising what it
keeps, and a draw: the first token, in descending probability, whose cumulative probability reaches a uniform
number. Everything else (DRY, XTC, top-a, tail-free, typical, mirostat, smoothing, skew, dynamic or last
temperature, a penalty range or decay, constraints, banned strings) keeps the library's own path on the host:
`host_only` names what a job asks that sends it there.

It is off unless `EXLNB_DEVICE_SAMPLING=1` is set where the engine loads: timed in turns against the libraries'
own samplers it was slower, for greedy jobs (5.86 against 5.49 ms a token on the ExLlamaV3 engine, H200,
benchmarks/results/graphs-nvidia-h200-2026-11-27) and for sampled ones (6.84 against 6.39 on ExLlamaV3, 8.20
against 7.90 on ExLlamaV2, H100, benchmarks/results/speed-nvidia-h100-80gb-hbm3-2026-11-28): the host still waits
for each step's ids, so the draw adds its kernels and saves nothing. Queuing the next step before the host reads
the ids is what would make it pay. Even when on, greedy jobs keep the libraries' argmax.

The uniform number of a row is a hash of its job's seed and the token's index, so a seed gives the same draws
whatever else shares the batch; it is not the library's random stream, so a seeded job's text differs from the
same seed on the host path, and reproduces on this one.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from exlnb.engines.sampling import SamplerSettings


def device_sampling_on() -> bool:
    """Whether the engines draw sampled jobs on the GPU (`EXLNB_DEVICE_SAMPLING=1`, read at each load)."""
    return os.environ.get("EXLNB_DEVICE_SAMPLING", "0") == "1"


GREEDY_TEMPERATURE = 0.01  # exllamav2's sample_basic: a temperature below this is top-k 1
# How much a step's draw sorts, by what its rows ask: nothing where all are greedy, the likeliest TOP_CANDIDATES
# where every sampled row keeps at most that many (top-k, the default's 50 included), else the whole vocabulary
GREEDY, TOP_K, FULL = "greedy", "top-k", "full"
TOP_CANDIDATES = 64
MAX_BIASED = 64  # token bias entries (and blocked stop tokens) a row can carry on the device; more: host path
_DEVICE_SETTINGS = {
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "token_bias",
    "token_repetition_penalty",
    "token_frequency_penalty",
    "token_presence_penalty",
}


def host_only(settings: SamplerSettings) -> list[str]:
    """What these settings ask that the device sampler does not do, as "name=value"; [] where it does it all."""
    default = SamplerSettings()
    asked = [
        f"{f.name}={getattr(settings, f.name)!r}"
        for f in fields(settings)
        if f.name not in _DEVICE_SETTINGS and getattr(settings, f.name) != getattr(default, f.name)
    ]
    if len(settings.token_bias) > MAX_BIASED:
        asked.append(f"token_bias with {len(settings.token_bias)} entries (the device takes {MAX_BIASED})")
    return asked


@dataclass(frozen=True)
class Row:
    """One row of a step: its job's settings, seed and token index, its penalty slot, and the tokens it may not
    draw at this step (stop tokens before `min_new_tokens`)."""

    settings: SamplerSettings
    seed: int
    step: int
    slot: int
    blocked: Sequence[int] = ()


class DeviceSampler:
    """Static buffers for up to `rows` rows and the kernels that sample them; `stage` fills the buffers for a step,
    `sample` draws from them (inside a graph or not), `PenaltyCounts` keeps each job's token counts."""

    def __init__(self, rows: int, vocab: int, device: torch.device, penalties: PenaltyCounts) -> None:
        self.rows, self.vocab, self.device, self.penalties = rows, vocab, device, penalties
        self._floats = torch.zeros((rows, 7), dtype=torch.float32, device=device)  # temperature ... presence
        self._ints = torch.zeros((rows, 4), dtype=torch.int64, device=device)  # top_k, seed, step, slot
        self._bias_ids = torch.full((rows, MAX_BIASED), vocab, dtype=torch.int64, device=device)
        self._bias = torch.zeros((rows, MAX_BIASED), dtype=torch.float32, device=device)
        pinned = torch.cuda.is_available() and device.type == "cuda"
        self._staged = [
            torch.zeros_like(t, device="cpu", pin_memory=pinned)
            for t in (self._floats, self._ints, self._bias_ids, self._bias)
        ]
        self._biased = True  # whether staged rows carry bias entries that the next stage must clear
        self.mode = FULL  # what the staged rows need of `sample` (`_mode`)

    def stage(self, rows: Sequence[Row]) -> None:
        """Copy one step's rows into the static buffers (one copy each from pinned memory, not waited for)."""
        n = len(rows)
        floats, ints, bias_ids, bias = self._staged
        floats[:n] = torch.tensor([_setting_values(r.settings) for r in rows])
        ints[:n] = torch.tensor([[r.settings.top_k, r.seed & 0xFFFFFFFF, r.step, r.slot] for r in rows])
        copied = [self._floats, self._ints]
        if any(r.settings.token_bias or r.blocked for r in rows) or self._biased:
            bias_ids[:n].fill_(self.vocab)
            bias[:n].zero_()
            for i, row in enumerate(rows):
                entries = [*row.settings.token_bias, *((token, float("-inf")) for token in row.blocked)][:MAX_BIASED]
                if entries:
                    ids, values = zip(*entries)
                    bias_ids[i, : len(ids)] = torch.tensor([min(t, self.vocab) for t in ids])
                    bias[i, : len(ids)] = torch.tensor(values)
            copied += [self._bias_ids, self._bias]
            self._biased = any(r.settings.token_bias or r.blocked for r in rows)  # rows to clear next time
        staged = dict(zip(map(id, (self._floats, self._ints, self._bias_ids, self._bias)), self._staged))
        for device_buffer in copied:
            device_buffer[:n].copy_(staged[id(device_buffer)][:n], non_blocking=True)
        self.mode = _mode(rows)

    def sample(self, logits: torch.Tensor, mode: str | None = None) -> torch.Tensor:
        """The next token of each of the first `logits.shape[0]` rows (staged). `logits` is (rows, vocabulary or
        more); columns past the vocabulary are never drawn. `mode` (the staged rows' own by default) says how
        much of the vocabulary a draw sorts (`_mode`): a graph records one mode, so it is part of its key. The
        penalty counts are read, not moved on: a graph's warm-up runs repeat this, so `count` is a step of its
        own, run once per draw."""
        n = logits.shape[0]
        f, i = self._floats[:n], self._ints[:n]
        return sample_rows(
            logits.reshape(n, -1)[:, : self.vocab].float(),
            self.penalties.counts.index_select(0, i[:, 3])[:, : self.vocab],
            temperature=f[:, 0],
            top_p=f[:, 1],
            min_p=f[:, 2],
            repetition=f[:, 3],
            frequency=f[:, 4],
            presence=f[:, 5],
            greedy=f[:, 6] > 0,
            top_k=i[:, 0],
            seeds=i[:, 1],
            steps=i[:, 2],
            bias_ids=self._bias_ids[:n],
            bias=self._bias[:n],
            mode=mode or self.mode,
        )

    def count(self, tokens: torch.Tensor) -> None:
        """Move the staged rows' penalty counts on by the tokens they drew."""
        self.penalties.count(self._ints[: tokens.shape[0], 3], tokens)


class PenaltyCounts:
    """How often each token occurs in each job's sequence so far (prompt included), one row per slot: what the
    penalties read, kept on the device and moved on by every draw, so that no sequence crosses to the GPU."""

    def __init__(self, slots: int, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.counts = torch.zeros((slots, vocab + 1), dtype=torch.int32, device=device)  # + a column for ids past it
        self._free = list(range(slots))

    def take(self, prompt: Sequence[int]) -> int:
        """A slot for a new job, its counts set to its prompt's."""
        if not self._free:
            raise RuntimeError("every penalty slot is taken: a job ended without giving its slot back")
        slot = self._free.pop()
        ids = torch.tensor([min(t, self.vocab) for t in prompt], dtype=torch.int64).to(self.counts.device)
        self.counts[slot].zero_()
        self.counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return slot

    def give_back(self, slot: int) -> None:
        self._free.append(slot)

    def count(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        self.counts.index_put_(
            (slots, tokens.clamp(max=self.vocab)), torch.ones_like(tokens, dtype=torch.int32), accumulate=True
        )


@dataclass
class JobDraw:
    """What a job drawn on the device carries from step to step: its settings, its seed, its prompt (the penalties
    count it), the stop tokens it may not draw before `min_new_tokens` (exllamav2's blocked tokens), and its
    penalty slot, taken at its first draw (a job waiting in the queue holds none) and given back at its end."""

    settings: SamplerSettings
    seed: int
    prompt: tuple[int, ...]
    min_new_tokens: int = 0
    stop_ids: tuple[int, ...] = ()
    slot: int | None = None


IDLE_SETTINGS = SamplerSettings.greedy()  # a row sampled on the host: drawn on the device too, and ignored


class DeviceDraws:
    """An engine's sampling on the device: the decode step's rows staged before its graph replays, the graph's
    draws remembered by job for the library's jobs to take, and a one-row draw for a step that ran eagerly.

    A job is drawn here when `drawable` says so; its token reaches the library through the job's sampler (each
    engine wraps that), so the library's own bookkeeping (stop conditions, pages, results) runs unchanged."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        # a slot per job of a batch, twice over (a job ending and the next starting within one step), and the idle
        # rows' own
        self.penalties = PenaltyCounts(2 * rows + 1, vocab, device)
        self._idle_slot = self.penalties.take(())  # what idle rows read and count into
        self.batch = DeviceSampler(rows, vocab, device, self.penalties)
        self._alone = DeviceSampler(1, vocab, device, self.penalties)
        self._alone_lock = threading.Lock()  # exllamav2 samples its jobs on a thread pool
        self._drawn: dict[object, int] = {}  # job key -> row of the step's draws
        self._tokens: torch.Tensor | None = None
        self._host_tokens = torch.zeros((rows,), dtype=torch.int64, pin_memory=device.type == "cuda")
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self.drawn_steps = 0  # steps whose tokens came out of a graph

    @staticmethod
    def drawable(spec) -> list[str]:
        """Why a job cannot be drawn on the device, as "name=value (why)"; [] where it can."""
        why = [f"{asked} (sampled on the host)" for asked in host_only(spec.sampler)]
        if spec.constraint is not None:
            why.append(f"constraint={spec.constraint.describe()} (masked on the host)")
        if spec.banned_strings:
            why.append("banned_strings (rewinds on the host)")
        return why

    @staticmethod
    def start(spec) -> JobDraw:
        seed = spec.seed if spec.seed is not None else int(torch.randint(0, 2**32, ()).item())
        return JobDraw(spec.sampler, seed, spec.input_ids, spec.min_new_tokens, tuple(sorted(spec.stop_token_ids)))

    def row(self, draw: JobDraw, step: int) -> Row:
        """The job's row at its `step`-th token (its penalty slot taken at the first)."""
        if draw.slot is None:
            draw.slot = self.penalties.take(draw.prompt)
        blocked = draw.stop_ids if step < draw.min_new_tokens else ()
        return Row(draw.settings, draw.seed, step, draw.slot, blocked)

    def end(self, draw: JobDraw) -> None:
        if draw.slot is not None:
            self.penalties.give_back(draw.slot)
            draw.slot = None

    def stage(self, rows: Sequence[tuple[object, Row | None]], batch: int) -> str | None:
        """Stage one step's rows, in the batch's order (each job's key and its row, or None for a job the host
        samples). Where they are the batch's and any is drawn here, the step's graph draws them: the mode it
        samples in (`DeviceSampler.sample`, part of the graph's key); else None."""
        self.forget_step()
        if len(rows) != batch or not any(row for _, row in rows):
            return None
        idle = Row(IDLE_SETTINGS, 0, 0, self._idle_slot)
        self.batch.stage([row or idle for _, row in rows])
        self._drawn = {key: i for i, (key, row) in enumerate(rows) if row is not None}
        return self.batch.mode

    def remember(self, tokens: torch.Tensor) -> None:
        """The staged step's draws (from its graph): counted for the penalties, copied to the host, kept by job."""
        self.batch.count(tokens)
        self._tokens = tokens
        with torch.cuda.device(tokens.device) if tokens.is_cuda else contextlib.nullcontext():
            self._host_tokens[: tokens.shape[0]].copy_(tokens, non_blocking=True)
            if self._copied is not None:
                self._copied.record()
        self.drawn_steps += 1

    def forget_step(self) -> None:
        self._drawn, self._tokens = {}, None

    def token(self, key: object) -> torch.Tensor | None:
        """The job's draw of this step, on the device, (1, 1); None where the step was not drawn in a graph."""
        row = self._drawn.get(key) if self._tokens is not None else None
        return None if row is None else self._tokens[row : row + 1].view(1, 1)

    def host_token(self, key: object) -> int | None:
        """The same, read on the host (the copy `remember` started)."""
        row = self._drawn.get(key) if self._tokens is not None else None
        if row is None:
            return None
        if self._copied is not None:
            self._copied.synchronize()
        return int(self._host_tokens[row])

    def draw_alone(self, row: Row, logits: torch.Tensor) -> torch.Tensor:
        """One job's draw from its own logits, outside any graph (a step that ran eagerly): (1, 1), counted."""
        with self._alone_lock:
            self._alone.stage([row])
            token = self._alone.sample(logits.reshape(1, -1).to(self._alone.device))
            self._alone.count(token)
            return token.view(1, 1)


def sample_rows(
    logits: torch.Tensor,
    counts: torch.Tensor,
    *,
    temperature,
    top_p,
    min_p,
    repetition,
    frequency,
    presence,
    greedy,
    top_k,
    seeds,
    steps,
    bias_ids,
    bias,
    mode: str = "full",
) -> torch.Tensor:
    """exllamav2's sampling of each row by its own settings (module docstring), in fixed-shape tensor operations.
    Every argument but `logits` (rows, vocabulary) and `counts` (rows, vocabulary) is one value per row, except
    `bias_ids` and `bias` (rows, entries; an id equal to the vocabulary size is padding). `mode` (`_mode`) is
    GREEDY where every row is greedy (an argmax, nothing sorted), TOP_K where every sampled row keeps at most
    TOP_CANDIDATES tokens (only they are sorted), else FULL."""
    rows, vocab = logits.shape
    x = penalised(logits, counts, repetition, frequency, presence)
    x = torch.cat([x, x.new_zeros((rows, 1))], 1).scatter_add_(1, bias_ids, bias)[:, :vocab]
    chosen = x.argmax(1)
    if mode == GREEDY:
        return chosen
    t = torch.where(greedy, torch.ones_like(temperature), temperature.clamp(min=GREEDY_TEMPERATURE))
    probs = torch.softmax((x - x.max(1, keepdim=True).values) / t[:, None], dim=1)
    if mode == TOP_K:  # the same candidates in the same order as a whole sort's first TOP_CANDIDATES
        probs, order = torch.topk(probs, min(TOP_CANDIDATES, vocab), dim=1)
    else:
        probs, order = torch.sort(probs, dim=1, descending=True)
    rank = torch.arange(probs.shape[1], device=logits.device)
    keep = rank < torch.where(top_k > 0, top_k, vocab)[:, None]
    kept = _renormalised(probs, keep)
    nucleus = ((kept.cumsum(1) <= top_p[:, None]) & keep).sum(1).clamp(min=1)
    keep &= (top_p[:, None] >= 1) | (rank < nucleus[:, None])
    kept = _renormalised(probs, keep)
    keep &= kept >= kept[:, :1] * min_p[:, None]
    kept = _renormalised(probs, keep)
    below = (kept.cumsum(1) < uniform(seeds, steps)[:, None]).sum(1)
    drawn = order.gather(1, torch.minimum(below, keep.sum(1) - 1)[:, None]).squeeze(1)
    return torch.where(greedy, chosen, drawn)


def _mode(rows: Sequence[Row]) -> str:
    sampled = [r.settings for r in rows if not r.settings.is_greedy]
    if not sampled:
        return GREEDY
    return TOP_K if all(0 < s.top_k <= TOP_CANDIDATES for s in sampled) else FULL


@functools.lru_cache(maxsize=256)
def _setting_values(s: SamplerSettings) -> tuple[float, ...]:
    """A row's floating-point settings, in the order of the sampler's buffer."""
    return (
        s.temperature,
        s.top_p,
        s.min_p,
        s.token_repetition_penalty,
        s.token_frequency_penalty,
        s.token_presence_penalty,
        float(s.is_greedy),
    )


def penalised(logits, counts, repetition, frequency, presence) -> torch.Tensor:
    """exllamav2's penalties over the whole sequence: a token present is divided (or, below 0, multiplied) by the
    repetition penalty and lowered by the presence penalty once, and by the frequency penalty per occurrence."""
    present = counts > 0
    r = repetition[:, None]
    once = torch.where(logits > 0, logits / r, logits * r) - presence[:, None]
    return torch.where(present, once, logits) - frequency[:, None] * counts


def _renormalised(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    kept = probs * keep
    return kept / kept.sum(1, keepdim=True)


def uniform(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """A number in [0, 1) for each (seed, step), the same on any device: a 32-bit integer hash (the finaliser of
    MurmurHash3 over the two words mixed), in int64 arithmetic that never overflows."""
    h = (_mul32(seeds & 0xFFFFFFFF, 0x9E3779B1) ^ _mul32(steps & 0xFFFFFFFF, 0x85EBCA77)) & 0xFFFFFFFF
    h ^= h >> 16
    h = _mul32(h, 0x85EBCA6B)
    h ^= h >> 13
    h = _mul32(h, 0xC2B2AE35)
    h ^= h >> 16
    return h.to(torch.float64).div(2.0**32).to(torch.float32).clamp(max=1.0 - 2.0**-24)


def _mul32(a: torch.Tensor, b: int) -> torch.Tensor:
    """(a x b) mod 2^32 for 32-bit a and b, in 16-bit halves so that no product passes 2^48."""
    low, high = a & 0xFFFF, a >> 16
    return (low * b + ((high * b) & 0xFFFF) * 65536) & 0xFFFFFFFF
