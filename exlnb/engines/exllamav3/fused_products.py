"""Which of an ExLlamaV3 model's fp16 projections are fused, and how (the mechanism: engines/fused_products.py).

exllamav3 1.6.5 calls an attention's q, k and v, and each slice's gate and up of a gated MLP, one after another with
one input (`Attention.project_qkv`, `GatedMLP.forward`) wherever its own fused EXL3 kernels do not take them. Its
fp16 projections (`LinearFP16`) hold their weights input-major, (in, out), so a group's weights stack as they are;
each projection's weight becomes a contiguous slice of the stack. Its loader carves weights of up to 16 MiB from
shared slab blocks: a group laid out evenly in one block is stacked as a view of it, one spread over blocks stays
separate (a copy would hold its weights twice).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from exlnb.engines.fused_products import FusedProducts, ProductGroup, alike_fp16_on_cuda, stack_without_copy


def fuse_exllamav3(model) -> FusedProducts:
    """The model's qualifying groups, stacked and installed (none under tensor parallelism, whose shards live in
    worker processes)."""
    if model.loaded_tp:
        return FusedProducts()
    return FusedProducts(_group(linears) for linears in _candidate_groups(model) if _fusable(linears))


def _group(linears: list) -> ProductGroup | None:
    inners = [linear.inner for linear in linears]
    stack = stack_without_copy([inner.weight for inner in inners])
    if stack is None:
        return None
    stacked, slots = stack
    for inner, slot in zip(inners, slots, strict=True):
        inner.weight = stacked[slot]
    out_dtype = _out_dtype(linears[0])

    def accepts(args: tuple, kwargs: dict) -> bool:  # forward(x, params, out_dtype=None)
        asked = kwargs.get("out_dtype", args[1] if len(args) > 1 else None)
        return (asked or out_dtype) == out_dtype

    return ProductGroup(linears, stacked, out_dtype, accepts, slots)


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
