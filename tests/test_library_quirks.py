"""The exllamav2 0.3.2 and exllamav3 1.6.5 quirks that exlnb works around, checked without a GPU (docs/gpu.md)."""

from __future__ import annotations

import types

import pytest
import torch

from exlnb.engines.exllamav2.engine import without_taken_back
from exlnb.engines.exllamav3.compat import _trimming, drop_unpadded_mlp_paths, drop_untileable_bundles
from exlnb.engines.library_engine import installed_version


def test_the_tokens_of_a_banned_string_that_exllamav2_took_back_are_not_reported():
    # what exllamav2 emits after banning " Paris" (ids 7042, 9): its held ids still end with the taken-back ones
    result = {
        "text": " Lon",
        "token_ids": torch.tensor([[11, 7042, 9]]),
        "suppressed_tokens": torch.tensor([[7042, 9]]),
    }
    assert without_taken_back(result["token_ids"].flatten().tolist(), result) == [11]


def test_ids_are_left_alone_when_nothing_was_taken_back_or_the_library_already_dropped_them():
    assert without_taken_back([11, 12], {"token_ids": torch.tensor([[11, 12]])}) == [11, 12]
    assert without_taken_back([11], {"suppressed_tokens": torch.tensor([[7042, 9]])}) == [11]  # a fixed exllamav2
    assert without_taken_back([11, 12], {"suppressed_tokens": torch.tensor([[], []], dtype=torch.long)[:1]}) == [11, 12]


class Linear:
    """The two widths exllamav3's Linear keeps: padded to a multiple of 128, and the model's own."""

    def __init__(self, out_features: int) -> None:
        self.out_features_unpadded = out_features
        self.out_features = -(-out_features // 128) * 128
        self.trim_padded_out = False


class GatedMLP:
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        self.ups = [Linear(intermediate_size)]
        self.downs = [Linear(hidden_size)]


@pytest.mark.parametrize(("hidden", "trimmed"), [(576, True), (2048, False)])
def test_an_mlp_trims_the_padding_of_its_down_projection_where_the_hidden_size_needs_it(hidden, trimmed):
    mlp = type("Patched", (GatedMLP,), {"__init__": _trimming(GatedMLP.__init__)})(hidden, 1500)
    assert mlp.downs[0].trim_padded_out is trimmed
    assert mlp.ups[0].trim_padded_out is False  # feeds the activation, whose padding the down projection reads


class Bundle:
    unloaded = False

    def unload(self) -> None:
        self.unloaded = True


@pytest.mark.parametrize(("kv_heads", "dropped"), [(3, ["multi_kv"]), (2, [])])  # 3 x 64 = 192 columns; 2 x 64 = 128
def test_a_fused_kv_bundle_is_dropped_where_its_output_is_not_a_whole_number_of_gemm_tiles(kv_heads, dropped):
    attention = types.SimpleNamespace(
        num_kv_heads=kv_heads, num_q_heads=8, head_dim=64, multi_kv=Bundle(), multi_qg=None
    )
    bundle = attention.multi_kv
    assert drop_untileable_bundles(attention) == dropped
    assert (attention.multi_kv is None) is bool(dropped) and bundle.unloaded is bool(dropped)


class PaddedLinear(Linear):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(out_features)
        self.in_features_unpadded = in_features
        self.in_features = -(-in_features // 128) * 128


@pytest.mark.parametrize(("hidden", "dropped"), [(576, ["bc", "multi_gu[0]"]), (2048, [])])
def test_a_gated_mlps_fast_paths_are_dropped_where_its_projections_are_padded(hidden, dropped):
    mlp = types.SimpleNamespace(
        gates=[PaddedLinear(hidden, 1536)],
        ups=[PaddedLinear(hidden, 1536)],
        downs=[PaddedLinear(1536, hidden)],
        bc=object(),
        multi_gu=[Bundle()],
    )
    fused = mlp.multi_gu[0]
    assert drop_unpadded_mlp_paths(mlp) == dropped
    assert (mlp.bc is None, mlp.multi_gu[0] is None, fused.unloaded) == (bool(dropped),) * 3


def test_a_library_without_a_version_attribute_is_read_from_its_package_metadata():
    from importlib.metadata import version

    assert installed_version(types.ModuleType("pytest"), "pytest") == version("pytest")
    assert installed_version(types.SimpleNamespace(__version__="0.3.2"), "exllamav2") == "0.3.2"


def test_run_starts_a_program_with_the_fixes_in_place_as_python_would_run_it(monkeypatch, tmp_path):
    """`compat --run SCRIPT ARGS` (how TabbyAPI serves an EXL3 SmolLM2): the script runs as __main__, with its own
    argv and its folder first on the path, after every fix is applied to the library it will build on."""
    import sys

    from exlnb.engines.exllamav3 import compat

    class Attention:
        def load_local(self):
            pass

    class MLP:
        def __init__(self):
            self.downs = [Linear(576)]

    class StandInGatedMLP(MLP):
        def load_local(self):
            pass

    mlp = types.ModuleType("exllamav3.modules.mlp")
    mlp.MLP, mlp.GatedMLP = MLP, StandInGatedMLP
    attn = types.ModuleType("exllamav3.modules.attn")
    attn.Attention = Attention
    for name, module in (
        ("exllamav3", types.ModuleType("exllamav3")),
        ("exllamav3.modules", types.ModuleType("exllamav3.modules")),
        ("exllamav3.modules.mlp", mlp),
        ("exllamav3.modules.attn", attn),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    (tmp_path / "helper_of_the_server.py").write_text("NAME = 'found beside the script'\n")
    script = tmp_path / "main.py"
    script.write_text(
        "import sys, json\nfrom helper_of_the_server import NAME\nfrom exllamav3.modules.mlp import GatedMLP\n"
        "if __name__ == '__main__':\n"
        "    sys.modules['exllamav3'].seen = (sys.argv, NAME, GatedMLP().downs[0].trim_padded_out)\n"
    )
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    compat.main(["--run", str(script), "--config", "config.yml"])
    assert sys.modules["exllamav3"].seen == ([str(script), "--config", "config.yml"], "found beside the script", True)
    assert StandInGatedMLP.load_local.skips_unpadded_fast_paths and Attention.load_local.skips_unpadded_fast_paths
    sys.modules.pop("helper_of_the_server", None)
