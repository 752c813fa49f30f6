"""What a model folder holds (fp16 Hugging Face weights, EXL2 or EXL3), and which engines can load it.

Read from config.json, without importing any engine: both converters write a `quantization_config`
whose `quant_method` names the format (`"exl2"`: exllamav2 0.3.2 `conversion/compile.py`; `"exl3"`:
exllamav3 1.6.5 `conversion/compile.py`). A folder without one holds unquantized Hugging Face weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from exlnb.engines.registry import engine_spec, engines_loading

MODEL_FORMATS = ("hf", "exl2", "exl3")
FORMAT_NAMES = {"hf": "unquantized Hugging Face", "exl2": "EXL2", "exl3": "EXL3"}


def model_format(folder: Path) -> str:
    """ "hf", "exl2" or "exl3"; ValueError for a folder that no exlnb engine can load, saying why."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: pass the folder that holds config.json and the weights")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}): re-download or re-convert the model") from error
    if not config.get("architectures"):
        raise ValueError(
            f"{path} names no architectures, so no engine knows which model this is; a transformers "
            'config.json lists one, e.g. "architectures": ["LlamaForCausalLM"]'
        )
    if not any(Path(folder).glob("*.safetensors")) and not any(Path(folder).glob("*.bin")):
        raise ValueError(
            f"{folder} holds no weights (*.safetensors or *.bin): pass the folder with the model's weights"
        )
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method is None:
        return "hf"
    if method in MODEL_FORMATS[1:]:
        return method
    raise ValueError(
        f"{folder} is quantized with {method!r}, which no exlnb engine loads: pass an unquantized, EXL2 or EXL3 "
        "folder, or quantize the unquantized model with exlnb.quantize.quantize"
    )


def model_bits(folder: Path) -> float | None:
    """The bits per weight an EXL2 or EXL3 folder was quantized to (its `quantization_config`'s `bits`, as both
    converters write it); None for unquantized weights."""
    config = json.loads((Path(folder) / "config.json").read_text())
    bits = (config.get("quantization_config") or {}).get("bits")
    return float(bits) if isinstance(bits, (int, float)) else None


def check_engine_can_load(engine: str, fmt: str, folder: Path) -> None:
    """Refuse, before anything is unloaded, an engine whose declaration (registry.py) does not load `fmt`."""
    if fmt not in engine_spec(engine).loads:
        able = [spec.name for spec in engines_loading(fmt)]
        instead = f'engine="{able[0]}" or ' if able else ""
        raise ValueError(
            f"the {engine} engine cannot load {FORMAT_NAMES.get(fmt, fmt)} weights ({folder}): use {instead}"
            'engine="auto"'
        )


def engine_for(fmt: str, *, cuda: bool) -> str:
    """The engine `engine="auto"` picks: the lowest `auto_rank` among the registered engines that load `fmt` and
    can run here. The built-in ranks give EXL3 to exllamav3, EXL2 and fp16 to exllamav2 (the kit's design
    default), and fp16 to the CPU engine without CUDA."""
    ranked = sorted((s for s in engines_loading(fmt) if s.auto_rank is not None), key=lambda s: s.auto_rank)
    runnable = [spec for spec in ranked if cuda or not spec.needs_cuda]
    if runnable:
        return runnable[0].name
    if not ranked:
        loaders = ", ".join(spec.name for spec in engines_loading(fmt)) or "none is registered"
        raise ValueError(
            f"no engine is chosen automatically for {FORMAT_NAMES.get(fmt, fmt)}: name one with engine= ({loaders})"
        )
    without_cuda = [spec.name for spec in engines_loading("hf") if not spec.needs_cuda]
    instead = f' with engine="{without_cuda[0]}"' if without_cuda else ""
    raise ValueError(
        f"{FORMAT_NAMES[fmt]} models run on the {ranked[0].name} engine, which needs a CUDA GPU; on this machine "
        f"load the unquantized model{instead}"
    )
