"""The ExLlamaV2 engine's gated MLPs with their tail in two kernels at one row (on unless `EXLNB_MLP_TAIL=0`).

exllamav2 0.3.2 runs an unquantized MLP through `ExLlamaV2MLP.forward_torch`: after the gate and up products come
`F.silu`, the multiply by up, a clamp to fp16's range, the down product and the residual add, five kernels of which
four are small. On an H200 a 7B step's graph launches 455 kernels, and each launch costs its kernel's time plus
about 0.88 us (benchmarks/results/speed-nvidia-h200-2026-11-29-b): those four are 128 launches and 0.19 ms of
kernels a step. Here, for a single row, the MLP runs its norm and its gate and up products as exllamav2 does, then
the activation in one kernel (`gated_activation.silu_times`) and the down product on exlnb's GEMV adding the
residual as it writes (`gemv.row_times_matrix_plus`): 96 launches fewer a step, each kernel rounding where torch
rounds, so the outputs are the library's bits. (The activation read inside the down product, one kernel in all,
was slower: every program of the product repeated the row's SiLUs; benchmarks/results/speed-nvidia-h200-2026-11-29-c.)
With `EXLNB_NORM_IN_PRODUCT=1` or `mlp` as well (off: 0.067 ms a 7B token faster at batch 1, 1.5-4.8 % slower at
batch 8 in turns on an H200, benchmarks/results/speed-nvidia-h200-2026-11-29-g), where gate and up are one fused
group after an RMS norm, the norm runs inside their product and the activation as it writes them
(`folded_norm.py`): two kernels in all, 64 launches fewer again, to the load check's tolerance rather than the
library's bits. Any other call (a prompt, a batch, LoRAs, intermediates) takes the library's own `forward_torch`.

A tail is one more of the products `FusedProducts` installs, and a load checks each against the library's own MLP on
a random row (`check_tails`: a load whose tails differ drops them, keeps its products and says why), so
`EXLNB_FUSED_PRODUCTS=0` turns it off too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from exlnb.engines.cuda_graphs import relative_difference
from exlnb.engines.exllamav2.folded_norm import FoldedNorm, folded_norm
from exlnb.engines.fused_products import MLP_TAILS, ProductGroup, TailKind, random_probe

FOLDED_MLP_TAILS = TailKind(
    "MLP tails with the norm and the activation in gate and up",
    "an MLP's tail with its norm and activation in gate and up differs from the library's MLP",
)


def mlp_tail_on() -> bool:
    """Whether the ExLlamaV2 engine runs its MLPs' tails in two kernels at one row (on unless `EXLNB_MLP_TAIL=0`,
    read at each load): with the attention's tail, 0.24 ms a 7B step faster on an H200, timed in turns, and the GPU
    suite passed with both on but for a test that failed without them too, at a near tie
    (benchmarks/results/speed-nvidia-h200-2026-11-29-e)."""
    return os.environ.get("EXLNB_MLP_TAIL", "1") != "0"


class MlpTail:
    """One MLP's `forward_torch` with its tail in two kernels for single rows (an instance attribute, found before
    the class's method), the library's own for every other call; `folded`, its norm in its gate and up product."""

    def __init__(self, mlp, folded: FoldedNorm | None = None) -> None:
        self.mlp, self.folded = mlp, folded
        self.down = mlp.down_proj.linear.weight.data  # (out, in), as it lies
        self.hidden = self.down.shape[0]
        self.kind = MLP_TAILS if folded is None else FOLDED_MLP_TAILS

    def install(self) -> None:
        self.mlp.forward_torch = self.forward_torch

    def uninstall(self) -> None:
        self.mlp.__dict__.pop("forward_torch", None)

    def forward_torch(self, hidden_states, cache=None, attn_params=None, past_len=None, intermediates=False, **kwargs):
        own = type(self.mlp).forward_torch
        if intermediates or kwargs.get("loras") or hidden_states.numel() != self.hidden:
            return own(self.mlp, hidden_states, cache, attn_params, past_len, intermediates, **kwargs)
        from exlnb.engines.gated_activation import silu_times  # these import triton: only where a GPU engine loads
        from exlnb.engines.gemv import row_times_matrix_plus

        if self.folded is not None:
            return row_times_matrix_plus(self.folded.gated(hidden_states), self.down, hidden_states)
        post_norm = self.mlp.pre_layernorm.forward(hidden_states)
        gate = self.mlp.gate_proj.forward(post_norm, loras=None)
        up = self.mlp.up_proj.forward(post_norm, loras=None)
        return row_times_matrix_plus(silu_times(gate, up), self.down, hidden_states)

    def differs(self) -> float:
        """The tail's largest difference from the library's own MLP on a random row, over the largest output (0: the
        same bits, as it should be, but for a folded norm, whose sums run in another order)."""
        x = random_probe(1, 1, self.hidden, dtype=torch.half, device=self.down.device)
        own = type(self.mlp).forward_torch(self.mlp, x.clone())
        return relative_difference(self.forward_torch(x).float(), own.float())


def mlp_tails(model, down_is_plain, groups: list[ProductGroup | None]) -> Iterator[MlpTail]:
    """Each unquantized gated SiLU MLP whose `forward_torch` ends in nothing but its down product and the residual
    add (no post-norm, merge, fp32 residual stream or clamp of the hidden state), its down product a plain fp16 one
    (`down_is_plain`: the check the GEMV's own single-row products pass); where the MLP's fold is on, its norm
    folded into its gate and up where they are one of `groups` (the model's fused groups)."""
    from exllamav2.mlp import ExLlamaV2MLP

    for module in model.modules:
        if type(module) is not ExLlamaV2MLP or getattr(module, "is_tp", False) or module.q_handle is not None:
            continue
        params = module.archparams
        plain = (
            module.gate_proj is not None
            and params.mlp_act_func == "silu"
            and not module.merge
            and module.pre_layernorm is not None
            and module.post_layernorm is None
            and module.has_residual
            and not params.residual_stream_fp32
            and not params.clamp_hidden_states
        )
        if plain and down_is_plain(module.down_proj) and module.down_proj.linear.weight.dtype == torch.half:
            yield MlpTail(module, folded_norm(module.pre_layernorm, groups, [module.gate_proj, module.up_proj]))
