"""Which of an ExLlamaV2 model's fp16 projections are fused, and how (the mechanism: engines/fused_products.py).

exllamav2 0.3.2 runs an unquantized attention or MLP through its Python path, which calls q, k and v
(`ExLlamaV2Attention.forward_paged`, `forward_torch`), and gate and up (`ExLlamaV2MLP.forward_torch`), one after
another with one input. Its fp16 projections hold an `nn.Linear` whose weight is output-major, (out, in), and
multiply by its transpose; the group's stack is input-major, (n, in, out), and each `nn.Linear` gets the transpose
of its slice, so that a projection's own product reads a contiguous (in, out) matrix as before. Where a tail's norm
folds into the group after it (`EXLNB_NORM_IN_PRODUCT`, folded_norm.py) that group's stack is output-major instead,
each `nn.Linear` keeping its weight's layout, and the group's (n, in, out) stack is its transposed view. Each
attention's o, each MLP's down and the head take exlnb's GEMV for single rows, reading the `nn.Linear`'s (out, in)
weight as it lies.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain

import torch
from torch import nn

from exlnb.engines.exllamav2.attention_tail import attention_tail_on, attention_tails
from exlnb.engines.exllamav2.folded_norm import ATTENTION, MLP, folded_tails
from exlnb.engines.exllamav2.mlp_tail import mlp_tail_on, mlp_tails
from exlnb.engines.fused_products import (
    FusedProducts,
    ProductGroup,
    RowProduct,
    alike_fp16_on_cuda,
    stack_without_copy,
)


def fuse_exllamav2(model) -> FusedProducts:
    """The model's qualifying groups, stacked (output-major where their tail folds its norm into them,
    `EXLNB_NORM_IN_PRODUCT`), its single-row products and its MLPs' and attentions' tails (unless `EXLNB_MLP_TAIL=0`,
    `EXLNB_ATTENTION_TAIL=0`), installed."""
    on = {ATTENTION: attention_tail_on(), MLP: mlp_tail_on()}
    folding = {tail for tail in folded_tails() if on[tail]}  # a tail to fold a norm into
    groups = [
        _group(linears, tail if tail in folding else None)
        for tail, linears in _candidate_groups(model)
        if _fusable(linears)
    ]
    tails = chain(
        mlp_tails(model, _single_row_product, groups) if on[MLP] else (),
        attention_tails(model, _single_row_product, groups) if on[ATTENTION] else (),
    )
    return FusedProducts(groups, _row_products(model), tails)


def _accepts(args: tuple, kwargs: dict) -> bool:
    """A call the batched product covers: `forward(x, loras=...)` with no LoRA, as the attention and MLP make it."""
    return not args and set(kwargs) <= {"loras"} and not kwargs.get("loras")


def _wanted(args: tuple, kwargs: dict) -> torch.dtype | None:
    return torch.half if _accepts(args, kwargs) else None


def _head_wanted(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The head is called from the model's module loop, with the step's cache, attention parameters and whatever
    else the loop passes (which `ExLlamaV2Linear.forward` ignores): the same in eager steps and in a capture."""
    asks_more = args or any(kwargs.get(name) for name in ("loras", "intermediates", "force_recons"))
    return None if asks_more else torch.half


def _row_products(model) -> Iterator[RowProduct]:
    """Each unquantized attention's o and MLP's down, the products cuBLAS splits over their inputs at one row, and
    an unquantized head, which it reads at 63 % of copy bandwidth (H200 profile, 2026-11-28)."""
    from exllamav2.attn import ExLlamaV2Attention
    from exllamav2.linear import ExLlamaV2Linear
    from exllamav2.mlp import ExLlamaV2MLP

    for module in model.modules:
        wanted = _wanted
        if type(module) is ExLlamaV2Attention and not getattr(module, "is_tp", False):
            linear = module.o_proj
        elif type(module) is ExLlamaV2MLP and not getattr(module, "is_tp", False):
            linear = module.down_proj
        elif type(module) is ExLlamaV2Linear and module.key == "lm_head":
            linear, wanted = module, _head_wanted
        else:
            continue
        if _single_row_product(linear):
            yield RowProduct(linear, linear.linear.weight.data, wanted)


def _group(linears: list, folding: str | None) -> ProductGroup | None:
    """The projections' weights stacked input-major, or, where a tail folds its norm into them (`folding`: ATTENTION,
    MLP), as they lie, the group's stack then the (n, in, out) transposed view. For prompts and batches gate and up
    so laid out are read as one (2 * out, in) matrix, as an `nn.Linear` reads a fused projection, instead of batched
    over the transposed stack, which ran batch 8 2.4 % slower than the input-major stack on an H200
    (benchmarks/results/speed-nvidia-h200-2026-11-29-f); no clear gain in the next start (1.5 % slower than the
    input-major stack at the fastest turn, 5.8 % at the median, every setup unsteady at batch 8 there;
    speed-nvidia-h200-2026-11-29-g). The MLP's activation reads the strided outputs as it reads contiguous ones;
    q, k and v stay batched, each output contiguous, as exllamav2's RoPE kernel reads them."""
    output_major = folding is not None
    weights = [linear.linear.weight.data for linear in linears]  # (out, in) each
    stack = stack_without_copy(weights if output_major else [weight.t() for weight in weights])
    if stack is None:
        return None
    stacked, slots = stack
    for linear, slot in zip(linears, slots, strict=True):
        weight = stacked[slot] if output_major else stacked[slot].t()
        linear.linear.weight = nn.Parameter(weight, requires_grad=False)
    view = stacked.transpose(1, 2) if output_major else stacked
    return ProductGroup(linears, view, torch.half, _accepts, slots, one_matrix=folding == MLP)


def _candidate_groups(model) -> Iterator[tuple[str, list]]:
    """Each unquantized attention's q, k, v (only k and v where q is wider, as under grouped-query attention), and
    each unquantized gated MLP's gate and up, with the tail (ATTENTION, MLP) whose norm could fold into them."""
    from exllamav2.attn import ExLlamaV2Attention
    from exllamav2.mlp import ExLlamaV2MLP

    for module in model.modules:
        if getattr(module, "q_handle", None) is not None or getattr(module, "is_tp", False):
            continue
        if type(module) is ExLlamaV2Attention and getattr(module, "v_proj", None) is not None:
            qkv = [module.q_proj, module.k_proj, module.v_proj]
            yield ATTENTION, qkv if len({linear.out_features for linear in qkv}) == 1 else qkv[1:]
        elif type(module) is ExLlamaV2MLP and getattr(module, "gate_proj", None) is not None:
            yield MLP, [module.gate_proj, module.up_proj]


def _single_row_product(linear) -> bool:
    """Whether a projection's single rows can take exlnb's GEMV, as each attention's o and MLP's down do here."""
    return _fusable([linear])


def _fusable(linears: list) -> bool:
    """fp16 projections on one card, of one shape, with nothing but the product in their forward (no bias,
    padding, prescale, quantized matrix or tensor parallelism)."""
    if any(linear.linear is None or linear.q_handle is not None for linear in linears):
        return False
    weights = [linear.linear.weight.data for linear in linears]
    plain = all(
        not linear.has_bias and linear.padding == 0 and linear.prescale == 1 and not linear.is_tp for linear in linears
    )
    return plain and alike_fp16_on_cuda(weights)
