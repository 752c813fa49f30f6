"""The fp16 projections that read the same input, done as one batched product: QKV, and each gate/up pair.

exllamav2 0.3.2 and exllamav3 1.6.5 run each unquantized projection as its own cuBLAS product. On an H200 a 7B
layer's seven separate products read the weights at 75 % of copy bandwidth; with QKV and gate/up as one batched
product each, over their weights stacked input-major, at 83-84 % (benchmarks/results/gemv-nvidia-h200-2026-11-28
and fused-products-nvidia-h200-2026-11-28): about 0.4 ms of a 32-layer token.

How, without a second copy of any weight and without touching the libraries' attention or MLP code: a group's
weights are moved into one stacked tensor (n, in, out), and each projection's weight becomes its slice of it (a
view). The group's first projection computes every output with one `torch.bmm` over the stack; the others, which
both libraries call next with the very same input tensor (their attention: q, k, v; their gated MLP: gate, up),
hand back their slice of it, each contiguous, so the RoPE, cache and activation kernels after them read what they
always did (a gated MLP's gate and up laid out output-major for a folded norm are read as one matrix instead, each
output a strided slice, which the activation reads as it would a contiguous one: exllamav2/fused_products.py).
Called with any other input, or with options the batched product does not cover (LoRAs, an output type of its
own), a projection runs its own product. Eager steps and graph replays take the same path, so a replay
still matches the eager step it stands for; and a load checks the fused logits against the separate ones
(`check_fused`) before it keeps them. Each library's module says which projections qualify and how its weights
are held (exllamav2/fused_products.py, exllamav3/fused_products.py).

The projections cuBLAS splits over their inputs at one row (each attention's o, each MLP's down) take exlnb's
GEMV instead (gemv.py) for single rows: a `RowProduct` replaces the projection's forward the same way, and sends
every other call (prefills, batches) to the projection's separate product. A load checks each against that
product on a random row (`check_fused`).

On by default; `EXLNB_FUSED_PRODUCTS=0` (read at each load) keeps the separate products, to time the two.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from exlnb.engines.cuda_graphs import beyond_tolerance, relative_difference

CHECK_TEXT = "The fused products are checked against the separate ones on this text before a load keeps them."


def fused_products_on() -> bool:
    """Whether an engine fuses its fp16 projections (on unless `EXLNB_FUSED_PRODUCTS=0`, read at each load)."""
    return os.environ.get("EXLNB_FUSED_PRODUCTS", "1") != "0"


@dataclass
class ProductGroup:
    """Projections that read one input, their weights stacked (n, in, out): the first computes every output, the
    others hand theirs over; projection i's weight is `stacked[slots[i]]`. `accepts(args, kwargs)` says whether a
    call's options are ones the batched product covers (beyond the input); any other call takes the projection's own
    product."""

    linears: list
    stacked: torch.Tensor
    out_dtype: torch.dtype
    accepts: Callable[[tuple, dict], bool]
    slots: list[int] | None = None  # each projection's place in the stack, where it is not the projections' order
    # the stack a transposed view of output-major (n, out, in) weights, read as one (n * out, in) matrix, as an
    # `nn.Linear` reads a fused projection; each output then a strided slice of the product, for callers that read
    # strided outputs as they would contiguous ones (a gated MLP's activation)
    one_matrix: bool = False
    _pending: tuple[torch.Tensor, list[torch.Tensor]] | None = field(default=None, repr=False)
    _own: list = field(default_factory=list, repr=False)  # each projection's own bound forward

    def install(self) -> None:
        self._own = [linear.forward for linear in self.linears]
        for index, linear in enumerate(self.linears):
            linear.forward = self._leading if index == 0 else self._following(index)

    def uninstall(self) -> None:
        for linear in self.linears:
            linear.__dict__.pop("forward", None)  # the instance attribute: the class's method again
        self._pending = None

    def _leading(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not self.accepts(args, kwargs) or x.shape[-1] != self.stacked.shape[1] or x.dtype != self.stacked.dtype:
            return self._own[0](x, *args, **kwargs)
        if self.one_matrix:
            matrix = self.stacked.transpose(1, 2).view(-1, self.stacked.shape[1])  # (n * out, in), no copy
            outputs = list(torch.nn.functional.linear(x, matrix).split(self.stacked.shape[2], dim=-1))
        else:
            outputs = self._batched(x)
        if self.slots is not None:
            outputs = [outputs[slot] for slot in self.slots]
        self._pending = (x, outputs)
        return outputs[0]

    def _batched(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every projection's output, in the stack's order, each contiguous: one batched product over the stack."""
        rows = x.reshape(1, -1, x.shape[-1]).expand(self.stacked.shape[0], -1, -1)
        if self.out_dtype == x.dtype:
            products = torch.bmm(rows, self.stacked)
        else:  # fp16 products accumulated and written in float32, as exllamav3's Llama keeps gate/up
            products = torch.bmm(rows, self.stacked, out_dtype=self.out_dtype)
        return [y.view(*x.shape[:-1], y.shape[-1]) for y in products.unbind(0)]

    def _following(self, index: int):
        def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            pending = self._pending
            if pending is None or pending[0] is not x or not self.accepts(args, kwargs):
                return self._own[index](x, *args, **kwargs)
            if index == len(self.linears) - 1:
                self._pending = None  # the group's last output handed over: hold no tensor past the step
            return pending[1][index]

        return forward


def random_probe(*shape: int, dtype: torch.dtype, device: torch.device | str, seed: int = 0) -> torch.Tensor:
    """Random numbers for a load's check, from a generator of its own: a load draws nothing from the random streams
    a user may have seeded, whatever the switches it loads with."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=generator, device=device).to(dtype)


@dataclass
class RowProduct:
    """A projection whose single-row calls take exlnb's GEMV over `weight`, its (out, in) matrix. `wanted(args,
    kwargs)` is the output dtype a call asks for where the GEMV covers its options, else None; such calls, and any
    call of more than one row, take the projection's separate product (its forward before install)."""

    linear: object
    weight: torch.Tensor
    wanted: Callable[[tuple, dict], torch.dtype | None]
    probe_args: tuple = ()  # what a check passes the forward beside the row (exllamav3's: its params)
    single_row: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor] | None = None  # gemv's default
    _own: Callable | None = field(default=None, repr=False)

    def install(self) -> None:
        if self.single_row is None:
            from exlnb.engines.gemv import row_times_matrix  # imports triton: only where a GPU engine loads

            self.single_row = row_times_matrix
        self._own = self.linear.forward
        self.linear.forward = self._forward

    def uninstall(self) -> None:
        self.linear.__dict__.pop("forward", None)

    def separate(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """The projection's own product, as before install."""
        return self._own(x, *args, **kwargs)

    def _forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        out_dtype = self.wanted(args, kwargs)
        if out_dtype is None or x.numel() != x.shape[-1] or x.dtype != self.weight.dtype:
            return self._own(x, *args, **kwargs)
        return self.single_row(x, self.weight, out_dtype)

    def differs(self) -> float:
        """The GEMV's largest difference from the separate product on a random row, over the largest output."""
        x = random_probe(1, 1, self.weight.shape[1], dtype=self.weight.dtype, device=self.weight.device)
        single = self._forward(x, *self.probe_args).float()
        apart = self.separate(x, *self.probe_args).float()
        return relative_difference(single, apart)


def alike_fp16_on_cuda(weights: list[torch.Tensor]) -> bool:
    """Whether a group's weights can be one batched product's: contiguous fp16 on CUDA, on one card, one shape."""
    return all(w.is_cuda and w.dtype == torch.half and w.is_contiguous() for w in weights) and (
        len({(w.device, w.shape) for w in weights}) == 1
    )


def owns_its_allocation(weight: torch.Tensor) -> bool:
    """Whether the weight is the whole of its allocation: moved or laid out again, it is then freed, not held twice."""
    return weight.storage_offset() == 0 and weight.untyped_storage().nbytes() == weight.numel() * weight.element_size()


def stack_without_copy(weights: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """A group's weights as one (n, *shape) tensor with no weight held twice, and each weight's slot in it. A view,
    where the library laid them out evenly spaced in one allocation (exllamav3 1.6.5 carves weights of up to 16 MiB
    from shared slab blocks in load order, up before gate), its slots in the allocation's order; a new stack, where
    each weight owns its allocation (freed once the projections read their slices of the stack instead); else None:
    stacking slices of a shared allocation would keep it alive beside the stack, each weight held twice."""
    if len({(w.shape, w.stride(), w.dtype, w.device) for w in weights}) != 1:
        return None
    first = weights[0]
    if len({w.untyped_storage().data_ptr() for w in weights}) == 1:
        order = sorted(range(len(weights)), key=lambda i: weights[i].storage_offset())
        offsets = [weights[i].storage_offset() for i in order]
        steps = {b - a for a, b in zip(offsets, offsets[1:], strict=False)}
        dense = first.is_contiguous() or first.t().is_contiguous()
        if not (dense and len(steps) == 1 and (step := steps.pop()) >= first.numel()):
            return None
        view = first.as_strided((len(weights), *first.shape), (step, *first.stride()), offsets[0])
        return view, [order.index(i) for i in range(len(weights))]
    if all(owns_its_allocation(w) for w in weights):
        return torch.stack(weights), list(range(len(weights)))
    return None


@dataclass(frozen=True)
class TailKind:
    """How the status counts one kind of tail, and how a load that refuses one says why."""

    counted: str  # after the count: "2 MLP tails in two kernels"
    refused: str  # before the difference: "... by 0.5 of its largest"


MLP_TAILS = TailKind("MLP tails in two kernels", "an MLP's tail differs from the library's MLP")


class Tail(Protocol):
    """A step a library runs as several kernels, run in fewer where it can (exllamav2/mlp_tail.py's `MlpTail`,
    exllamav2/attention_tail.py's `AttentionTail`); its `kind` says what it is."""

    kind: TailKind

    def install(self) -> None: ...

    def uninstall(self) -> None: ...

    def differs(self) -> float:
        """The largest difference from the library's own step on a random input, over its largest output."""
        ...


class FusedProducts:
    """The fused groups and single-row products of one loaded model; `groups` may yield None for a group left
    separate (its weights could not be stacked without a copy), which is counted."""

    def __init__(
        self,
        groups: Iterator[ProductGroup | None] | None = None,
        rows: Iterator[RowProduct] | None = None,
        tails: Iterator[Tail] | None = None,
    ) -> None:
        self.groups: list[ProductGroup] = []
        self.rows: list[RowProduct] = []
        self.tails: list[Tail] = []  # steps run in fewer kernels, each of its `kind`
        self.left_separate = 0
        try:
            for group in groups or ():
                if group is None:
                    self.left_separate += 1
                    continue
                group.install()
                self.groups.append(group)
            for row in rows or ():
                row.install()
                self.rows.append(row)
            for tail in tails or ():
                tail.install()
                self.tails.append(tail)
        except BaseException:  # a group that cannot be made leaves every projection with its own forward
            self.uninstall()
            raise

    def _installed(self) -> list:
        return [*self.groups, *self.rows, *self.tails]

    def uninstall(self) -> None:
        """The separate forwards back for good (the weights stay views of their stacks, read as before)."""
        for product in self._installed():
            product.uninstall()
        self.groups, self.rows, self.tails = [], [], []

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The separate products for the length of the block, the groups as they were after it."""
        for product in self._installed():
            product.uninstall()
        try:
            yield
        finally:
            for product in self._installed():
                product.install()

    def drop_tails(self) -> None:
        """The library's own steps back for good where the tails were, the products kept."""
        for tail in self.tails:
            tail.uninstall()
        self.tails = []

    def describe(self) -> str:
        fused = f"{len(self.groups)} fp16 projection groups fused" if self.groups else ""
        apart = f"{self.left_separate} left separate (weights in a shared allocation)" if self.left_separate else ""
        rows = f"{len(self.rows)} single-row products on exlnb's GEMV" if self.rows else ""
        kinds = Counter(tail.kind.counted for tail in self.tails)  # in the order the tails came
        tails = [f"{count} {counted}" for counted, count in kinds.items()]
        return ", ".join(filter(None, [fused, apart, rows, *tails]))


def check_fused(fused: FusedProducts, score: Callable[[list[int]], torch.Tensor], token_ids: list[int]) -> str | None:
    """Whether the fused products give the model's logits: a whole-sequence pass fused and one with the separate
    products, held to the tolerance a graph's replay is held to against eager decode; and whether each single-row
    product gives its separate product's outputs on a random row, to the same tolerance. None where they agree,
    else why not, in a line."""
    for row in fused.rows:
        error = row.differs()
        if beyond_tolerance(error):
            return f"exlnb's GEMV differs from the separate product by {error:.3g} of its largest output"
    if not fused.groups:
        return None
    together = score(token_ids)
    with fused.paused():
        apart = score(token_ids)
    error = relative_difference(together, apart)
    if beyond_tolerance(error):
        return f"the fused products' logits differ from the separate ones by {error:.3g} of their largest"
    return None


def check_tails(fused: FusedProducts) -> str | None:
    """Whether each tail gives the library step's outputs on a random row, to the tolerance of `check_fused`: None
    where they all do, else why not, in a line (a load then drops the tails and keeps the products)."""
    for tail in fused.tails:
        error = tail.differs()
        if beyond_tolerance(error):
            return f"{tail.kind.refused} by {error:.3g} of its largest"
    return None
