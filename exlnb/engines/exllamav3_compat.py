"""What exlnb changes in exllamav3 1.6.5 before using it, for the engine and for the EXL3 converter alike.

exllamav3 pads every linear layer's dimensions to multiples of 128, and two of its paths forget the padding on
a model whose sizes are not multiples of 128 (SmolLM2-135M: hidden 576, K/V projections 3 x 64 = 192):

- It trims the padded output columns where a projection writes back into the residual stream, but only for
  attention's `o_proj`: the MLP's down projections keep their padding, so loading fails in the residual add
  ("The size of tensor a (576) must match the size of tensor b (640)"), and so does the converter. The padded
  columns hold zeros (fp16) or quantization noise (EXL3), so trimming them is exact.
- At decode it runs an EXL3 model's K and V projections as one fused multi-matrix GEMM (`multi_kv`; Q and
  gate likewise, `multi_qg`) that writes into an unpadded staging buffer. Its kernels tile the output 128
  columns at a time, so with 192 columns no tile fits and the first step fails ("exl3_mgemm autotune: no
  compatible kernel shapes"). Without the bundle exllamav3 runs the two projections one by one, as it already
  does for any step over 32 rows: same weights, same kernels, one launch more.

    python -m exlnb.engines.exllamav3_compat ARGS...   # exllamav3's converter (convert_model) with the fixes
"""

from __future__ import annotations

import functools
import runpy
import sys

# the narrowest output tile of exllamav3's EXL3 GEMM kernels (exl3_kernel_map.cuh, EXL3_GEMM_TILESIZE_N)
EXL3_GEMM_TILE_COLUMNS = 128

# attention's fused projection bundles that stage their output unpadded: bundle -> heads attribute it writes
STAGED_BUNDLES = {"multi_kv": "num_kv_heads", "multi_qg": "num_q_heads"}


def fix_exllamav3() -> None:
    """Apply every fix below to exllamav3 (idempotent): call before building a model."""
    trim_padded_mlp_outputs()
    unbundle_untileable_projections()


def trim_padded_mlp_outputs() -> None:
    """Make every MLP built from now on trim its down projections' padded output columns, as `o_proj` does."""
    from exllamav3.modules import mlp

    for cls in (mlp.MLP, mlp.GatedMLP):
        if getattr(cls.__init__, "trims_padded_outputs", False):
            continue
        cls.__init__ = _trimming(cls.__init__)


def _trimming(init):
    @functools.wraps(init)
    def trimming_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for down in getattr(self, "downs", None) or ():
            if down.out_features != getattr(down, "out_features_unpadded", down.out_features):
                down.trim_padded_out = True

    trimming_init.trims_padded_outputs = True
    return trimming_init


def unbundle_untileable_projections() -> None:
    """Make every attention layer loaded from now on drop a fused bundle whose output its GEMM cannot tile."""
    from exllamav3.modules.attn import Attention

    if not getattr(Attention.load_local, "unbundles_untileable", False):
        Attention.load_local = _unbundling(Attention.load_local)


def _unbundling(load_local):
    @functools.wraps(load_local)
    def unbundling_load_local(self, *args, **kwargs):
        load_local(self, *args, **kwargs)
        drop_untileable_bundles(self)

    unbundling_load_local.unbundles_untileable = True
    return unbundling_load_local


def drop_untileable_bundles(attention) -> list[str]:
    """Drop the bundles of one loaded attention layer whose staged output is not a whole number of tiles."""
    dropped = []
    for bundle, heads in STAGED_BUNDLES.items():
        fused = getattr(attention, bundle, None)
        if fused is None or getattr(attention, heads) * attention.head_dim % EXL3_GEMM_TILE_COLUMNS == 0:
            continue
        fused.unload()
        setattr(attention, bundle, None)
        dropped.append(bundle)
    return dropped


def main(argv: list[str]) -> None:
    fix_exllamav3()
    sys.argv = ["convert_model", *argv]
    runpy.run_module("exllamav3.conversion.convert_model", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
