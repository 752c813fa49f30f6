"""Which of an ExLlamaV3 model's fp16 projections are fused, and how (the mechanism: engines/fused_products.py).

exllamav3 1.6.5 calls an attention's q, k and v, and each slice's gate and up of a gated MLP, one after another with
one input (`Attention.project_qkv`, `GatedMLP.forward`) wherever its own fused EXL3 kernels do not take them. Its
fp16 projections (`LinearFP16`) hold their weights input-major, (in, out), so a group's weights stack as they are;
each projection's weight becomes a contiguous slice of the stack. Its loader carves weights of up to 16 MiB from
shared slab blocks: a group laid out evenly in one block is stacked as a view of it, one spread over blocks stays
separate (a copy would hold its weights twice). Each projection's `bc`, exllamav3's C++ handle on its weight,
which no fp16 path of these models reads, is dropped: it kept the weight it was made with alive beside its moved
copy (a 7B-shaped model held its grouped weights twice, 8.4 GiB, H200, 2026-11-28).

Each attention's o, each gated MLP's down and the head take exlnb's GEMV for single rows, which reads an (out, in)
matrix: a weight with an allocation of its own is laid out again (out, in) in memory, and the projection's
product, which exllamav3 runs through its `hgemm` on (in, out) rows, becomes torch's over the transposed view.
Weights carved from slab blocks stay as they are, on cuBLAS.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from exlnb.engines.fused_products import (
    FusedProducts,
    ProductGroup,
    RowProduct,
    alike_fp16_on_cuda,
    owns_its_allocation,
    random_probe,
    stack_without_copy,
)


def fuse_exllamav3(model) -> FusedProducts:
    """The model's qualifying groups, stacked, and its single-row products, installed (none under tensor
    parallelism, whose shards live in worker processes)."""
    if model.loaded_tp:
        return FusedProducts()
    groups = (_group(linears) for linears in _candidate_groups(model) if _fusable(linears))
    return FusedProducts(groups, _row_products(model))


def _group(linears: list) -> ProductGroup | None:
    inners = [linear.inner for linear in linears]
    stack = stack_without_copy([inner.weight for inner in inners])
    if stack is None:
        return None
    stacked, slots = stack
    for inner, slot in zip(inners, slots, strict=True):
        inner.weight, inner.bc = stacked[slot], None
    out_dtype = _out_dtype(linears[0])

    def accepts(args: tuple, kwargs: dict) -> bool:
        return _asked(linears[0], args, kwargs) == out_dtype

    return ProductGroup(linears, stacked, out_dtype, accepts, slots)


def _asked(linear, args: tuple, kwargs: dict) -> torch.dtype:
    """The output dtype a call of `Linear.forward(x, params, out_dtype=None)` asks for."""
    return kwargs.get("out_dtype", args[1] if len(args) > 1 else None) or _out_dtype(linear)


def _row_products(model) -> Iterator[RowProduct]:
    """Each attention's o, each gated MLP's down and the head, where the weight owns its allocation, laid out
    (out, in). A head tied to the embedding is a load of its own from the embedding's key (exllamav3's `alt_key`),
    while an unquantized embedding stays on the CPU (`prefer_cpu`): laying the head out again holds nothing twice."""
    from exllamav3.modules.attn import Attention
    from exllamav3.modules.linear import Linear
    from exllamav3.modules.mlp import GatedMLP

    for module in model:
        if type(module) is Attention and module.o_proj is not None:
            linears = [module.o_proj]
        elif type(module) is GatedMLP and getattr(module, "bc", None) is None:
            linears = module.downs
        elif type(module) is Linear and module.key == "lm_head":
            linears = [module]
        else:
            continue
        for linear in linears:
            if _fusable([linear]) and (row := _row_product(linear)) is not None:
                yield row


def _row_product(linear) -> RowProduct | None:
    """The projection's weight laid out (out, in), its product torch's over the transposed view, checked against
    exllamav3's own on two random rows before the old layout is let go; None where the weight shares its
    allocation (a copy would hold it twice) or the check fails (the projection is left as it was)."""
    inner = linear.inner
    weight = inner.weight
    if not owns_its_allocation(weight):
        return None
    probe = random_probe(2, weight.shape[0], dtype=weight.dtype, device=weight.device)
    before = linear.forward(probe, {})
    inner.weight = weight.t().contiguous().t()
    inner.forward = _transposed_product(inner)
    try:
        after = linear.forward(probe, {})
        kept = bool(torch.allclose(after.float(), before.float(), rtol=1e-2, atol=1e-2 * float(before.abs().max())))
    except Exception:  # a product torch does not take here: the projection as exllamav3 made it
        kept = False
    if not kept:
        inner.weight = weight
        del inner.forward
        return None
    inner.bc = None

    def wanted(args: tuple, kwargs: dict) -> torch.dtype:
        return _asked(linear, args, kwargs)

    return RowProduct(linear, inner.weight.t(), wanted, probe_args=({},))


def _transposed_product(inner):
    """`LinearFP16.forward` for a weight held as the transposed view of an (out, in) matrix: exllamav3's own runs
    its hgemm, which reads the weight as (in, out) rows, wherever the output type is not the input's."""

    def forward(x: torch.Tensor, params: dict, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = out_dtype or inner.out_dtype or torch.half
        rows = x.reshape(-1, x.shape[-1])
        y = torch.mm(rows, inner.weight) if dtype == x.dtype else torch.mm(rows, inner.weight, out_dtype=dtype)
        return y.view(*x.shape[:-1], y.shape[-1])

    return forward


def _candidate_groups(model) -> Iterator[list]:
    """An attention's q, k, v (only k and v where q is wider, as under grouped-query attention), and each slice's
    gate and up of a gated MLP."""
    from exllamav3.modules.attn import Attention
    from exllamav3.modules.mlp import GatedMLP

    for module in model:  # every module, blocks' attention and MLP among them
        if type(module) is Attention and _plain_attention(module):
            qkv = [module.q_proj, module.k_proj, module.v_proj]
            yield qkv if len({linear.out_features for linear in qkv}) == 1 else qkv[1:]
        elif type(module) is GatedMLP and getattr(module, "bc", None) is None:
            for index, (gate, up) in enumerate(zip(module.gates, module.ups, strict=True)):
                if module.multi_gu[index] is None:
                    yield [gate, up]


def _plain_attention(attention) -> bool:
    """An attention whose projections `project_qkv` calls in turn with the same input: no fused EXL3 kernels, no
    gate between q and k, v its own projection."""
    fused = ("multi_qkv", "multi_qg", "multi_kv")
    return (
        not any(getattr(attention, name, None) is not None for name in fused)
        and getattr(attention, "g_proj", None) is None
        and not getattr(attention, "interleaved_gate", False)
        and not getattr(attention, "use_k_as_v", False)
        and attention.v_proj is not None
    )


def _fusable(linears: list) -> bool:
    """fp16 projections on one card, of one shape and output type, with nothing but the product in their forward
    (no bias, LoRA, padding, scaling, softcap or pinned host storage)."""
    from exllamav3.modules.quant.fp16 import LinearFP16

    inners = [linear.inner for linear in linears]
    if not all(type(inner) is LinearFP16 for inner in inners):
        return False
    weights = [inner.weight for inner in inners]
    plain = all(
        inner.bias is None
        and getattr(inner, "_pinned_store", None) is None
        and not linear.lora_a_tensors
        and linear.in_features == linear.in_features_unpadded == weights[0].shape[0]
        and linear.out_features == linear.out_features_unpadded
        and (linear.pre_scale, linear.post_scale, linear.softcap) == (1.0, 1.0, 0.0)
        for linear, inner in zip(linears, inners, strict=True)
    )
    return plain and alike_fp16_on_cuda(weights) and len({_out_dtype(linear) for linear in linears}) == 1


def _out_dtype(linear) -> torch.dtype:
    return linear.inner.out_dtype or torch.half
