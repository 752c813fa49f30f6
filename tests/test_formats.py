"""Engine choice by model folder: read from config.json, checked with small fake folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exlnb.engines import options as options_module
from exlnb.engines.formats import model_format
from exlnb.engines.options import EngineOptions


def fake_model(tmp_path: Path, quant_method: str | None = None, *, architectures=("LlamaForCausalLM",)) -> Path:
    config = {"architectures": list(architectures), "model_type": "llama"}
    if quant_method:
        config["quantization_config"] = {"quant_method": quant_method, "bits": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")
    return tmp_path


def resolve(model_dir: Path, engine: str = "auto", cache: str = "fp16", paged: str | bool = "auto") -> EngineOptions:
    return EngineOptions.resolve(
        engine=engine,
        model_dir=model_dir,
        cache_tokens=None,
        cache_dtype=cache,
        max_batch_size=None,
        gpu_split=None,
        paged=paged,
    )


@pytest.fixture
def cuda(monkeypatch):
    monkeypatch.setattr(options_module, "cuda_available", lambda: True)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(options_module, "cuda_available", lambda: False)


@pytest.mark.parametrize("method, fmt", [(None, "hf"), ("exl2", "exl2"), ("exl3", "exl3")])
def test_format_is_read_from_the_quantization_config(tmp_path, method, fmt):
    assert model_format(fake_model(tmp_path, method)) == fmt


@pytest.mark.parametrize("method, engine", [(None, "exllamav2"), ("exl2", "exllamav2"), ("exl3", "exllamav3")])
def test_auto_picks_the_engine_for_the_format_on_cuda(tmp_path, cuda, method, engine):
    assert resolve(fake_model(tmp_path, method)).engine == engine


def test_auto_without_cuda_runs_fp16_on_the_cpu_engine(tmp_path, no_cuda):
    assert resolve(fake_model(tmp_path)).engine == "cpu"


def test_auto_without_cuda_refuses_a_quantized_model_saying_why(tmp_path, no_cuda):
    with pytest.raises(ValueError, match="EXL3 models run on the exllamav3 engine, which needs a CUDA GPU"):
        resolve(fake_model(tmp_path, "exl3"))


def test_exllamav3_can_be_chosen_explicitly_for_fp16(tmp_path, cuda):
    assert resolve(fake_model(tmp_path), engine="exllamav3").engine == "exllamav3"


@pytest.mark.parametrize(
    "engine, method, hint",
    [
        ("exllamav2", "exl3", 'engine="exllamav3"'),
        ("exllamav3", "exl2", 'engine="exllamav2"'),
        ("cpu", "exl2", "exllamav2"),
    ],
)
def test_an_engine_that_cannot_read_the_format_is_refused(tmp_path, cuda, engine, method, hint):
    with pytest.raises(ValueError, match=f"the {engine} engine cannot load") as error:
        resolve(fake_model(tmp_path, method), engine=engine)
    assert hint in str(error.value)


def test_a_folder_quantized_another_way_is_refused(tmp_path, cuda):
    with pytest.raises(ValueError, match="quantized with 'gptq', which no exlnb engine loads"):
        resolve(fake_model(tmp_path, "gptq"))


def test_a_config_without_architectures_is_refused(tmp_path, cuda):
    with pytest.raises(ValueError, match="names no architectures"):
        resolve(fake_model(tmp_path, architectures=()))


def test_a_folder_without_weights_is_refused(tmp_path, cuda):
    (fake_model(tmp_path) / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="holds no weights"):
        resolve(tmp_path)


def test_a_folder_without_config_is_refused(tmp_path, cuda):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve(tmp_path)


def test_quantized_cache_on_the_cpu_engine_names_both_gpu_engines(tmp_path, no_cuda):
    with pytest.raises(ValueError, match="needs exllamav2 or exllamav3"):
        resolve(fake_model(tmp_path), cache="q4")


def test_unpaged_on_an_engine_that_always_pages_is_refused(tmp_path, no_cuda):
    with pytest.raises(ValueError, match="the cpu engine always pages: paged=False needs exllamav2"):
        resolve(fake_model(tmp_path), engine="cpu", paged=False)


def test_an_unknown_engine_names_the_registered_ones(tmp_path, no_cuda):
    with pytest.raises(ValueError, match="unknown engine 'exllamav4': choose one of auto, exllamav2, exllamav3, cpu"):
        resolve(fake_model(tmp_path), engine="exllamav4")
