"""Decode steps of an ExLlamaV2 model replayed from CUDA graphs, where exllamav2 0.3.2 launches every kernel
from Python.

A 7B decode step is about 858 kernel launches; on a host whose launch path is slow, the launches and not the
GPU set the speed (benchmarks/README.md: the GPU's own time is 1.6x the weights-over-bandwidth floor, the step
3.3x). A CUDA graph replays the whole step with one call. A probe (benchmarks/README.md) found what can be captured:
the GPU modules (decoder layers, final norm, head) chained by hand as `forward_chunk` runs them; not
`model.forward`/`forward_chunk` itself, which copies pageable memory and synchronises inside.

How the dynamic generator's decode steps become replays: `install()` puts `GraphDecoder.forward_chunk` in
front of the model's own. A step qualifies when it is paged (exlnb's paged attention), one token per
sequence, an fp16 cache, no LoRA, no indexed embeddings, no per-job RoPE offsets, no tensor parallelism;
anything else (prefill, the streaming generator's unpaged passes, a q4 cache) runs the model's own method
unchanged. The step's inputs are copied into static buffers on each card (hidden states after the CPU-side
embedding, cache lengths, block table); each card's consecutive modules replay as one graph (a layer split had
run eagerly, 61 against 123 tokens/s on one card), the hidden state copied from card to card in between; a
graph is captured on first use per batch size and per block-table
width bucket (1, 2, 4, ... pages; a column past a sequence's length is masked out, so padding the width
changes no value). The batch is not padded: on the GPU a GEMM of 8 rows rounds differently from one of 5, and
padded batches flipped greedy tokens against eager decode on a 7B-shaped model (near-ties are common with
random weights), where a graph per exact batch size gives the same tokens as eager.

On one card, where every row's token is its logits' argmax, the step after each replay is queued ahead on a stream
of its own while exllamav2's generator does each job's host work (queue_ahead.py), and held against the step it
then asks for. Where the embedding table's copy fits on the card (token_feed.py), the argmax stays there and is
embedded there, so the next step is queued without waiting for this one to end; else the argmax is read back and
embedded on the host first.

Measured on an H100 (benchmarks/README.md): the bundled model decodes 4.2x to 7.8x as fast at batch 1; the
7B-shaped model's replayed step takes 7.3 ms of GPU time, 1.66x the floor, so there the kernels now set the speed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from exlnb.engines.base import one_line
from exlnb.engines.cuda_graphs import CaptureFailed, StepGraphs, bucket_for, buckets, by_card, replay_differs
from exlnb.engines.device_sampling import DeviceDraws, Row
from exlnb.engines.exllamav2 import paged_attention
from exlnb.engines.exllamav2.token_feed import feed_for
from exlnb.engines.queue_ahead import Ahead, Step, argmax_on_its_way, next_step, pages_hold, queue_ahead_on, said
from exlnb.engines.step_clock import StepClock, timed_replay
from exlnb.engines.token_feed import TokenFeed, token_feed_on

CHECK_PROMPT_TOKENS = 24


class GraphDecoder:
    """Replays the decode steps of one ExLlamaV2 model and cache from CUDA graphs (see the module docstring)."""

    def __init__(self, model, cache, *, page_size: int, max_batch_size: int, max_pages: int) -> None:
        self.model, self.cache, self.page_size = model, cache, page_size
        self._eager = model.forward_chunk  # the model's own bound method
        first_gpu = next(i for i, m in enumerate(model.modules) if _on_gpu(m))
        self._host_modules = model.modules[:first_gpu]
        self.max_batch_size, self.page_buckets = max_batch_size, buckets(max_pages)
        rows, width = max_batch_size, self.page_buckets[-1]
        self._cards = [
            _Card(
                device,
                modules,
                StepGraphs(device),
                torch.zeros((rows, width), dtype=torch.int32, device=device),
                torch.zeros((rows,), dtype=torch.int32, device=device),
            )
            for device, modules in by_card(model.modules[first_gpu:], _card_of)
        ]
        self.installed = False
        self.gave_up = ""  # why decode went back to eager after a capture failed mid-generation, if it did
        self.draws: DeviceDraws | None = None  # where the engine samples on the device: the last graph draws too
        self.step_rows: Callable[[], list[tuple[object, Row | None]]] = list  # the engine's rows of a step
        self.clock: StepClock | None = None  # where a benchmark times each step's parts (step_clock.py)
        # queuing ahead (queue_ahead.py), on one card: the engine says, per row in batch order, whether its token is
        # the step's argmax; the step queued after the last one runs on a stream of its own
        self.queue_ahead = queue_ahead_on() and len(self._cards) == 1
        self.argmax_rows: Callable[[], list[bool]] = list
        self._ahead: Ahead | None = None
        self._side = torch.cuda.Stream(self.device) if self.queue_ahead else None
        self._asked_done = torch.cuda.Event()  # the end of the asked step's work, where a step is queued after it
        self.queued_ahead = 0
        self.used_ahead = 0
        self.ahead_failed = ""  # why queuing ahead stopped, where a queued replay failed
        self.feed: TokenFeed | None = None  # a queued step's tokens embedded on the card (token_feed.py)
        self.feed_note = ""  # why not, where it was tried
        if self.queue_ahead and token_feed_on():
            self.feed, self.feed_note = feed_for(self._host_modules, self.device)

    @property
    def replays(self) -> int:
        return self._cards[-1].graphs.replays

    @property
    def device(self) -> torch.device:
        """Where the logits come out: the last card."""
        return self._cards[-1].device

    # -- in front of the model's own forward_chunk ---------------------------------------------------------

    def install(self) -> None:
        self.model.forward_chunk = self.forward_chunk  # an instance attribute: model.forward finds it too
        self.installed = True

    def uninstall(self) -> None:
        if self._ahead is not None:
            torch.cuda.synchronize()  # a queued replay must end before its graph is freed
            self._ahead = None
        if self.installed:
            del self.model.forward_chunk
            self.installed = False
        for card in self._cards:
            card.graphs.clear()

    def forward_chunk(self, input_ids: torch.Tensor, cache=None, *args, attn_params=None, **kwargs):
        """The model's `forward_chunk`: the step queued ahead where it is the one asked for, else a replay where the
        step qualifies, the model's own method otherwise; after a step from a graph, the next one queued ahead
        where its tokens can be guessed."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:  # whatever comes next reads or restages the buffers the queued replay uses
            torch.cuda.current_stream(self.device).wait_event(ahead.done)
        key = None if args or self.gave_up else self._key(input_ids, cache, attn_params, kwargs)
        if key is not None:
            if self.clock:
                self.clock.asked()
            table, lengths = attn_params.block_index, attn_params.cache_seqlens
            queues = self.queue_ahead and self.draws is None  # a step the device draws is not guessed
            step = Step.of(key, table, lengths) if queues else None
            hit = ahead is not None and ahead.matches(key, input_ids, table, lengths)
            try:
                if hit:
                    self.used_ahead += 1
                    self.cache.current_seq_len += 1
                    logits = ahead.output
                else:
                    logits = self._replay(key, input_ids, attn_params, kwargs)
                if step is not None:
                    logits = self._queue_after(step, logits, attn_params, kwargs)
                if self.clock:
                    self.clock.returned(ahead=hit)
                return {"logits": logits}
            except CaptureFailed as failure:  # this step and every later one run eagerly; the status says why
                self.gave_up = str(failure)
        if self.draws is not None:
            self.draws.forget_step()  # the jobs draw alone from the eager logits
        return self._eager(input_ids, cache, *args, attn_params=attn_params, **kwargs)

    def drop_ahead(self) -> None:
        """Wait for a step queued ahead and forget it: the library is about to move pages, which the queued replay
        may still be writing into on its own stream."""
        if self._ahead is not None:
            self._ahead.done.synchronize()
            self._ahead = None

    def synchronize(self) -> None:
        """Wait for the device work of the steps the generator asked for, not for a step queued ahead, which is
        what the host's work overlaps (the engine reads its clock after this, field report 5)."""
        if self._ahead is None:
            torch.cuda.synchronize()
        else:
            self._asked_done.synchronize()

    def _queue_after(self, step: Step, logits: torch.Tensor, attn_params, kwargs: dict) -> torch.Tensor:
        """Queue the step after `step` where every row's token is its argmax (queue_ahead.py): the logits kept in a
        buffer of their own for the generator, and the next step replayed on the side stream, its tokens embedded on
        the card (copied back to the host for the check the next asked step is held to) or, without a feed, read
        back and embedded on the host first. Returns the logits to hand on."""
        rows = self.argmax_rows()
        if len(rows) != step.key[0] or not all(rows):
            return logits
        following = next_step(step, len(rows), pages_hold(step.lengths, self.page_size), self.page_size)
        if following is None:
            return logits
        if self.feed is None:
            argmax = logits[:, -1].argmax(-1, keepdim=True)
            input_ids, read = argmax.cpu(), None  # waits for this step
        else:
            argmax, input_ids, read = argmax_on_its_way(logits)
        kept = logits.clone()  # the queued replay writes the graph's output again
        main = torch.cuda.current_stream(self.device)
        self._asked_done.record(main)
        self._side.wait_stream(main)
        seq_len = self.cache.current_seq_len  # counted when the generator asks for the step, not now
        try:
            with torch.cuda.stream(self._side):
                params = _next_params(attn_params, following)
                hidden = self.feed(argmax) if self.feed is not None else None
                output = self._replay(following.key, input_ids, params, kwargs, ahead=True, hidden=hidden)
                done = torch.cuda.Event()
                done.record(self._side)
        except Exception as error:  # decode goes on as asked, without queuing; the status says why
            main.wait_stream(self._side)
            self.queue_ahead, self.ahead_failed = False, one_line(error)
            return kept
        finally:
            self.cache.current_seq_len = seq_len
        self._ahead = Ahead(following, input_ids, output, done, read, argmax)
        self.queued_ahead += 1
        return kept

    def _key(self, input_ids: torch.Tensor, cache, attn_params, kwargs: dict) -> tuple[int, int] | None:
        """The (batch size, pages bucket) of a step that qualifies for a graph; None for one that does not."""
        from exllamav2.attn import ExLlamaV2Attention

        if cache is not self.cache or not isinstance(attn_params, ExLlamaV2Attention.PagedParams):
            return None
        if input_ids.dim() != 2 or input_ids.shape[1] != 1 or any(kwargs.get(k) for k in _EAGER_ONLY_ARGUMENTS):
            return None
        if set(kwargs) - _ALLOWED_ARGUMENTS or attn_params.alt_rope_embed or attn_params.rope_offsets is not None:
            return None
        batch = input_ids.shape[0]
        pages = bucket_for(attn_params.block_index.shape[1], self.page_buckets)
        return None if batch > self.max_batch_size or pages is None else (batch, pages)

    def _replay(
        self,
        key: tuple[int, int],
        input_ids: torch.Tensor,
        attn_params,
        kwargs: dict,
        *,
        ahead: bool = False,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A replay of the step of `input_ids`, or of `hidden` where its tokens were embedded already."""
        from exllamav2.device import set_device_streams

        x = input_ids if hidden is None else hidden
        for module in self._host_modules if hidden is None else []:  # the embedding, on the CPU by default
            x = module.forward(
                x,
                cache=self.cache,
                attn_params=attn_params,
                past_len=0,
                loras=kwargs.get("loras"),
                indexed_embeddings=kwargs.get("indexed_embeddings"),
            )
        if not ahead:  # a step queued ahead runs on the side stream its caller made current
            set_device_streams()  # as forward_chunk does: the generator reads the logits on exllamav2's stream
        rows, width = key
        drawn = self.draws.stage(self.step_rows(), rows) if self.draws is not None else None
        for card in self._cards:
            self._stage(card, key, x, attn_params.cache_seqlens, attn_params.block_index)
            draws_here = drawn if card is self._cards[-1] else None  # the mode the last card draws in
            # the graph must record the attention layout's kernels, not reuse the warm-up's
            with timed_replay(self.clock if card is self._cards[-1] else None, card.device, ahead=ahead):
                x = card.graphs.replay(
                    (rows, width, draws_here),
                    lambda card=card, draws_here=draws_here: self._step(card, rows, width, draws_here),
                    shape=f"batch {rows} over {width} pages on {card.device}",
                    around_capture=paged_attention.forget_layout,
                )
        self.cache.current_seq_len += 1
        if drawn:
            x, tokens = x
            self.draws.remember(tokens)
        return x[: input_ids.shape[0]]

    def _stage(
        self, card: _Card, key: tuple[int, int], hidden: torch.Tensor, seqlens: torch.Tensor, block_index: torch.Tensor
    ) -> None:
        """Copy one step's inputs into a card's static buffers, the block table padded to the width bucket with
        each row's first page (a column past a sequence's length is masked out by the attention)."""
        from exllamav2.compat import safe_move_tensor  # card to card, through the host where peer copies are unsafe

        n, width = key
        w = block_index.shape[1]
        if card.hidden is None:
            card.hidden = torch.zeros(
                (self.max_batch_size, 1, hidden.shape[-1]), dtype=hidden.dtype, device=card.device
            )
        card.hidden[:n].copy_(safe_move_tensor(hidden, card.device) if hidden.is_cuda else hidden, non_blocking=True)
        card.seqlens[:n].copy_(seqlens, non_blocking=True)
        card.block_table[:n, :w].copy_(block_index, non_blocking=True)
        if w < width:
            card.block_table[:n, w:width].copy_(card.block_table[:n, :1].expand(n, width - w))

    # -- what a graph replays -------------------------------------------------------------------------

    def _step(self, card: _Card, rows: int, width: int, draws: str | None):
        """A card's modules at one shape, over its static buffers; with `draws` (a sampling mode), the device
        sampler's draws too."""
        params = self._static_params(card, rows, width)

        def run():
            # modules add into their input in place: the graph works on a copy of the staged input
            x = card.hidden[:rows].clone()
            for module in card.modules:
                x = module.forward(x, cache=self.cache, attn_params=params, past_len=0)
            if card is not self._cards[-1]:
                return x
            logits = self._finish_logits(x)
            return (logits, self.draws.batch.sample(logits, draws)) if draws else logits

        return run

    def _static_params(self, card: _Card, rows: int, width: int):
        """Paged parameters over a card's static buffers. exllamav2 builds them on the CPU and copies them per
        layer call; here they already live on the card, so nothing is copied inside the graph."""
        from exllamav2.attn import ExLlamaV2Attention

        params = ExLlamaV2Attention.PagedParams(
            batch_size=rows,
            block_index=torch.zeros((rows, width), dtype=torch.int32),
            cache_seqlens=torch.zeros((rows,), dtype=torch.int32),
            max_cache_seqlen=0,
            page_size=self.page_size,
            q_len=1,
        )
        # batch 1 would write through a host-side offset (`first_index`) baked in at capture; the general path
        # reads the positions from the device
        params.is_sequential = False
        params.block_index = card.block_table[:rows, :width]
        params.cache_seqlens = card.seqlens[:rows]
        return params

    def _finish_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The end of `forward_chunk` at q_len 1: its logit softcap and head padding."""
        config = self.model.config
        if config.final_logit_softcapping:
            from exllamav2.ext import exllamav2_ext as ext_c

            ext_c.softcap_(x, config.final_logit_softcapping)
        padding = self._cards[-1].modules[-1].padding
        if padding > 0:
            x[:, :, -padding:] = -65504.0
        return x

    # -- the check a load runs before graphs are used --------------------------------------------------------

    def self_check(self, token_ids: list[int]) -> str | None:
        """Decode one step eagerly and by replay, at batch 1 and at batch 3, over the cache's first
        pages (the generator holds nothing yet); None where they agree, else why not, in a line."""
        from exllamav2.attn import ExLlamaV2Attention

        pages = self.cache.max_seq_len // self.page_size
        sequences = min(3, pages, self.max_batch_size)
        prompt = (token_ids * CHECK_PROMPT_TOKENS)[:CHECK_PROMPT_TOKENS]
        for row in range(sequences):  # a different prompt per page: row r drops its first r tokens
            ids = torch.tensor([prompt[row:]], dtype=torch.long)
            params = ExLlamaV2Attention.PagedParams(
                1,
                torch.tensor([[row]], dtype=torch.int32),
                torch.zeros((1,), dtype=torch.int32),
                0,
                self.page_size,
                q_len=ids.shape[1],
            )
            self._eager(ids, self.cache, attn_params=params, preprocess_only=True)
        for batch in sorted({1, sequences}):
            lengths = [CHECK_PROMPT_TOKENS - row for row in range(batch)]
            next_ids = torch.tensor([[prompt[-1]] for _ in range(batch)], dtype=torch.long)
            block_index = torch.arange(batch, dtype=torch.int32)[:, None]

            def step(run):
                params = ExLlamaV2Attention.PagedParams(
                    batch,
                    block_index.clone(),
                    torch.tensor(lengths, dtype=torch.int32),
                    max(lengths),
                    self.page_size,
                    q_len=1,
                )
                return (
                    run(next_ids, self.cache, attn_params=params, loras=None, indexed_embeddings=[])["logits"]
                    .float()
                    .cpu()
                )

            eager = step(self._eager)
            replayed = step(self.forward_chunk)
            if reason := self.gave_up or replay_differs(batch, eager, replayed):
                return reason
        return None

    def describe(self) -> str:
        if self.gave_up:
            return f"eager since {self.gave_up}"
        cards = f" on {len(self._cards)} GPUs" if len(self._cards) > 1 else ""
        captured = sum(len(card.graphs) for card in self._cards)
        graph_bytes = sum(card.graphs.graph_bytes for card in self._cards)
        drawn = ", sampling on the GPU" if self.draws is not None else ""
        ahead = said(self.queue_ahead, self.used_ahead, self.queued_ahead)
        if self.queue_ahead and self.feed is not None:
            ahead += ", their tokens embedded on the GPU"
        elif self.queue_ahead and self.feed_note:
            ahead += f", their tokens embedded on the host ({self.feed_note})"
        if self.ahead_failed:
            ahead = f", no step queued ahead since {self.ahead_failed}"
        return f"CUDA graphs{cards}, {captured} captured, {graph_bytes / 2**20:.0f} MiB{drawn}{ahead}"


# forward_chunk's arguments a replay can take (the dynamic generator passes these), and those that need eager
_ALLOWED_ARGUMENTS = {"loras", "indexed_embeddings", "abort_event"}
_EAGER_ONLY_ARGUMENTS = ("loras", "indexed_embeddings")


def _next_params(params, step: Step):
    """The paged parameters of the step queued after `params`' step: its block table and cache lengths."""
    from exllamav2.attn import ExLlamaV2Attention

    return ExLlamaV2Attention.PagedParams(
        batch_size=step.key[0],
        block_index=step.block_table,
        cache_seqlens=step.lengths,
        max_cache_seqlen=int(step.lengths.max()),
        page_size=params.page_size,
        q_len=1,
    )


def _on_gpu(module) -> bool:
    return module.device_idx is not None and module.device_idx >= 0


def _card_of(module) -> torch.device:
    return torch.device("cuda", module.device_idx)


@dataclass
class _Card:
    """One card's run of consecutive modules, replayed as one graph, with its copy of the step's inputs."""

    device: torch.device
    modules: list
    graphs: StepGraphs
    block_table: torch.Tensor  # (max batch, widest bucket) int32
    seqlens: torch.Tensor  # (max batch,) int32
    hidden: torch.Tensor | None = None  # the card's input, (max batch, 1, hidden), made at first use


def cannot_graph(engine) -> str | None:
    """Why an ExLlamaV2 engine's decode cannot run from graphs, in a line; None where it can try."""
    if not engine.paged:
        return "unpaged: the dynamic generator's unpaged passes stay eager"
    if not paged_attention.installed():
        return f"attention is {engine.attention}: graphs are verified over exlnb's paged attention only"
    if engine.options.cache_dtype != "fp16":
        return f"a {engine.options.cache_dtype} cache is dequantised per step to a length read on the host"
    if engine.model.tp_context is not None:
        return "tensor parallel: exllamav2 0.3.2 splits each layer's work over the cards on streams of its own"
    return None
