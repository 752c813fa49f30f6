"""Quantizing: the checks made before a converter starts, the cache key, resuming, and reading progress."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from exlnb import quantize as quantize_module
from exlnb.quantize import QuantizedModel, converter_command, progress_of, quantize


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("EXLNB_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def fp16_model(folder: Path, quant_method: str | None = None) -> Path:
    folder.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30}
    if quant_method:
        config["quantization_config"] = {"quant_method": quant_method}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(format="gguf"), "format='gguf': choose one of exl2, exl3"),
        (dict(format="exl2", bits=1.5), "bits=1.5 is out of range for EXL2: give 2 to 8"),
        (dict(format="exl3", bits=9.0), "bits=9.0 is out of range for EXL3: give 1 to 8"),
        (dict(format="exl2", head_bits=7), "head_bits=7 is not one EXL2 offers"),
        (dict(format="exl3", head_bits=12), "head_bits=12 is not one EXL3 offers"),
    ],
)
def test_arguments_a_converter_would_refuse_are_refused_first(home, tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        quantize(fp16_model(tmp_path / "m"), **kwargs)


def test_a_quantized_source_is_refused(home, tmp_path):
    with pytest.raises(ValueError, match="is already EXL2: quantize the unquantized"):
        quantize(fp16_model(tmp_path / "m", "exl2"), format="exl3")


def test_without_cuda_quantizing_says_it_needs_cuda(home, tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(RuntimeError, match="quantizing needs CUDA"):
        quantize(fp16_model(tmp_path / "m"), format="exl3", bits=4.0)


def test_the_cache_key_names_model_format_bits_and_head_bits(home, tmp_path):
    source = fp16_model(tmp_path / "smol")
    a = QuantizedModel(source, "exl3", 4.0, 6)
    assert a.folder.parent == home / "quantized"
    assert a.folder.name.startswith("smol-") and a.folder.name.endswith("-exl3-4bpw-h6")
    others = {
        QuantizedModel(source, "exl2", 4.0, 6),
        QuantizedModel(source, "exl3", 3.5, 6),
        QuantizedModel(source, "exl3", 4.0, 8),
    }
    assert a.folder not in {o.folder for o in others}
    assert QuantizedModel(fp16_model(tmp_path / "other" / "smol"), "exl3", 4.0, 6).folder != a.folder


def test_a_finished_quantization_is_returned_from_the_cache_without_cuda(home, tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    source = fp16_model(tmp_path / "m")
    done = fp16_model(QuantizedModel(source, "exl3", 4.0, 6).output, "exl3")
    assert quantize(source, format="exl3", bits=4.0) == done


def test_exl3_resumes_from_a_work_directory_that_holds_a_started_job(tmp_path):
    target = QuantizedModel(fp16_model(tmp_path / "m"), "exl3", 4.0, 6)
    fresh = converter_command(target)
    assert fresh[:3] == [sys.executable, "-m", "exlnb.engines.exllamav3.compat"] and "-r" not in fresh
    assert fresh[fresh.index("-b") + 1] == "4" and fresh[fresh.index("-o") + 1] == str(target.partial)
    target.work.mkdir(parents=True)
    (target.work / "args.json").write_text("{}")
    assert converter_command(target)[3:] == ["-w", str(target.work), "-r"]


def test_exl2_runs_the_same_command_to_resume(tmp_path):
    target = QuantizedModel(fp16_model(tmp_path / "m"), "exl2", 2.5, 8)
    command = converter_command(target)
    assert command[2] == "exllamav2.conversion.convert_exl2" and "-so" in command
    assert command[command.index("-b") + 1] == "2.5" and command[command.index("-hb") + 1] == "8"


def test_exl2_measures_a_model_once_and_reuses_the_measurement_at_other_bits(home, tmp_path, monkeypatch):
    source = fp16_model(tmp_path / "m")
    first, second = QuantizedModel(source, "exl2", 4.0, 6), QuantizedModel(source, "exl2", 6.0, 6)
    assert "-m" not in converter_command(first)[3:]  # past `python -m module`
    # a stand-in converter that finishes as convert_exl2 does: the model, and the measurement in its work folder
    finish = (
        "import json, pathlib, sys; out, work = map(pathlib.Path, sys.argv[1:]); out.mkdir(parents=True); "
        "work.mkdir(parents=True, exist_ok=True); "
        "(out / 'config.json').write_text(json.dumps({'quantization_config': {'quant_method': 'exl2'}})); "
        "(work / 'measurement.json').write_text('{\"measurement\": {}, \"last_module_idx\": 0}')"
    )
    monkeypatch.setattr(
        quantize_module, "converter_command", lambda t: [sys.executable, "-c", finish, str(t.partial), str(t.work)]
    )
    first.folder.mkdir(parents=True)
    quantize_module._convert(first, progress=False)
    assert not first.work.exists()
    assert json.loads(first.measurement.read_text())["last_module_idx"] == 0
    assert second.measurement == first.measurement
    command = converter_command(second)[3:]
    assert command[command.index("-m") + 1] == str(first.measurement)
    assert "-m" not in converter_command(QuantizedModel(fp16_model(tmp_path / "other"), "exl2", 4.0, 6))[3:]


def test_progress_is_read_from_each_converters_output():
    line = '[STATUS]{"stage": "Quantizing", "completion": 0.25}[/STATUS]\n'
    assert progress_of(line, "exl2", 30) == ("Quantizing", 0.25)
    assert progress_of(" -- Loading unquantized module: model.layers.14\n", "exl3", 30) == ("Quantizing", 0.5)
    assert progress_of(" -- Writing into /x/model.partial\n", "exl3", 30) == ("Compiling", 0.0)
    assert progress_of(" -- Measuring quantization impact...\n", "exl2", 30) is None


def test_a_converter_that_exits_zero_without_output_counts_as_failed(home, tmp_path, monkeypatch):
    # both converters print their errors and exit 0; the run must not pass for finished
    target = QuantizedModel(fp16_model(tmp_path / "m"), "exl3", 4.0, 6)
    target.folder.mkdir(parents=True)
    monkeypatch.setattr(
        quantize_module,
        "converter_command",
        lambda t: [sys.executable, "-c", "print(' !! Error: Must specify --work_dir')"],
    )
    with pytest.raises(RuntimeError, match="stopped without finishing .* Must specify --work_dir"):
        quantize_module._convert(target, progress=False)
    assert not target.output.exists()


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "exlnb")
    return shell


def test_the_magic_passes_its_options_and_prints_the_folder(shell, monkeypatch, capsys):
    import exlnb.quality_magics

    calls = []
    monkeypatch.setattr(
        exlnb.quality_magics, "quantize", lambda *a, **k: calls.append((a, k)) or Path("/cache/q/model")
    )
    shell.run_line_magic("exl_quantize", "/models/smol --format exl2 --bits 2.5 --head-bits 8")
    assert calls == [(("/models/smol",), dict(format="exl2", bits=2.5, head_bits=8))]
    assert capsys.readouterr().out.strip() == "/cache/q/model"


def test_the_magic_reports_a_refused_argument_in_one_line(shell, home, tmp_path):
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="bits=9.0 is out of range for EXL3"):
        shell.run_line_magic("exl_quantize", f"{fp16_model(tmp_path / 'm')} --bits 9")
