"""Where a graphed decode step's time goes, without a profiler: the host's moments of each step beside the GPU's
start and end of each replay, so that a step's wall time splits into the graph's GPU time and the GPU's idle gap
before the next graph, and the gap into what the host was doing.

The torch profiler inflates exactly what is in question (its host hooks cost as much as the gap, 2026-11-28: 4.15
ms a 2.34 ms EXL3 step under it), and CUDA events with host timestamps do not. A decoder calls `asked`, `returned`,
`tokens_known` and `queued` at those moments (a decoder without a hook where the tokens are known, as the
ExLlamaV2 one, counts everything after the return as bookkeeping), and `replay` around each replay on the card
whose output is the logits; `account` turns the steps into means. Off unless a benchmark starts one
(`GraphDecoder.clock`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

PHASES = ("forward", "sample_and_wait", "queue", "bookkeeping")  # the host's parts of a step, in order


@dataclass
class StepTimes:
    """One decode step as the clock saw it: host moments (seconds, perf_counter) and the replay's GPU events."""

    asked: float
    returned: float | None = None
    tokens_known: float | None = None  # the generator handed over the sampled tokens
    queued: float | None = None  # the next step was queued ahead by then
    ahead: bool = False  # this step's replay was queued ahead of its asking
    events: list[torch.cuda.Event] = field(default_factory=list)  # start and end of its replay


class StepClock:
    """The times of up to `limit` decode steps, in order."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self.steps: list[StepTimes] = []
        self._pending: list[torch.cuda.Event] | None = None  # a replay queued ahead, for the step that asks for it

    def asked(self) -> None:
        if len(self.steps) < self.limit:
            self.steps.append(StepTimes(time.perf_counter()))

    def returned(self, *, ahead: bool) -> None:
        if self.steps:
            step = self.steps[-1]
            step.returned, step.ahead = time.perf_counter(), ahead
            if ahead and self._pending:
                step.events = self._pending
            self._pending = None

    def tokens_known(self) -> None:
        if self.steps:
            self.steps[-1].tokens_known = time.perf_counter()

    def queued(self) -> None:
        if self.steps:
            self.steps[-1].queued = time.perf_counter()

    @contextlib.contextmanager
    def replay(self, *, ahead: bool) -> Iterator[None]:
        """Around a replay on the logits' card: its start and end on that card's stream."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        if ahead:
            self._pending = [start, end]
        elif self.steps:
            self.steps[-1].events = [start, end]

    def account(self) -> dict:
        """The steps' means in ms (`account`), the replays' events read now (a synchronize first)."""
        torch.cuda.synchronize()
        timed = [step for step in self.steps if len(step.events) == 2 and step.returned is not None]
        graph_ms = [step.events[0].elapsed_time(step.events[1]) for step in timed]
        gap_ms = [step.events[1].elapsed_time(following.events[0]) for step, following in zip(timed, timed[1:])]
        return account(timed, graph_ms, gap_ms)


def timed_replay(
    clock: StepClock | None, device: torch.device, *, ahead: bool = False
) -> contextlib.AbstractContextManager:
    """The clock's record of a replay on `device` (the card whose output is the logits), on that card's current
    stream; nothing where no clock runs."""
    if clock is None:
        return contextlib.nullcontext()
    timed = contextlib.ExitStack()
    timed.enter_context(torch.cuda.device(device))
    timed.enter_context(clock.replay(ahead=ahead))
    return timed


def account(steps: list[StepTimes], graph_ms: list[float], gap_ms: list[float]) -> dict:
    """Means over consecutive steps, in ms: the wall time from one asking to the next, the graph's GPU time and the
    GPU's gap after it, and the host's phases (`PHASES`): forward (asked to returned), sample_and_wait (returned
    to the tokens handed over: the library's sampler and its wait for the GPU), queue (to the next step queued
    ahead; 0 where none was), bookkeeping (from then to the next asking)."""
    n = len(steps) - 1
    if n < 1:
        return {"steps": len(steps)}
    phases = {name: 0.0 for name in PHASES}
    for step, following in zip(steps, steps[1:]):
        known = step.tokens_known if step.tokens_known is not None else step.returned
        queued = step.queued if step.queued is not None else known
        phases["forward"] += step.returned - step.asked
        phases["sample_and_wait"] += known - step.returned
        phases["queue"] += queued - known
        phases["bookkeeping"] += following.asked - queued
    wall = sum(b.asked - a.asked for a, b in zip(steps, steps[1:]))
    return {
        "steps": n,
        "wall_ms": 1000 * wall / n,
        "graph_ms": sum(graph_ms[:n]) / max(len(graph_ms[:n]), 1),
        "gpu_gap_ms": sum(gap_ms[:n]) / max(len(gap_ms[:n]), 1),
        "host_ms": {name: 1000 * total / n for name, total in phases.items()},
        "queued_ahead": sum(s.ahead for s in steps[1:]) / n,
    }
