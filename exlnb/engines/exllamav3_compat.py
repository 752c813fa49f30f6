"""What exlnb changes in exllamav3 1.6.5 before using it, for the engine and for the EXL3 converter alike.

exllamav3 pads every linear layer's dimensions to multiples of 128 and trims the padded output columns where a
projection writes back into the residual stream, but only for attention's `o_proj`: the MLP's down projections
keep their padding. On a model whose hidden size is not a multiple of 128 (SmolLM2-135M: 576, padded to 640)
loading fails in the residual add ("The size of tensor a (576) must match the size of tensor b (640)"), and so
does the converter. The padded columns hold zeros (fp16) or quantization noise (EXL3), so trimming them is exact.

    python -m exlnb.engines.exllamav3_compat ARGS...   # exllamav3's converter (convert_model) with the fix
"""

from __future__ import annotations

import functools
import runpy
import sys


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


def main(argv: list[str]) -> None:
    trim_padded_mlp_outputs()
    sys.argv = ["convert_model", *argv]
    runpy.run_module("exllamav3.conversion.convert_model", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
