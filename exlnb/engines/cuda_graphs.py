"""Capturing and replaying a decode step as CUDA graphs: what the two GPU engines' graph decoders share.

Each engine's decoder (`exllamav2/graph_decode.py`, `exllamav3/graph_decode.py`) knows its library: which steps
qualify, how the inputs reach static buffers, which modules run inside a graph. This module holds the part that
is the same for both: the width buckets a step is padded or cut to, a layer split's runs of modules by card, the one
capture stream per device and the lock a capture holds it by, `StepGraphs` (the captured graphs of one model on one
card, keyed by shape, each captured after warm-up runs on that stream and all drawing on one memory pool), and the
load check's comparison of a replayed step with the eager one.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from exlnb.engines.base import one_line

# eager runs before a capture: torch.cuda.graph's docs ask for some, and exllamav3 builds its own per-layer graphs on
# a module's third call, which must happen before the capture, not inside it
WARMUP_RUNS = 3
CHECK_TOLERANCE = 2e-2  # max |replay - eager| over max |eager| logit at which a load check still passes


def relative_difference(value: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest difference of `value` from `reference` over the largest of `reference`: what every load check
    (a replay against eager, fused against separate products, a kernel against the library's) measures."""
    return float((value - reference).abs().max() / reference.abs().max().clamp_min(1e-6))


def beyond_tolerance(difference: float) -> bool:
    """Whether a load check fails at this `relative_difference`: past CHECK_TOLERANCE, or not a number at all."""
    return not math.isfinite(difference) or difference > CHECK_TOLERANCE


def replay_differs(batch: int, eager: torch.Tensor, replayed: torch.Tensor) -> str | None:
    """Why a replayed step's logits cannot stand in for the eager step's, in a line; None where they agree."""
    if replayed.shape != eager.shape:
        return f"a batch-{batch} replay gave logits of shape {tuple(replayed.shape)}, eager {tuple(eager.shape)}"
    error = relative_difference(replayed, eager)
    if beyond_tolerance(error):
        return f"a batch-{batch} replay's logits differ from eager by {error:.3g} of their largest"
    if not torch.equal(replayed.argmax(-1), eager.argmax(-1)):
        return f"a batch-{batch} replay picks a different greedy token than eager"
    return None


def by_card(modules: list, card_of: Callable[[object], torch.device]) -> list[tuple[torch.device, list]]:
    """Consecutive modules grouped by the card they run on, in order: a layer split's segments, each replayed as
    one graph, the hidden state copied from card to card in between as the library's own split copies it."""
    runs: list[tuple[torch.device, list]] = []
    for module in modules:
        card = card_of(module)
        if runs and runs[-1][0] == card:
            runs[-1][1].append(module)
        else:
            runs.append((card, [module]))
    return runs


def buckets(limit: int) -> tuple[int, ...]:
    """Powers of two below `limit`, then `limit` itself: every size up to `limit` pads to at most twice itself."""
    sizes = [1 << k for k in range(max(limit, 1).bit_length()) if 1 << k < limit]
    return (*sizes, limit)


def bucket_for(size: int, sizes: tuple[int, ...]) -> int | None:
    return next((b for b in sizes if b >= size), None)


def cut_width(table_width: int, longest: int, page_size: int, sizes: tuple[int, ...]) -> int:
    """The block-table width a decode step's graph reads where the library pads its table past the pages the step
    needs: the pages its longest row (`longest` tokens cached) needs with this step's token, bucketed to `sizes`,
    never wider than the library's table. A kernel that splits its keys by the table's width launches no work past
    the need."""
    bucket = bucket_for(longest // page_size + 1, sizes)
    return table_width if bucket is None else min(bucket, table_width)


_capture_streams: dict[torch.device, tuple[torch.cuda.Stream, threading.RLock]] = {}
_capture_streams_made = threading.Lock()


def capture_stream(device: torch.device) -> tuple[torch.cuda.Stream, threading.RLock]:
    """One stream per device for every warm-up and capture, of every model loaded in the process, and the lock a
    warm-up and capture hold it by. cuBLAS keeps a workspace (32 MiB on an H100) for each stream it has run on and
    never frees it: a new stream per capture made each reload hold 32 MiB more until the process ended (the
    twenty-reloads test). A stream being captured records what any thread enqueues on it, so two engine threads
    (two sessions in one process) capturing on it at once would each fail, or record the other's warm-up kernels
    into its graph, to run again at every replay over memory the other may since have freed."""
    with _capture_streams_made:
        if device not in _capture_streams:
            _capture_streams[device] = (torch.cuda.Stream(device), threading.RLock())
        return _capture_streams[device]


class CaptureFailed(RuntimeError):
    """A graph could not be captured for a step; the step runs eagerly instead."""


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor  # the graph's output buffer, rewritten by every replay


class StepGraphs:
    """The graphs of one model on one device, keyed by the shape of the step they replay."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._graphs: dict[Hashable, Captured] = {}
        self._pool = torch.cuda.graph_pool_handle()  # one pool: the graphs never replay at the same time
        self.graph_bytes = 0  # device memory the captures reserved
        self.replays = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def replay(
        self,
        key: Hashable,
        step: Callable[[], Callable[[], torch.Tensor]],
        *,
        shape: str,
        around_capture: Callable[[], None] = lambda: None,
    ) -> torch.Tensor:
        """Replay the graph for `key`, capturing it first where there is none yet: `step()` is called then, once,
        and gives the function whose work the graph records (its output is the graph's). The warm-up runs compute
        the very step being run (over the static inputs already staged), so a capture in the middle of a
        generation disturbs no sequence: it writes the keys and values that step writes anyway. `around_capture`
        runs just before and just after the capture (a library's cached state the graph must not inherit); `shape`
        names the step in the message of a capture that fails ("batch 3 over 2 pages")."""
        captured = self._graphs.get(key)
        if captured is None:
            try:
                captured = self._capture(key, step(), around_capture)
            except Exception as error:  # nothing ran yet that eager decode would not run again
                raise CaptureFailed(f"capturing {shape} failed: {one_line(error)}") from error
        with torch.cuda.device(self.device):  # a graph replays on its own card's current stream
            captured.graph.replay()
        self.replays += 1
        return captured.output

    def _capture(self, key: Hashable, run: Callable[[], torch.Tensor], around_capture: Callable[[], None]) -> Captured:
        side, held = capture_stream(self.device)
        with held, torch.cuda.device(self.device):
            return self._capture_here(key, run, around_capture, side)

    def _capture_here(
        self,
        key: Hashable,
        run: Callable[[], torch.Tensor],
        around_capture: Callable[[], None],
        side: torch.cuda.Stream,
    ) -> Captured:
        reserved = torch.cuda.memory_reserved(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        around_capture()
        with torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
            output = run()
        around_capture()
        self.graph_bytes += max(0, torch.cuda.memory_reserved(self.device) - reserved)
        self._graphs[key] = Captured(graph, output)
        return self._graphs[key]

    def clear(self) -> None:
        self._graphs.clear()

    def describe(self) -> str:
        return f"{len(self._graphs)} captured, {self.graph_bytes / 2**20:.0f} MiB"
