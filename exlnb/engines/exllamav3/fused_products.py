"""The fp16 projections that read the same input, done as one batched product: QKV, and each gate/up pair.

exllamav3 1.6.5 runs each unquantized projection as its own cuBLAS product (EXL3 layers have fused kernels of
their own). On an H200 a 7B layer's seven separate products read the weights at 75 % of copy bandwidth, the same
products with QKV and gate/up fused at 83 % (benchmarks/results/gemv-nvidia-h200-2026-11-28): 0.37 ms of a
32-layer token at batch 1, 0.47 ms at batch 8.

How, without a second copy of any weight and without touching exllamav3's attention or MLP code: a group's
weights, each stored input-major (in, out) as exllamav3 keeps them, are moved into one stacked tensor
(n, in, out), and each projection's weight becomes its slice of it, a contiguous view. The group's first
projection computes every output with one `torch.bmm` over that stack; the others, which exllamav3 calls next with
the very same input tensor (`Attention.project_qkv`: q, k, v; `GatedMLP.forward`: gate, up), hand back their
slice of it, each contiguous, so the RoPE, cache and activation kernels after them read what they always did.
Called with any other input, a projection runs its own product as before. Eager steps and graph replays take the
same path, so a replay still matches the eager step it stands for.

On by default; `EXLNB_FUSED_PRODUCTS=0` (read at each load) keeps exllamav3's separate products, to time the two.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


def fused_products_on() -> bool:
    """Whether an ExLlamaV3 engine fuses its fp16 projections (on unless `EXLNB_FUSED_PRODUCTS=0`)."""
    return os.environ.get("EXLNB_FUSED_PRODUCTS", "1") != "0"


@dataclass
class _Group:
    """Projections that read one input, their weights stacked: the first computes all, the others take theirs."""

    linears: list
    stacked: torch.Tensor  # (n, in, out)
    out_dtype: torch.dtype
    _pending: tuple[torch.Tensor, list[torch.Tensor]] | None = field(default=None, repr=False)
    _own: list = field(default_factory=list, repr=False)  # each projection's own bound forward, for uninstall

    def install(self) -> None:
        self._own = [linear.forward for linear in self.linears]
        for index, linear in enumerate(self.linears):
            linear.forward = self._leading if index == 0 else self._following(index)

    def uninstall(self) -> None:
        for linear in self.linears:
            del linear.forward  # the instance attribute: the class's method again
        self._pending = None

    def _leading(self, x: torch.Tensor, params: dict, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if (out_dtype or self.out_dtype) != self.out_dtype or x.shape[-1] != self.stacked.shape[1]:
            return self._own[0](x, params, out_dtype)
        rows = x.reshape(1, -1, x.shape[-1]).expand(self.stacked.shape[0], -1, -1)
        if self.out_dtype == x.dtype:
            products = torch.bmm(rows, self.stacked)
        else:  # exllamav3's Llama keeps gate/up in float32: fp16 products accumulated and written in float32
            products = torch.bmm(rows, self.stacked, out_dtype=self.out_dtype)
        outputs = [y.view(*x.shape[:-1], y.shape[-1]) for y in products.unbind(0)]
        self._pending = (x, outputs)
        return outputs[0]

    def _following(self, index: int):
        def forward(x: torch.Tensor, params: dict, out_dtype: torch.dtype | None = None) -> torch.Tensor:
            pending = self._pending
            if pending is None or pending[0] is not x or (out_dtype or self.out_dtype) != self.out_dtype:
                return self._own[index](x, params, out_dtype)
            if index == len(self.linears) - 1:
                self._pending = None  # the group's last output handed over: hold no tensor past the step
            return pending[1][index]

        return forward


class FusedProducts:
    """The fused groups of one loaded ExLlamaV3 model (see the module docstring)."""

    def __init__(self, model) -> None:
        self.groups: list[_Group] = []
        self.model = model

    def install(self) -> int:
        """Stack every group that qualifies and put its forwards in place; how many groups."""
        for linears in _candidate_groups(self.model):
            if _fusable(linears):
                group = _Group(linears, _stack(linears), _out_dtype(linears[0]))
                group.install()
                self.groups.append(group)
        return len(self.groups)

    def uninstall(self) -> None:
        """The separate forwards back (the weights stay views of their stacks, which exllamav3 reads as before)."""
        for group in self.groups:
            group.uninstall()
        self.groups = []

    def describe(self) -> str:
        return f"{len(self.groups)} fp16 projection groups fused" if self.groups else ""


def _candidate_groups(model) -> Iterator[list]:
    """The projections exllamav3 1.6.5 calls one after another with one input: an attention's q, k, v (only k and
    v where q is wider, as under grouped-query attention), and each slice's gate and up of a gated MLP."""
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
    return (
        plain
        and all(w.is_cuda and w.dtype == torch.half and w.is_contiguous() for w in weights)
        and len({(w.device, w.shape) for w in weights}) == 1
        and len({_out_dtype(linear) for linear in linears}) == 1
    )


def _out_dtype(linear) -> torch.dtype:
    return linear.inner.out_dtype or torch.half


def _stack(linears: list) -> torch.Tensor:
    """The group's weights moved into one (n, in, out) tensor, each projection's weight now its view: one layer's
    group at a time, so the extra memory while stacking is one group's weights."""
    inners = [linear.inner for linear in linears]
    stacked = torch.stack([inner.weight for inner in inners])
    for index, inner in enumerate(inners):
        inner.weight = stacked[index]
    return stacked
