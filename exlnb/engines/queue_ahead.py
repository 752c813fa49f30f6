"""Queuing a decode step before the generator asks for it, so that the GPU computes step t+1 while the host turns
step t's tokens into text, events and the next step's tables. Both graph decoders do it, each where its library lets
the tokens be known early.

exllamav3 1.6.5's generator, after each decode step, waits for the sampled tokens, hands them to the model's
`prefetch_tokens` (the next forward's inputs, known from then on), and only then does its host work: each job's
text, stop conditions and results, then exlnb's events and the next step's tables. On an H100 the GPU sat idle for
0.51 ms of a 2.36 ms EXL3 step while the host worked (benchmarks/results/speed-nvidia-h100-80gb-hbm3-2026-11-28-exl3).
A decoder that replays the whole step from one graph can start the next step at `prefetch_tokens`, guessing its
shape (`next_step`): the same rows, each one token longer, over the same block table.

exllamav2 0.3.2 has no such hand-over: its generator copies every row's logits to the host and then samples and
finishes each job in turn, 3.1 ms of host work in a batch-8 step of 8.6 during which the GPU idled (H200, step clock,
benchmarks/results/speed-nvidia-h200-x2-2026-11-28-fused). Where every row's token is its logits' argmax (a greedy
job with nothing that changes its logits, `takes_the_argmax`), the ExLlamaV2 decoder takes that argmax itself right
after the replay and queues the next step on a stream of its own, so that the generator's copy of this step's logits
does not wait for it; each row's pages there cover exactly its tokens so far (`pages_hold`).

Either way the generator's next forward is then held against the guess (`Ahead.matches`): where they agree, its
output is the queued step's; where they do not (a job ended, joined or rewound), the queued step is dropped and the
step runs as asked.

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


def queue_before_wait_on() -> bool:
    """Whether the ExLlamaV3 decoder queues the next step at the forward, before exllamav3's generator waits, from the
    step's argmax on the card (on unless `EXLNB_QUEUE_BEFORE_WAIT=0`, read at each load: 9.8 % faster at batch 1 on
    an H200, timed in turns); else it queues at `prefetch_tokens`, after the wait."""
    return os.environ.get("EXLNB_QUEUE_BEFORE_WAIT", "1") != "0"


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


def next_step(last: Step, rows: int, capacities: Sequence[int] | None, page_size: int) -> Step | None:
    """The step that follows `last` if each of its `rows` goes on with one more token; None where it cannot be
    guessed safely: `rows` (the rows the engine decodes now) or their `capacities` (how many tokens each row's
    allocated pages hold, in batch order) are not the step's, or a row's next position lies past its pages or past
    the block table its graph reads."""
    # the narrower of the library's own table (exllamav2's graphs pad it on the card with columns no row may write
    # through) and the graph's (exllamav3's graphs read only the pages the step needs)
    batch, width = last.key[0], min(last.key[1], last.block_table.shape[1])
    if rows != batch or capacities is None or len(capacities) != batch:
        return None
    # on the host in plain ints: this runs between two steps while the GPU waits (a tensor op costs microseconds)
    most = width * page_size
    if any(length + 1 >= min(capacity, most) for length, capacity in zip(last.lengths.tolist(), capacities)):
        return None
    return Step(last.key, last.block_table, last.lengths + 1)


def argmax_on_its_way(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]:
    """Each row's argmax of its last position, kept on the card for the step queued on it, and its copy on its way to
    pinned host memory with the event that ends the copy: what `Ahead.matches` holds the step asked for against,
    without waiting for the step that made the logits."""
    argmax = logits[:, -1].argmax(-1, keepdim=True)
    tokens, read = torch.empty(argmax.shape, dtype=argmax.dtype, pin_memory=True), torch.cuda.Event()
    tokens.copy_(argmax, non_blocking=True)
    read.record()
    return argmax, tokens, read


def pages_hold(lengths: torch.Tensor, page_size: int) -> list[int]:
    """How many tokens each row's block-table pages hold where the library gave each row the pages its tokens so far
    need, this step's input token included (exllamav2 0.3.2's `get_block_index`): a row whose cache holds `length`
    tokens has length + 1 of them."""
    return [(length // page_size + 1) * page_size for length in lengths.tolist()]


def takes_the_argmax(spec) -> bool:
    """Whether a job's next token is the argmax of its step's raw logits, so that a decoder may guess it: greedy,
    with no penalty, bias, DRY, constraint or banned string to change the logits first (a guess is only a guess:
    the step asked for is held against it, and a wrong one is dropped)."""
    s = spec.sampler
    return (
        s.is_greedy
        and s.token_repetition_penalty == 1.0
        and s.token_frequency_penalty == 0.0
        and s.token_presence_penalty == 0.0
        and not s.token_bias
        and s.dry_multiplier == 0.0
        and s.xtc_probability == 0.0
        and spec.constraint is None
        and not spec.banned_strings
    )


def said(on: bool, used: int, queued: int) -> str:
    """The status line's part on queuing ahead ("" where the decoder does not queue)."""
    return f", {used} of {queued} steps queued ahead used" if on else ""


@dataclass
class Ahead:
    """A step queued ahead: its shape, its input tokens (batch, 1) on the host, its graph's output and, where it runs
    on a stream of its own, the event that ends it there. Tokens still on their way to the host come with the event
    that ends their copy (`read`) and the card's tensor the copy and the queued step read (`source`), kept alive
    until the step is used or dropped."""

    step: Step
    input_ids: torch.Tensor
    output: torch.Tensor
    done: torch.cuda.Event | None = None
    read: torch.cuda.Event | None = None
    source: torch.Tensor | None = None

    def matches(
        self, key: tuple[int, int], input_ids: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor
    ) -> bool:
        """Whether the step the generator asks for is this one: same shape, tokens, block table and lengths."""
        if self.read is not None:
            self.read.synchronize()  # the copy of the tokens, which ended long before the queued step does
        return (
            key == self.step.key
            and torch.equal(_on_host(input_ids).view(-1).long(), self.input_ids.view(-1))
            and torch.equal(_on_host(block_table), self.step.block_table)
            and torch.equal(_on_host(lengths), self.step.lengths)
        )


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.device.type == "cpu" else tensor.cpu()
