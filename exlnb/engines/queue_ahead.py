"""Queuing a decode step before the generator asks for it, so that the GPU computes step t+1 while the host turns
step t's tokens into text, events and the next step's tables.

exllamav3 1.6.5's generator, after each decode step, waits for the sampled tokens, hands them to the model's
`prefetch_tokens` (the next forward's inputs, known from then on), and only then does its host work: each job's
text, stop conditions and results, then exlnb's events and the next step's tables. On an H100 the GPU sat idle for
0.51 ms of a 2.36 ms EXL3 step while the host worked (benchmarks/results/speed-nvidia-h100-80gb-hbm3-2026-11-28-exl3).
A decoder that replays the whole step from one graph can start the next step at `prefetch_tokens`, guessing its
shape (`next_step`): the same rows, each one token longer, over the same block table. The generator's next forward
is then held against the guess (`Ahead.matches`): where they agree, its output is the queued step's; where they do
not (a job ended, joined or rewound), the queued step is dropped and the step runs as asked.

What a dropped step wrote is never read: it wrote keys and values only at each row's next position, which a row
that goes on rewrites with the same token later in the stream, and which the pages of a row that ended hold past
their valid length, where the next owner writes before it reads. `next_step` keeps the guess inside each row's
allocated pages and inside the block table's width, so that no write lands on a page another row owns.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def queue_ahead_on() -> bool:
    """Whether a graph decoder queues the next step ahead (on unless `EXLNB_QUEUE_AHEAD=0`, read at each load): the
    switch exists to time the two against each other."""
    return os.environ.get("EXLNB_QUEUE_AHEAD", "1") != "0"


@dataclass(frozen=True)
class Step:
    """A decode step's shape on the host: its graph's key (batch size, block-table width), its block table and the
    cache lengths its rows start from (the positions its tokens are written at)."""

    key: tuple[int, int]
    block_table: torch.Tensor  # (batch, width) int32, a copy: the generator reuses its staging buffers
    lengths: torch.Tensor  # (batch,) int32

    @classmethod
    def of(cls, key: tuple[int, int], block_table: torch.Tensor, lengths: torch.Tensor) -> Step:
        return cls(key, _on_host(block_table).clone(), _on_host(lengths).clone())


def next_step(last: Step, tokens: Sequence[int], capacities: Sequence[int] | None, page_size: int) -> Step | None:
    """The step that follows `last` if every row goes on with its token in `tokens`; None where it cannot be guessed
    safely: the tokens or the rows' `capacities` (how many tokens each row's allocated pages hold, in batch order)
    are not one per row, or a row's next position lies past its pages or past the block table's width."""
    batch, width = last.key
    if len(tokens) != batch or capacities is None or len(capacities) != batch:
        return None
    lengths = last.lengths + 1
    room = torch.tensor(capacities, dtype=lengths.dtype).clamp(max=width * page_size)
    if bool((lengths >= room).any()):
        return None
    return Step(last.key, last.block_table, lengths)


@dataclass
class Ahead:
    """A step queued ahead: its shape, its input tokens (batch, 1) on the host and its graph's output."""

    step: Step
    input_ids: torch.Tensor
    output: torch.Tensor

    def matches(
        self, key: tuple[int, int], input_ids: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor
    ) -> bool:
        """Whether the step the generator asks for is this one: same shape, tokens, block table and lengths."""
        return (
            key == self.step.key
            and torch.equal(_on_host(input_ids).view(-1).long(), self.input_ids.view(-1))
            and torch.equal(_on_host(block_table), self.step.block_table)
            and torch.equal(_on_host(lengths), self.step.lengths)
        )


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.device.type == "cpu" else tensor.cpu()
