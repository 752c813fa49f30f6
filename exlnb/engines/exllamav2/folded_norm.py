"""An ExLlamaV2 RMS norm folded into the fused group's product after it, at one row: by default the attention's, into
q, k and v with the attention tail (`EXLNB_NORM_IN_PRODUCT=attention`); `1` folds the MLP's into gate and up too,
`mlp` that one alone, `0` none.

At one row the engine runs each norm as a launch of its own and then the fused group's batched product. Folded, one
Triton kernel (`normed_gemv.py`) computes the row's RMS in every program and multiplies as it reads the weights; for
gate and up it also computes the MLP's activation from the two sums as it writes them (the SiLU kernel's 32
launches a 7B step: 0.067 ms of kernels and about 0.03 ms of launches in the H200's profile of the tails), and for
q, k and v their RoPE (32 launches, 0.058 ms of kernels in the same profile).

Its speed hangs on the layout. 32 layers replayed from one graph on an H200 (the norm-product sweep in
benchmarks/results/speed-nvidia-h200-2026-11-29-d) took, for q, k and v, 0.839 ms over output-major weights
against 0.973 ms for the norm and cuBLAS's product over the input-major stack, and for gate and up 1.418 against
1.522 ms; over the input-major stack the kernel's best was 1.080 and 1.497 ms, and at the size first guessed it was
four times slower (that step: 7.40 ms against 4.22). So where a fold is on, the engine lays its groups out
output-major (every projection's weight then lies as its `nn.Linear` held it, and cuBLAS reads the same stack
transposed for prompts and batches, `ProductGroup.stacked` being its transposed view), and the tails take that
kernel for their single rows.

The norm is exllamav2's arithmetic but not its order of summation: a folded tail agrees with the library's step to
the load check's tolerance, not to the bit.

The two folds weigh differently. In the H200's profile of the step with both (speed-nvidia-h200-2026-11-29-f), q, k
and v with the norm and RoPE took 0.919 ms against 1.028 for the norm, cuBLAS and RoPE apart, while gate and up with
the norm and the activation took 1.617 against 1.584 (cuBLAS reads gate and up at 94 % of copy bandwidth). So each
tail's fold can be had alone, and only its groups are then laid out output-major: timed in turns there, the
attention's alone was 0.122 ms a token faster at 256 tokens and 0.130 at 4,096 and level at batch 8 (1483 tokens/s
each), both folds 2.4 % slower at batch 8, where cuBLAS reads the transposed gate and up. Read as one matrix since,
both folds were again 0.067 ms faster than the attention's alone at 256 tokens and 1.5-4.8 % slower at batch 8
(speed-nvidia-h200-2026-11-29-g): the MLP's stays off by default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from exlnb.engines.fused_products import ProductGroup

ATTENTION, MLP = "attention", "mlp"  # the tails whose norm can fold into the group after it: q, k, v; gate, up
FOLDS = {"0": (), "1": (ATTENTION, MLP), ATTENTION: (ATTENTION,), MLP: (MLP,)}  # EXLNB_NORM_IN_PRODUCT's values
DEFAULT_FOLD = ATTENTION


def folded_tails() -> tuple[str, ...]:
    """The tails whose RMS norm the ExLlamaV2 engine folds into the group after it, that group laid out output-major:
    `EXLNB_NORM_IN_PRODUCT` (read at each load) `attention` (the default), `mlp`, 1 for both or 0 for none. The
    attention's alone: 4.11 against 4.23 ms a 7B token at batch 1 and level at batch 8 in turns on an H200, its
    suite passing but for a test whose layout expectation predated single folds and one that passed when run again
    (benchmarks/results/speed-nvidia-h200-2026-11-29-f)."""
    value = os.environ.get("EXLNB_NORM_IN_PRODUCT", DEFAULT_FOLD)
    if value not in FOLDS:
        raise ValueError(f"EXLNB_NORM_IN_PRODUCT={value!r}: one of {', '.join(FOLDS)}")
    return FOLDS[value]


def norm_in_product_on() -> bool:
    """Whether any tail folds its norm (`folded_tails`)."""
    return bool(folded_tails())


def output_major(stack: torch.Tensor) -> bool:
    """Whether a group's (P, K, N) stack is a transposed view of contiguous (P, N, K) output-major weights."""
    return stack.transpose(1, 2).is_contiguous()


@dataclass(frozen=True)
class FoldedNorm:
    """An RMS norm folded into a fused group's products: the group's (P, K, N) stack (a view of output-major
    weights), the slots of the projections in the caller's order, and the norm's weight and epsilon."""

    stack: torch.Tensor
    slots: tuple[int, ...]
    weight: torch.Tensor
    eps: float

    def products(self, hidden_states: torch.Tensor) -> list[torch.Tensor]:
        """Each projection's output for a single row, in the caller's order, each a contiguous row of one (P, N)
        output (so that q and k lie side by side)."""
        from exlnb.engines.normed_gemv import normed_row_times_stack  # imports triton: only where a GPU engine loads

        rows = normed_row_times_stack(hidden_states, self.weight, self.eps, self.stack)
        return [rows[slot] for slot in self.slots]

    def roped(self, hidden_states, sin, cos, positions) -> list[torch.Tensor]:
        """`products` of q, k and v (the caller's order) with NEOX RoPE on q and k at the position `positions[0]`
        holds, computed as the sums are written: one launch for the norm, the products and RoPE."""
        from exlnb.engines.normed_gemv import normed_roped_rows  # imports triton: only where a GPU engine loads

        q, k, _ = self.slots
        rows = normed_roped_rows(hidden_states, self.weight, self.eps, self.stack, (q, k), sin, cos, positions)
        return [rows[slot] for slot in self.slots]

    def gated(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """A gated MLP's clamp(silu(gate) * up) for a single row, its projections (gate, up) in the caller's order,
        the activation computed as the products' sums are written: one launch, the activation's bits those of
        `gated_activation.silu_times` on the products' outputs."""
        from exlnb.engines.normed_gemv import normed_gated_row  # imports triton: only where a GPU engine loads

        return normed_gated_row(hidden_states, self.weight, self.eps, self.stack, self.slots)


def folded_norm(norm, groups: list[ProductGroup | None], linears: list) -> FoldedNorm | None:
    """Where `norm` is exllamav2's RMS norm (fp16 weight, no bias) and `linears` are one of the model's fused `groups`
    laid out output-major (as a group is only where its tail folds its norm: `fuse_exllamav2`), the norm folded into
    their products; else None (the tail then runs the norm and the group)."""
    from exllamav2.rmsnorm import ExLlamaV2RMSNorm

    group = next((group for group in groups if group is not None and group.linears == linears), None)
    plain = type(norm) is ExLlamaV2RMSNorm and norm.bias is None and norm.weight.dtype == torch.half
    if not plain or group is None or not output_major(group.stacked):
        return None
    slots = tuple(group.slots or range(len(linears)))
    return FoldedNorm(group.stacked, slots, norm.weight.data, norm.variance_epsilon)
