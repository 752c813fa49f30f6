"""Decode steps of an ExLlamaV3 model replayed from CUDA graphs: every layer of a step in one replay per card.

exllamav3 1.6.5 graphs a decode step only layer by layer, and only where every projection is EXL3 (its "BC"
paths); unquantized weights take its eager path, launching each kernel from Python. On an H100 that left the GPU
busy 16% of a 7B-shaped fp16 step, 5.2x the weights-over-bandwidth floor where the kernels alone took 1.3x
(benchmarks/results/speed-nvidia-h100-80gb-hbm3-2026-11-26-one-start). A graph of the whole step replays all of
it with one launch per card, for fp16, EXL3 and mixed models alike.

How the generator's decode steps become replays: `install()` puts `GraphDecoder.forward` in front of the model's
own. A step qualifies when it is the generator's paged decode (one token per sequence, a block table, no draft,
no recurrent state, no per-job RoPE positions, no embeddings of images); anything else (prefill, warm-up passes,
scoring) runs the model's own method unchanged. The step's tokens are embedded on the first card from a checked
copy of the table (token_feed.py), else the modules that take their input on the host (the embedding, which
exllamav3 keeps on the CPU) run eagerly first; the hidden state, the block table and the cache lengths are
copied into static buffers on each card; then each card's consecutive modules replay as one graph, the hidden
state copied from card to card in between, as exllamav3's own layer split copies it. A graph is captured on
first use per batch size and block-table width. The generator pads its table to a multiple of 16 pages; the graph
reads only the pages the longest row needs, bucketed 1, 2, 4, ... pages as the ExLlamaV2 decoder buckets them
(`cuda_graphs.cut_width`): exlnb's decode attention splits the keys by the table's width, and on the padded table
a step at 256 tokens launched 16 splits a head and a combine pass, 0.29 ms of attention where the ExLlamaV2
engine's one-page table took 0.18 (7B-shaped, H200 profiles, benchmarks/results/speed-nvidia-h200-2026-11-28-cut).
The batch is not padded, since a GEMM of 8 rows rounds differently from one of 5 and padded batches flipped greedy
tokens against eager decode on exllamav2 (graph_decode.py there).

The decoder also stands in for the model's `prefetch_tokens`, where the generator hands over the tokens it has just
sampled: there it queues the next step ahead, so that the GPU computes it while the host does the step's
bookkeeping (queue_ahead.py says how a guess is made, checked and dropped). The generator waits for the whole
device before that, so the GPU would idle from the end of a step to that queue; on one card with the token feed on
(unless `EXLNB_QUEUE_BEFORE_WAIT=0`) the next step is queued at the forward instead, from the step's argmax on the
card, on a stream of its own, and the generator's wait is narrowed to its own stream (narrow_wait.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from exlnb.engines.base import one_line
from exlnb.engines.cuda_graphs import CaptureFailed, StepGraphs, buckets, by_card, cut_width
from exlnb.engines.device_sampling import DeviceDraws, Row
from exlnb.engines.exllamav3.capture_fixes import pinned_pointer_tables, turn_library_graphs_off
from exlnb.engines.exllamav3.graph_checks import PASS_PARAMETERS, TABLE_STEP, decode_params, host_prologue, self_check
from exlnb.engines.exllamav3.narrow_wait import narrow_the_generator_s_wait
from exlnb.engines.exllamav3.token_feed import feed_for
from exlnb.engines.options import PAGE_TOKENS
from exlnb.engines.queue_ahead import (
    Ahead,
    Step,
    argmax_on_its_way,
    next_step,
    queue_ahead_on,
    queue_before_wait_on,
    said,
)
from exlnb.engines.step_clock import StepClock, timed_replay
from exlnb.engines.token_feed import TokenFeed, token_feed_on

# the parameters exllamav3's generator passes a plain decode step (Generator.iterate_gen); any other, such as a
# draft model's verifier parameters, makes the step run eagerly
_DECODE_PARAMETERS = PASS_PARAMETERS | {"positions", "recurrent_history", "pinned_staging", "dev_cache"}


@dataclass
class _Card:
    """One card's run of consecutive modules, replayed as one graph, with its copy of the step's tables."""

    device: torch.device
    modules: list  # (module, layer instance, index) as exllamav3's Model.fwd_modules lists them
    graphs: StepGraphs
    tables: torch.Tensor  # room for the widest block table of the largest batch, int32
    seqlens: torch.Tensor  # (max batch,) int32
    hidden: torch.Tensor | None = None  # the card's input, (max batch, 1, hidden), made at first use

    def block_table(self, batch: int, width: int) -> torch.Tensor:
        """The static block table of one shape, contiguous as exllamav3's attention requires."""
        return self.tables[: batch * width].view(batch, width)


class GraphDecoder:
    """Replays the decode steps of one ExLlamaV3 model and cache from CUDA graphs (see the module docstring)."""

    def __init__(self, model, cache, *, max_batch_size: int, max_pages: int) -> None:
        self.model, self.cache = model, cache
        self._eager = model.forward  # the model's own bound method
        self.max_batch_size = max_batch_size
        self.max_width = -(-max_pages // TABLE_STEP) * TABLE_STEP
        self.page_buckets = buckets(self.max_width)
        host = host_prologue(model.fwd_modules)
        self._host_modules = model.fwd_modules[:host]
        self._cards = [
            _Card(
                device,
                modules,
                StepGraphs(device),
                torch.zeros((max_batch_size * self.max_width,), dtype=torch.int32, device=device),
                torch.zeros((max_batch_size,), dtype=torch.int32, device=device),
            )
            for device, modules in by_card(model.fwd_modules[host:], lambda entry: entry[0].device)
        ]
        self.installed = False
        self.gave_up = ""  # why decode went back to eager after a capture failed mid-generation, if it did
        self._pointer_tables: list[torch.Tensor] = []  # pinned tables the captured graphs copy from at each replay
        self.library_graphs_off = 0  # exllamav3's own per-layer graphs turned off at install (EXL3 layers have them)
        self.draws: DeviceDraws | None = None  # where the engine samples on the device: the last graph draws too
        self.step_rows: Callable[[], list[tuple[object, Row | None]]] = list  # the engine's rows of a step
        # queuing ahead (queue_ahead.py): the engine's account of how many tokens each row's pages hold, in batch
        # order (None: unknown, nothing is queued), the last step asked for and the step queued after it
        self.queue_ahead = queue_ahead_on()
        self.capacities: Callable[[], list[int] | None] = lambda: None
        self._last: Step | None = None
        self._ahead: Ahead | None = None
        self._asked_done = {card.device: torch.cuda.Event() for card in self._cards}  # the asked step's end
        self.queued_ahead = 0
        self.used_ahead = 0
        self.clock: StepClock | None = None  # where a benchmark times each step's parts (step_clock.py)
        self.feed: TokenFeed | None = None  # each step's tokens embedded on the first card (token_feed.py)
        self.feed_note = ""  # why not, where it was tried
        if token_feed_on():
            try:
                with torch.inference_mode():
                    self.feed, self.feed_note = feed_for(self._host_modules, self._embed_ids, self._cards[0].device)
            except Exception as error:  # the host path is always there: decode goes on with it, the status says why
                self.feed, self.feed_note = None, one_line(error)
        # queuing before the generator waits (on one card, with the feed): each step's successor queued at its
        # forward on a stream of its own, its tokens the step's argmax on the card, where the engine says every
        # row takes its argmax; the generator's wait narrowed to its own stream meanwhile (narrow_wait.py)
        self.before_wait = queue_before_wait_on() and self.queue_ahead and len(self._cards) == 1 and bool(self.feed)
        self.argmax_rows: Callable[[], list[bool]] = list
        self._side = torch.cuda.Stream(self.device) if self.before_wait else None
        self._undo_wait: Callable[[], None] = lambda: None
        self.before_wait_failed = ""  # why queuing before the wait stopped, where a queued replay failed

    @property
    def replays(self) -> int:
        return self._cards[-1].graphs.replays

    @property
    def device(self) -> torch.device:
        """Where the logits come out: the last card."""
        return self._cards[-1].device

    # -- in front of the model's own forward ---------------------------------------------------------------

    def install(self) -> None:
        self.library_graphs_off += turn_library_graphs_off(self.model)
        self._undo_pointer_tables = pinned_pointer_tables(self._pointer_tables)
        # instance attributes: the generator calls self.model.forward, .prefill and .prefetch_tokens
        self._own_prefetch, self._own_prefill = self.model.prefetch_tokens, self.model.prefill
        self.model.forward, self.model.prefill = self.forward, self.prefill
        self.model.prefetch_tokens = self.prefetch_tokens
        if self.before_wait:
            self._undo_wait = narrow_the_generator_s_wait()
        self.installed = True

    def uninstall(self) -> None:
        if self._ahead is not None:
            torch.cuda.synchronize()  # a queued replay must end before its graph is freed
            self._ahead = None
        if self.installed:
            del self.model.forward, self.model.prefill, self.model.prefetch_tokens
            self._undo_pointer_tables()
            self._undo_wait()
            self.installed = False
        for card in self._cards:
            card.graphs.clear()

    def forward(self, input_ids: torch.Tensor, params: dict | None = None):
        """The model's `forward`: the step queued ahead where it is the one asked for, else a replay where the step
        qualifies, the model's own method otherwise."""
        ahead, self._ahead, self._last = self._ahead, None, None
        self._after_side_step(ahead)  # what follows reads its buffers
        key = None if self.gave_up else self._key(input_ids, params)
        if key is not None:
            if self.clock:
                self.clock.asked()
            if ahead is not None and ahead.matches(key, input_ids, params["block_table"], params["cache_seqlens"]):
                self.used_ahead += 1
                if self.draws is not None:
                    self.draws.forget_step()  # a step queued ahead is one the host samples
                self._last = ahead.step
                if self.clock:
                    self.clock.returned(ahead=True)
                return self._queue_before_wait(ahead.output)
            try:
                with torch.inference_mode():
                    x = self._replay(key, input_ids, params)
                if self.clock:
                    self.clock.returned(ahead=False)
                return self._queue_before_wait(x)
            except CaptureFailed as failure:
                self.gave_up = str(failure)  # this step and every later one run eagerly; the status says why
        if self.draws is not None:
            self.draws.forget_step()  # the jobs draw alone from the eager logits
        return self._eager(input_ids, params)

    def prefill(self, input_ids: torch.Tensor, params: dict | None = None):
        """The model's `prefill`, after a step queued on the side stream: a new prompt may take a page that step
        writes (one a job that has just ended let go)."""
        self._after_side_step(self._ahead)
        return self._own_prefill(input_ids, params)

    def _after_side_step(self, ahead: Ahead | None) -> None:
        if ahead is not None and ahead.done is not None:  # queued on the side stream (queuing before the wait)
            torch.cuda.current_stream(self.device).wait_event(ahead.done)

    def prefetch_tokens(self, tokens: list[int]) -> None:
        """The model's `prefetch_tokens`, which the generator calls with the tokens it has just sampled, one per
        row, before it turns them into text and results: the model's own, then the next step queued ahead where
        the last step was a replay the host sampled from and the guess is safe (queue_ahead.py)."""
        self._own_prefetch(tokens)
        if self.clock:
            self.clock.tokens_known()
        last, self._last = self._last, None
        if last is None or not self.queue_ahead or self.gave_up:
            return
        step = next_step(last, len(tokens), self.capacities(), PAGE_TOKENS)
        if step is not None:
            with torch.inference_mode():
                input_ids = torch.tensor(tokens, dtype=torch.long).view(-1, 1)
                self._ahead = Ahead(step, input_ids, self._queue(step, input_ids))
            self.queued_ahead += 1
            if self.clock:
                self.clock.queued()

    def drop_ahead(self) -> None:
        """Forget a step queued ahead: the library is about to move pages, so it cannot be the step asked for next
        (on the generator's stream it runs before the moves; on the side stream it is waited for)."""
        if self._ahead is not None and self._ahead.done is not None:
            self._ahead.done.synchronize()
        self._ahead = None

    def synchronize(self) -> None:
        """Wait for the device work of the steps the generator asked for, not for a step queued ahead, which is
        what the host's work overlaps (the engine reads its clock after this, field report 5)."""
        if self._ahead is None:
            torch.cuda.synchronize()
            return
        for event in self._asked_done.values():
            event.synchronize()

    def _queue_before_wait(self, logits: torch.Tensor) -> torch.Tensor:
        """Where the decoder queues before the generator's wait and the step just run (`_last`) has a successor
        whose tokens are its argmax (queue_ahead.py): that successor replayed now on the side stream, its tokens
        embedded on the card and copied to the host for the check the next forward makes. Returns the logits to
        hand on: a copy where a step was queued, since its replay writes the graph's output again."""
        last = self._last
        if not self.before_wait or last is None or self.draws is not None:
            return logits
        rows = self.argmax_rows()
        following = next_step(last, len(rows), self.capacities(), PAGE_TOKENS) if all(rows) else None
        if following is None:
            return logits
        with torch.inference_mode():
            argmax, tokens, read = argmax_on_its_way(logits)
            kept = logits.clone()
            main = torch.cuda.current_stream(self.device)
            self._asked_done[self.device].record(main)
            self._side.wait_stream(main)
            try:
                with torch.cuda.stream(self._side):
                    self._cards[0].seqlens[: following.key[0]].add_(1)
                    output = self._through_cards(following.key, self.feed(argmax), None, ahead=True)
                    done = torch.cuda.Event()
                    done.record(self._side)
            except Exception as error:  # decode goes on as asked, queuing after the wait; the status says why
                main.wait_stream(self._side)
                self.before_wait, self.before_wait_failed = False, one_line(error)
                return kept
        self._ahead, self._last = Ahead(following, tokens, output, done, read, argmax), None
        self.queued_ahead += 1  # the step clock counts what follows the return as bookkeeping, as ExLlamaV2's does
        return kept

    def _key(self, input_ids: torch.Tensor, params: dict | None) -> tuple[int, int] | None:
        """The (batch size, block-table width its graph reads) of a step that qualifies for a graph; None for one
        that does not. The generator's cache lengths are on the host (its staging arena), so the cut costs no
        wait."""
        if not params or params.get("attn_mode") != "flash_attn" or params.get("cache") is not self.cache:
            return None
        if set(params) - _DECODE_PARAMETERS or input_ids.dim() != 2 or input_ids.shape[1] != 1:
            return None
        if any(params.get(name) for name in ("recurrent_states", "indexed_embeddings", "recurrent_history")):
            return None
        if params.get("positions") is not None:  # per-job RoPE positions (mrope models)
            return None
        batch, width = input_ids.shape[0], params["block_table"].shape[1]
        if batch > self.max_batch_size or width > self.max_width:
            return None
        longest = int(params["cache_seqlens"].max())
        return batch, cut_width(width, longest, PAGE_TOKENS, self.page_buckets)

    def _replay(self, key: tuple[int, int], input_ids: torch.Tensor, params: dict) -> torch.Tensor:
        from exllamav3.util.tensor import get_for_device

        batch, width = key
        x = self._embed(input_ids, params)
        for card in self._cards:  # the tables the generator already uploaded to each card (its dev_cache), cut
            table = get_for_device(params, "block_table", card.device)[:, :width]
            card.block_table(batch, width).copy_(table, non_blocking=True)
            card.seqlens[:batch].copy_(get_for_device(params, "cache_seqlens", card.device), non_blocking=True)
        drawn = self.draws.stage(self.step_rows(), batch) if self.draws is not None else None
        x = self._through_cards(key, x, drawn)
        if drawn:
            x, tokens = x
            self.draws.remember(tokens)
        elif self.queue_ahead:  # a step the host samples from: the next one can be queued ahead of it
            self._last = Step.of(key, params["block_table"], params["cache_seqlens"])
        return x

    def _queue(self, step: Step, input_ids: torch.Tensor) -> torch.Tensor:
        """Replay `step` now, over the cards' tables as the last step left them (the same block table; each row's
        length moved on by one on the card), and return its output."""
        batch, _ = step.key
        params = decode_params(self.cache, step.block_table, step.lengths)
        x = self._embed(input_ids, params)
        for card in self._cards:
            with torch.cuda.device(card.device):
                self._asked_done[card.device].record()  # the asked step's work ends here on this card
            card.seqlens[:batch].add_(1)
        return self._through_cards(step.key, x, None, ahead=True)

    def _embed(self, input_ids: torch.Tensor, params: dict) -> torch.Tensor:
        """The step's input through the modules that run before the graphs (the embedding, on the CPU in exllamav3
        by default), or its tokens embedded on the first card where the feed is on."""
        if self.feed is not None:
            on_host = input_ids if input_ids.is_cuda else input_ids.pin_memory()  # pinned: the upload does not wait
            return self.feed(on_host.to(self.feed.table.device, non_blocking=True))
        x = self.model.prepare_inputs(input_ids, params)
        for module, instance, _ in self._host_modules:
            params["layer_instance"] = instance
            x = module.forward(module.prepare_for_device(x, params), params)
        return x

    def _embed_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids (n, 1) through the host modules as a decode step runs them: what a feed is held to."""
        rows = input_ids.shape[0]
        return self._embed(input_ids, decode_params(self.cache, [[0]] * rows, [0] * rows))

    def _through_cards(self, key: tuple[int, int], x: torch.Tensor, drawn: str | None, *, ahead: bool = False):
        """Each card's graph in turn over the staged tables, the hidden state copied from card to card: the logits,
        or (logits, tokens) where the step draws in `drawn` mode. `ahead`: a step queued before it was asked for."""
        batch, width = key
        for card in self._cards:
            if card.hidden is None:
                card.hidden = torch.zeros((self.max_batch_size, 1, x.shape[-1]), dtype=x.dtype, device=card.device)
            card.hidden[:batch].copy_(_to_card(x, card.device), non_blocking=True)
            draws_here = drawn if card is self._cards[-1] else None  # the mode the last card draws in
            with timed_replay(self.clock if card is self._cards[-1] else None, card.device, ahead=ahead):
                x = card.graphs.replay(
                    (batch, width, draws_here),
                    lambda card=card, draws_here=draws_here: self._step(card, batch, width, draws_here),
                    shape=f"batch {batch} over {width} pages on {card.device}",
                )
        return x

    # -- what a graph replays -------------------------------------------------------------------------------

    def _step(self, card: _Card, batch: int, width: int, draws: str | None):
        """The card's modules at one shape, over its static buffers: what its graph for that shape records; with
        `draws` (a sampling mode), the device sampler's draws from the logits too."""
        hidden = card.hidden[:batch]
        params = self._static_params(batch, width)

        def run():
            # exllamav3's blocks add into their input in place: the graph works on a copy, so that its staged input
            # is the same in every warm-up run and in the replay after the capture
            logits = _run_modules(card.modules, hidden.clone(), dict(params, dev_cache=dict(params["dev_cache"])))
            return (logits, self.draws.batch.sample(logits, draws)) if draws else logits

        return run

    def _static_params(self, batch: int, width: int) -> dict:
        """A decode step's parameters whose tables are the cards' static buffers. exllamav3's layers read each
        table through `get_for_device`, which finds a card's copy in `dev_cache` under the host tensor's id (as the
        generator seeds it), so nothing is uploaded inside the graph."""
        block_table = torch.zeros((batch, width), dtype=torch.int32)
        seqlens = torch.zeros((batch,), dtype=torch.int32)
        dev_cache = {}
        for card in self._cards:
            dev_cache[(id(block_table), card.device)] = (block_table, card.block_table(batch, width))
            dev_cache[(id(seqlens), card.device)] = (seqlens, card.seqlens[:batch])
        # exllamav3's prepare_flash_attn: RoPE positions are the cache lengths where no others are given
        return {
            "attn_mode": "flash_attn",
            "cache": self.cache,
            "block_table": block_table,
            "cache_seqlens": seqlens,
            "positions": seqlens,
            "position": 0,
            "position_ids": None,
            "recurrent_states": None,
            "indexed_embeddings": [],
            "dev_cache": dev_cache,
        }

    def self_check(self, token_ids: list[int]) -> str | None:
        """Decode one step eagerly and by replay (graph_checks.py); None where they agree, else why not."""
        return self_check(self, token_ids)

    def describe(self) -> str:
        if self.gave_up:
            return f"eager since {self.gave_up}"
        cards = f" on {len(self._cards)} GPUs" if len(self._cards) > 1 else ""
        captured = sum(len(card.graphs) for card in self._cards)
        graph_bytes = sum(card.graphs.graph_bytes for card in self._cards)
        drawn = ", sampling on the GPU" if self.draws is not None else ""
        ahead = said(self.queue_ahead, self.used_ahead, self.queued_ahead)
        ahead += " before the generator's wait" if self.before_wait else ""
        ahead += f" (queuing before the wait stopped: {self.before_wait_failed})" if self.before_wait_failed else ""
        plain = ", exllamav3's own graphs off" if self.library_graphs_off else ""
        fed = (
            ", tokens embedded on the GPU"
            if self.feed
            else f", tokens embedded on the host ({self.feed_note})"
            if self.feed_note
            else ""
        )
        return f"CUDA graphs{cards}, {captured} captured, {graph_bytes / 2**20:.0f} MiB{drawn}{ahead}{fed}{plain}"


def _run_modules(modules: list, x: torch.Tensor, params: dict) -> torch.Tensor:
    """exllamav3 1.6.5's `forward_ls` over one card's modules: a block may leave its last residual add to the next
    block's input norm on the same card (`resid_defer`), which the card's last module never does."""
    from exllamav3.modules.transformer import TransformerBlock

    for i, (module, instance, _) in enumerate(modules):
        params["layer_instance"] = instance
        x = module.prepare_for_device(x, params)
        following = modules[i + 1][0] if i + 1 < len(modules) else None
        params["resid_defer"] = type(module) is TransformerBlock and type(following) is TransformerBlock
        x = module.forward(x, params)
    pending = params.pop("resid_pending", None)
    if pending is not None:
        x += pending
    return x


def _to_card(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    from exllamav3.util.device_copy import to_device  # bounces card-to-card copies where peer copies are unsafe

    return to_device(x, device)
