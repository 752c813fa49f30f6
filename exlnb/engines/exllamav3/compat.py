"""What exlnb changes in exllamav3 1.6.5 before using it, for the engine and for the EXL3 converter alike.

exllamav3 pads every linear layer's dimensions to multiples of 128, and three of its paths forget the padding
on a model whose sizes are not multiples of 128 (SmolLM2-135M: hidden 576, K/V projections 3 x 64 = 192):

- It trims the padded output columns where a projection writes back into the residual stream, but only for
  attention's `o_proj`: the MLP's down projections keep their padding, so loading fails in the residual add
  ("The size of tensor a (576) must match the size of tensor b (640)"), and so does the converter. The padded
  columns hold zeros (fp16) or quantization noise (EXL3), so trimming them is exact.
- At decode it runs an EXL3 model's K and V projections as one fused multi-matrix GEMM (`multi_kv`; Q and
  gate likewise, `multi_qg`) that writes into an unpadded staging buffer. Its kernels tile the output 128
  columns at a time, so with 192 columns no tile fits and the first step fails ("exl3_mgemm autotune: no
  compatible kernel shapes").
- Its gated MLP's fast paths for up to 8 and up to 32 rows (the graphed `bc` and the fused gate/up `multi_gu`)
  feed the unpadded hidden state to kernels sized for the padded weights: "C and B have incompatible shapes"
  (the plain MLP pads through staging buffers; the gated one does not).

Without those fast paths exllamav3 runs the projections one by one through `Linear`, which pads the input and
trims the output, as it already does for any step over 32 rows: same weights, same kernels, more launches.
A model whose sizes are multiples of 128 (every common 1B+ model) keeps every fast path.

    python -m exlnb.engines.exllamav3.compat ARGS...              # exllamav3's converter (convert_model) with the fixes
    python -m exlnb.engines.exllamav3.compat --run SCRIPT ARGS... # any program on exllamav3 with them, e.g.
                                                                  # TabbyAPI's main.py serving such a model

Stock exllamav3 1.6.5 (and so TabbyAPI) cannot load an EXL3 quant of SmolLM2-135M: its first residual add fails
as above. `--run` serves it with the same fixes the engine uses.
"""

from __future__ import annotations

import functools
import runpy
import sys
from pathlib import Path

# the narrowest output tile of exllamav3's EXL3 GEMM kernels (exl3_kernel_map.cuh, EXL3_GEMM_TILESIZE_N)
EXL3_GEMM_TILE_COLUMNS = 128

# attention's fused projection bundles that stage their output unpadded: bundle -> heads attribute it writes
STAGED_BUNDLES = {"multi_kv": "num_kv_heads", "multi_qg": "num_q_heads"}


def fix_exllamav3() -> None:
    """Apply every fix below to exllamav3 (idempotent): call before building a model."""
    trim_padded_mlp_outputs()
    skip_unpadded_fast_paths()


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


def skip_unpadded_fast_paths() -> None:
    """Make every attention layer and gated MLP loaded from now on drop the fast paths that ignore padding."""
    from exllamav3.modules.attn import Attention
    from exllamav3.modules.mlp import GatedMLP

    for cls, drop in ((Attention, drop_untileable_bundles), (GatedMLP, drop_unpadded_mlp_paths)):
        if not getattr(cls.load_local, "skips_unpadded_fast_paths", False):
            cls.load_local = _then(cls.load_local, drop)


def _then(load_local, drop):
    @functools.wraps(load_local)
    def load_local_then_drop(self, *args, **kwargs):
        load_local(self, *args, **kwargs)
        drop(self)

    load_local_then_drop.skips_unpadded_fast_paths = True
    return load_local_then_drop


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


def drop_unpadded_mlp_paths(mlp) -> list[str]:
    """Drop a loaded gated MLP's graphed and fused gate/up paths where its projections are padded."""
    linears = [*mlp.gates, *mlp.ups, *mlp.downs]
    if all(
        lin.in_features == getattr(lin, "in_features_unpadded", lin.in_features)
        and lin.out_features == getattr(lin, "out_features_unpadded", lin.out_features)
        for lin in linears
    ):
        return []
    dropped = []
    if getattr(mlp, "bc", None) is not None:
        mlp.bc = None
        dropped.append("bc")
    for index, fused in enumerate(mlp.multi_gu):
        if fused is not None:
            fused.unload()
            mlp.multi_gu[index] = None
            dropped.append(f"multi_gu[{index}]")
    return dropped


def main(argv: list[str]) -> None:
    fix_exllamav3()
    if argv[:1] == ["--run"] and len(argv) > 1:
        sys.argv = argv[1:]
        sys.path.insert(0, str(Path(argv[1]).resolve().parent))  # as `python SCRIPT` puts the script's folder first
        runpy.run_path(argv[1], run_name="__main__")
        return
    sys.argv = ["convert_model", *argv]
    runpy.run_module("exllamav3.conversion.convert_model", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
