"""What exllamav3 1.6.5 needs changed before the ExLlamaV3 engine captures a whole decode step in one CUDA graph
(graph_decode.py): its own per-layer graphs turned off, and the pointer tables its fused EXL3 projections upload at
every call copied from pinned memory inside a capture."""

from __future__ import annotations

from collections.abc import Callable

import torch


class _Declined(dict):
    """An attention module's table of its graphed decode blocks that declines every one (exllamav3 1.6.5's
    `bc_attn_step` then takes the plain path)."""

    def get(self, key, default=None):
        return False


def turn_library_graphs_off(model) -> int:
    """Route exllamav3's EXL3 decode around its own per-layer graphs (its gated MLP's graphed batch-1 path, its
    attention's "BC" block), so that their plain paths, which launch the same kinds of kernel one by one, are what
    a capture records: launched inside this decoder's capture, its graphs crashed the process (a segfault in the BC
    attention, a 12-layer 7B-shaped EXL3 model, H100, 2026-11-28), which no CaptureFailed can catch. Returns how
    many modules it turned off."""
    from exllamav3.modules.attn import Attention
    from exllamav3.modules.mlp import MLP, GatedMLP

    turned_off = 0
    for module in model:
        if isinstance(module, (MLP, GatedMLP)) and module.bc is not None:
            module.bc, turned_off = None, turned_off + 1
        elif isinstance(module, Attention) and not isinstance(module.bc_attn, _Declined):
            module.bc_attn, turned_off = _Declined(), turned_off + 1
    return turned_off


def pinned_pointer_tables(kept: list) -> Callable[[], None]:
    """exllamav3 1.6.5's fused EXL3 projections (`SlicedMultiLinear.c_ptrs`) upload a table of output pointers from a
    Python list at every call: a pageable copy, which a capture refuses. Inside a capture the table is copied from
    pinned memory instead, kept in `kept` as long as the graphs that copy it at each replay (the pointers are the
    graph's own outputs, the same at every replay). Returns what puts the library's method back."""
    from exllamav3.modules.multilinear import SlicedMultiLinear

    own = SlicedMultiLinear.c_ptrs

    def c_ptrs(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        if not torch.cuda.is_current_stream_capturing():
            return own(self, outputs)
        ptrs = [
            outputs[t].data_ptr() + n0 * outputs[t].element_size()
            for t, n0 in zip(self.slice_targets, self.slice_offsets)
        ]
        host = torch.tensor(ptrs, dtype=torch.long).pin_memory()
        kept.append(host)
        return host.to(self.device, non_blocking=True)

    SlicedMultiLinear.c_ptrs = c_ptrs

    def undo() -> None:
        SlicedMultiLinear.c_ptrs = own

    return undo
