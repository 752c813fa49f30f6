"""The speed suite: on the CPU it times the bundled model in quick mode and writes a record in which every goal is
either measured or says why not; it resumes today's record; a GPU-only part refuses in one line without CUDA;
the goals table is the one place a goal's name, its computation and its threshold are said."""

import ast
import importlib
import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import exlnb
from benchmarks import speed, speed_setups

ISSUE_GOALS = {  # issue 42's names, which the table must keep
    "v3_fp16_7b_batch1_over_floor_at_most_1.5",
    "v2_fp16_7b_batch1_over_floor_at_most_1.3",
    "v3_exl3_7b_kit_over_raw_exllamav3_batch1_at_least_1.15",
    "over_transformers_compiled_7b_batch1_at_least_1.2_v2",
    "over_transformers_compiled_7b_batch1_at_least_1.2_v3",
    "over_transformers_compiled_7b_batch8_at_least_1.2_v2",
    "over_transformers_compiled_7b_batch8_at_least_1.2_v3",
    "v3_fp16_7b_repeat_spread_at_most_1.1",
    "context_4096_over_256_per_token_at_most_1.15",
    "batch8_aggregate_over_batch1_at_least_5",
}


def _strict(name: str):
    raise ValueError(f"{name} in the record: strict JSON readers refuse it")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU run: on CUDA the GPU parts run instead")
def test_quick_cpu_run_measures_the_bundled_model_resumes_and_accounts_for_every_goal(tmp_path):
    stopped = speed.main(["--quick", "--budget-s", "0", "--out", str(tmp_path)])  # one part, then stop
    first = json.loads(stopped.read_text())
    assert first["complete"] is False and first["calls"][0]["parts"] == ["bandwidth"]
    assert first["remaining"] == ["floor@bundled", "kit-cpu@bundled"]

    path = speed.main(["--quick", "--out", str(tmp_path)])
    assert path == stopped, "a second run of the same day and plan resumes the first's record"
    record = json.loads(path.read_text(), parse_constant=_strict)
    assert record["complete"] is True and record["remaining"] == []
    assert record["calls"][1]["parts"] == ["floor@bundled", "kit-cpu@bundled"]
    kit = record["parts"]["kit-cpu@bundled"]["metrics"]
    names = ("ms_per_token_64", "batch8_tokens_per_s", "batch8_first_token_ms", "batch8_decode_tokens_per_s")
    for name in (*names, "ttft_64_ms", "tokens_per_s_64"):
        assert math.isfinite(kit[name]) and kit[name] > 0, name
    # the 8 jobs' ramp is part of their whole time: 8 new tokens each at the aggregate rate
    assert kit["batch8_first_token_ms"] < 1000 * 8 * record["plan"]["new_tokens"] / kit["batch8_tokens_per_s"]
    assert len(record["parts"]["kit-cpu@bundled"]["samples"]["ms_per_token_64"]["samples"]) == record["plan"]["repeats"]
    floor = record["parts"]["floor@bundled"]["metrics"]
    assert floor["ms_per_token"] == pytest.approx(
        1000 * floor["weight_bytes_read_per_token"] / floor["copy_bandwidth_bytes_per_s"]
    )
    assert record["parts"]["kit-exllamav2@7b-fp16"]["why"] == "no CUDA here"

    assert set(record["goals"]) == ISSUE_GOALS == set(record["goal_definitions"])
    for name, goal in record["goals"].items():
        assert isinstance(goal["met"], bool), name
        assert goal["ratio"] is not None or "no CUDA here" in goal["why"], name
    assert path.with_suffix(".png").stat().st_size > 1000

    again = speed.main(["--quick", "--out", str(tmp_path)])
    resumed = json.loads(again.read_text())
    assert again == path and resumed["calls"][2]["parts"] == [], "a part already measured is not measured again"
    assert resumed["parts"]["kit-cpu@bundled"] == record["parts"]["kit-cpu@bundled"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_a_gpu_only_part_refuses_in_one_line_without_cuda(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        speed.main(["--only", "kit-exllamav2@7b-fp16", "--out", str(tmp_path)])
    assert exit.value.code == 2
    message = capsys.readouterr().err
    assert message.count("\n") == 1 and "kit-exllamav2+kit-exllamav3+transformers@7b-fp16: no CUDA here" in message
    assert not list(tmp_path.iterdir()), "nothing written by a run that refused"


def test_goals_table_names_each_goal_once_and_its_threshold_is_its_name():
    assert {goal.name for goal in speed.GOALS} == ISSUE_GOALS and len(speed.GOALS) == len(ISSUE_GOALS)

    for goal in speed.GOALS:  # each goal on parts whose ratio sits on its threshold, just above and just below
        (top, x) = goal.numerator
        peer = speed.against_a_peer(goal)
        for factor, met in ((1.0, True), (1.01, not goal.at_most), (0.99, goal.at_most)):
            parts = {top: {"metrics": {}, "call": 0, "timed_with": [peer] if peer else []}}
            scale = 1.0
            if goal.denominator is not None:
                bottom, y = goal.denominator
                parts.setdefault(bottom, {"metrics": {}, "call": 0})["metrics"][y] = scale = 10.0
            parts[top]["metrics"][x] = scale * goal.threshold * factor
            result = speed.goals(parts)[goal.name]
            assert result["ratio"] == pytest.approx(goal.threshold * factor) and result["met"] is met, (
                goal.name,
                factor,
            )

    missing = speed.goals({"floor@7b-fp16": {"why": "no CUDA here"}})["v2_fp16_7b_batch1_over_floor_at_most_1.3"]
    assert missing == {
        "ratio": None,
        "met": False,
        "why": "kit-exllamav2@7b-fp16: not run yet; floor@7b-fp16: no CUDA here",
    }


def test_a_ratio_against_a_peer_counts_only_where_the_two_were_timed_in_turns():
    goal = "over_transformers_compiled_7b_batch1_at_least_1.2_v3"
    parts = {
        "kit-exllamav3@7b-fp16": {"metrics": {"tokens_per_s_256": 300.0}, "call": 0, "timed_with": []},
        "transformers@7b-fp16": {"metrics": {"tokens_per_s_256": 100.0}, "call": 1},
    }
    apart = speed.goals(parts)[goal]
    parts["kit-exllamav3@7b-fp16"]["timed_with"] = ["kit-exllamav2", "transformers"]
    together = speed.goals(parts)[goal]
    assert apart["ratio"] == together["ratio"] == 3.0
    assert (apart["met"], apart["timed_in_turns"]) == (False, False) and "were not timed in turns" in apart["why"]
    assert (together["met"], together["timed_in_turns"]) == (True, True)


def test_kernels_are_grouped_by_kind_by_their_names():
    kinds = {
        "void gemv_half_kernel<128>(half const*, half*)": "GEMV/GEMM",
        "sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize64x64x64": "GEMV/GEMM",
        "fmha_cutlassF_f16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)": "attention",
        "void rms_norm_kernel<256>(half const*, half*)": "norms and RoPE",
        "void rope_cuda_kernel(half*, float const*)": "norms and RoPE",
        "void at::native::reduce_kernel<argmax_ops>(...)": "sampling",
        "void at::native::vectorized_elementwise_kernel<4, silu>(...)": "other",
    }
    assert {name: speed_setups.kernel_kind(name) for name in kinds} == kinds


def jit_functions(module: str) -> list[str]:
    """The names of the Triton functions an exlnb engines module compiles: what a profile knows its kernels by.
    Read from the source, so triton need not be here."""
    source = (Path(exlnb.__file__).parent / "engines" / f"{module}.py").read_text()
    return [
        node.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list)
    ]


def test_exlnb_s_own_triton_kernels_are_counted_as_attention():
    """The profile knows a kernel only by its function's name: the Triton decode kernels were once counted as
    "other" (speed-nvidia-h100-80gb-hbm3-2026-11-26-one-start)."""
    kernels = [name for name in jit_functions("triton_decode") if name.endswith("_kernel")]
    assert len(kernels) == 2
    assert {name: speed_setups.kernel_kind(name) for name in kernels} == dict.fromkeys(kernels, "attention")


def test_exlnb_s_own_gemv_is_counted_as_a_product():
    """The GEMV's 1.15 ms a step were counted as "other" in the H200 profiles of 2026-11-28 (speed-nvidia-h200-
    2026-11-28-feed), beside the products that cuBLAS ran."""
    kernels = jit_functions("gemv")
    assert kernels
    assert {name: speed_setups.kernel_kind(name) for name in kernels} == dict.fromkeys(kernels, "GEMV/GEMM")


def test_the_floor_reads_each_weight_once_and_no_embedding_beside_an_output_head(tmp_path):
    tied, untied = tmp_path / "tied", tmp_path / "untied"
    for folder in (tied, untied):
        folder.mkdir()
        save_file(
            {
                "model.embed_tokens.weight": torch.zeros(100, 8, dtype=torch.float16),
                "model.norm.weight": torch.zeros(8, dtype=torch.float16),
            },
            folder / "model-head.safetensors",
        )
        save_file(
            {"model.layers.0.mlp.up_proj.weight": torch.zeros(16, 8, dtype=torch.float16)},
            folder / "model-layer000.safetensors",
        )
    save_file({"lm_head.weight": torch.zeros(100, 8, dtype=torch.float16)}, untied / "model-lm-head.safetensors")

    assert speed_setups.weight_bytes_read_per_token(tied) == 2 * (800 + 8 + 128)  # the tied embedding is the head
    assert speed_setups.weight_bytes_read_per_token(untied) == 2 * (8 + 128 + 800)  # the head, not the embedding


def test_only_accepts_parts_runners_and_models_and_names_the_choices_when_wrong():
    assert speed.select("7b-exl3", profile=False) == [
        "bandwidth",
        "quantize@7b-exl3",
        "floor@7b-exl3",
        "kit-exllamav3+kit-exllamav3-ahead-off+raw-exllamav3@7b-exl3",
    ]
    assert speed.select("7b-exl3", profile=True)[-1] == "profile-exllamav3@7b-exl3"
    assert speed.select("profile-exllamav3", profile=False) == [
        "profile-exllamav3@7b-fp16",
        "profile-exllamav3@7b-exl3",
    ]
    # a setup timed in turns with others is run as the part it is in
    assert speed.select("transformers", profile=False) == [
        "kit-exllamav2+kit-exllamav3+transformers@7b-fp16",
        "kit-exllamav2+kit-exllamav3+transformers@bundled",
    ]
    assert speed.select("raw-exllamav3@7b-exl3", profile=False) == [
        "kit-exllamav3+kit-exllamav3-ahead-off+raw-exllamav3@7b-exl3"
    ]
    with pytest.raises(ValueError, match="--only 7b-gguf: not a part, runner or model; parts: bandwidth, "):
        speed.select("7b-gguf", profile=False)


def test_a_random_llama_loads_whole_in_transformers_and_its_floor_counts_what_decode_reads(tmp_path):
    """The 7B-shaped model's recipe at a small width: transformers `generate` (the speed suite's third peer)
    finds every weight through the shard index, and the floor's bytes are the recipe's own count."""
    from transformers import AutoModelForCausalLM

    from exlnb.random_model import BUNDLED_VOCAB, LLAMA_7B, make_random_llama, tokenizer_folder, weights_bytes

    shape = dict(
        LLAMA_7B,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
    )
    read = make_random_llama(tmp_path / "model", tokenizer_folder(), shape)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "model", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and model.config.num_hidden_layers == 2
    assert read == speed_setups.weight_bytes_read_per_token(tmp_path / "model")
    # the size the scratch folder and the device are checked against is what the folder holds
    assert model.config.vocab_size == BUNDLED_VOCAB
    assert sum(p.numel() * 2 for p in model.parameters()) == weights_bytes(shape, BUNDLED_VOCAB)


def test_a_setup_timed_in_a_worker_of_its_own_says_why_it_could_not_load(tmp_path):
    with pytest.raises(RuntimeError, match=r"^kit-cpu: .*") as error:
        with speed_setups.setup_apart("kit-cpu", tmp_path / "no model here"):
            pass
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("runner", "variable", "switch"),
    [
        *(
            (runner, "EXLNB_QUEUE_AHEAD", "exlnb.engines.queue_ahead:queue_ahead_on")
            for runner in ("kit-exllamav3-ahead-off", "kit-exllamav2-ahead-on", "kit-exllamav2-ahead-off")
        ),
        *(
            (f"kit-{engine}-{side}", "EXLNB_FUSED_PRODUCTS", "exlnb.engines.fused_products:fused_products_on")
            for engine in ("exllamav2", "exllamav3")
            for side in ("fused", "unfused")
        ),
        *(
            (
                f"kit-{engine}-prefill-{side}",
                "EXLNB_PREFILL_TOGETHER",
                "exlnb.engines.prefill_together:prefill_together_on",
            )
            for engine in ("exllamav2", "exllamav3")
            for side in ("together", "apart")
        ),
        *(
            (f"kit-exllamav2-{runner}", variable, switch)
            for runner in ("mlp-tail", "attention-tail", "tails", "tails-apart")
            for variable, switch in (
                ("EXLNB_MLP_TAIL", "exlnb.engines.exllamav2.mlp_tail:mlp_tail_on"),
                ("EXLNB_ATTENTION_TAIL", "exlnb.engines.exllamav2.attention_tail:attention_tail_on"),
                ("EXLNB_NORM_IN_PRODUCT", "exlnb.engines.exllamav2.folded_norm:norm_in_product_on"),
            )
        ),
        *(
            (
                f"kit-exllamav2-fold-{runner}",
                "EXLNB_NORM_IN_PRODUCT",
                "exlnb.engines.exllamav2.folded_norm:norm_in_product_on",
            )
            for runner in ("attention", "both", "none", "both-g4k512", "both-dependent")
        ),
        *(
            (f"kit-{engine}-fresh-{side}", "EXLNB_DECODE_FRESH_APART", "exlnb.engines.triton_decode:fresh_tile_apart")
            for engine in ("exllamav2", "exllamav3")
            for side in ("apart", "inline")
        ),
        *(
            (f"kit-{engine}-{side}", "EXLNB_DEPENDENT_LAUNCH", "exlnb.engines.dependent_launch:dependent_launch_on")
            for engine in ("exllamav2", "exllamav3")
            for side in ("dependent", "independent")
        ),
        ("kit-exllamav3-before-wait", "EXLNB_QUEUE_BEFORE_WAIT", "exlnb.engines.queue_ahead:queue_before_wait_on"),
        ("kit-exllamav3-after-wait", "EXLNB_QUEUE_BEFORE_WAIT", "exlnb.engines.queue_ahead:queue_before_wait_on"),
    ],
)
def test_a_kit_variant_runs_its_engine_with_its_switch_set_then_leaves_the_environment_as_it_was(
    monkeypatch, runner, variable, switch
):
    """The speed suite times an engine with a switch set beside the engine as it ships, in turns: the variant's
    environment holds while its setup lives, loaded and timed in a process of its own (a switch may be read at load
    or at each launch), and is gone after, as it was before."""
    module, name = switch.split(":")
    if module in ("exlnb.engines.triton_decode", "exlnb.engines.dependent_launch"):
        pytest.importorskip("triton")  # these modules import it at their top
    is_on = getattr(importlib.import_module(module), name)
    engine, variables = speed_setups.KIT_VARIANTS[runner]
    assert runner.startswith(f"kit-{engine}-") and speed.RUNNER_LIBRARY[runner] == engine
    wanted = variables[variable] != "0"
    for before in (None, "0" if wanted else "1"):
        if before is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, before)
        with speed_setups._environment(variables):
            assert is_on() is wanted
        assert os.environ.get(variable) == before


DEFAULTS = {"split_keys": "SPLIT_KEYS", "split_warps": "SPLIT_WARPS"}  # each number's reader, and its default


@pytest.mark.parametrize(
    "runner, variable, read, wanted",
    [
        *(
            (f"kit-{engine}-split{keys}", "EXLNB_DECODE_SPLIT_KEYS", "split_keys", keys)
            for engine in ("exllamav2", "exllamav3")
            for keys in (512, 256)
        ),
        *(
            (f"kit-{engine}-warps{warps}", "EXLNB_DECODE_SPLIT_WARPS", "split_warps", warps)
            for engine in ("exllamav2", "exllamav3")
            for warps in (8, 4)
        ),
    ],
)
def test_a_decode_attention_variant_sets_its_number_while_it_lives(monkeypatch, runner, variable, read, wanted):
    """Keys a split and warps a program, each timed against the default in turns: the variant's number holds while
    its setup lives, and the default after."""
    pytest.importorskip("triton")  # the decode attention's module imports it at its top
    from exlnb.engines import triton_decode

    monkeypatch.delenv(variable, raising=False)
    library, variables = speed_setups.KIT_VARIANTS[runner]
    assert runner.startswith(f"kit-{library}-") and speed.RUNNER_LIBRARY[runner] == library
    number = getattr(triton_decode, read)
    with speed_setups._environment(variables):
        assert number() == wanted
    assert variable not in os.environ and number() == getattr(triton_decode, DEFAULTS[read])


@pytest.mark.parametrize(
    "runner, gated",
    [
        ("kit-exllamav2-fold-attention", None),
        ("kit-exllamav2-fold-both", None),
        ("kit-exllamav2-fold-both-g4k512", (4, 512, 4, 4, True)),
    ],
)
def test_a_fold_variant_sets_the_activation_kernel_s_tiles_while_it_lives(monkeypatch, runner, gated):
    """The activation's kernel in its former shape, timed against the sweep's fastest in turns: the variant's shape
    holds for that kernel alone while its setup lives (RoPE's keeps its own), each kernel's default otherwise and
    after."""
    pytest.importorskip("triton")  # the normed products' module imports it at its top
    from exlnb.engines import normed_gemv as n

    for variable in (n.GATED_TILES, n.ROPED_TILES):
        monkeypatch.delenv(variable, raising=False)
    _, variables = speed_setups.KIT_VARIANTS[runner]

    def configs():
        return n.paired_config(n.GATED_TILES, n.GATED_CONFIG), n.paired_config(n.ROPED_TILES, n.ROPED_CONFIG)

    with speed_setups._environment(variables):
        assert configs() == (gated or n.GATED_CONFIG, n.ROPED_CONFIG)
    assert configs() == (n.GATED_CONFIG, n.ROPED_CONFIG)


def test_each_setup_is_timed_by_one_part_per_model_so_its_record_is_its_turns():
    """A setup's record (`runner@model`) holds the numbers of the part that timed it, and a goal against a peer
    counts only where the two took turns: a second part timing the same setup would overwrite the first's."""
    owners: dict[str, str] = {}
    for part in speed.PARTS:
        model = part.partition("@")[2]
        for runner in speed.runners(part):
            assert owners.setdefault(f"{runner}@{model}", part) == part, f"{runner}@{model} is timed by two parts"
