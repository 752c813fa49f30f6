"""What a model folder holds (fp16 Hugging Face weights, EXL2 or EXL3), and which engines can load it.

Read from config.json, without importing any engine: both converters write a `quantization_config`
whose `quant_method` names the format (`"exl2"`: exllamav2 0.3.2 `conversion/compile.py`; `"exl3"`:
exllamav3 1.6.5 `conversion/compile.py`). A folder without one holds unquantized Hugging Face weights.
"""

from __future__ import annotations

import json
from pathlib import Path

MODEL_FORMATS = ("hf", "exl2", "exl3")

# engine -> the formats it loads; exllamav3 loads unquantized weights too, exllamav2 cannot read EXL3
ENGINE_FORMATS = {
    "exllamav2": ("hf", "exl2"),
    "exllamav3": ("hf", "exl3"),
    "cpu": ("hf",),
}
FORMAT_NAMES = {"hf": "unquantized Hugging Face", "exl2": "EXL2", "exl3": "EXL3"}


def model_format(folder: Path) -> str:
    """"hf", "exl2" or "exl3"; ValueError for a folder that no exlnb engine can load, saying why."""
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
        raise ValueError(f"{folder} holds no weights (*.safetensors or *.bin): pass the folder with the model's weights")
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method is None:
        return "hf"
    if method in MODEL_FORMATS[1:]:
        return method
    raise ValueError(
        f"{folder} is quantized with {method!r}, which no exlnb engine loads: pass an unquantized, EXL2 or EXL3 "
        "folder, or quantize the unquantized model with exlnb.quantize.quantize"
    )


def check_engine_can_load(engine: str, fmt: str, folder: Path) -> None:
    if fmt not in ENGINE_FORMATS[engine]:
        able = [name for name, formats in ENGINE_FORMATS.items() if fmt in formats]
        raise ValueError(
            f"the {engine} engine cannot load {FORMAT_NAMES[fmt]} weights ({folder}): use engine=\"{able[0]}\" "
            'or engine="auto"'
        )


def engine_for(fmt: str, *, cuda: bool) -> str:
    """The engine `engine="auto"` picks: EXL3 on exllamav3, EXL2 and fp16 on exllamav2 (the kit's design
    default), fp16 on the CPU engine without CUDA."""
    if fmt == "hf":
        return "exllamav2" if cuda else "cpu"
    engine = "exllamav3" if fmt == "exl3" else "exllamav2"
    if not cuda:
        raise ValueError(
            f"{FORMAT_NAMES[fmt]} models run on the {engine} engine, which needs a CUDA GPU; on this machine "
            "load the unquantized model with the CPU engine"
        )
    return engine
