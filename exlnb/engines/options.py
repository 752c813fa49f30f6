"""What can be loaded and shown, and how: the one list of each choice, used by the API, magics and scripts."""

from __future__ import annotations

import json
import os
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from exlnb.engines.formats import check_engine_can_load, engine_for, model_format

ENGINE_NAMES = ("auto", "exllamav2", "exllamav3", "cpu")
CACHE_DTYPES = ("fp16", "q4", "q6", "q8")
DISPLAY_MODES = ("auto", "widget", "text")
DISPLAY_HELP = "auto: a widget where the front end renders widgets, plain text otherwise (papermill, terminal)"
TOKEN_COLOURS = ("probability", "latency")  # what the token view's shades say
PAGED_MODES = {"auto": "auto", "on": True, "off": False}  # `paged=` as command lines write it
UNPAGED_ENGINES = ("exllamav2",)  # engines that can also run unpaged; the others always page
GRAPH_MODES = ("auto", "off")  # CUDA-graph decode (ExLlamaV2 engine): auto is on where its load check passes
SPLIT_ENGINES = ("exllamav2", "exllamav3")  # engines that can spread a model over several GPUs

DEFAULT_CACHE_TOKENS = 8192
DEFAULT_MAX_BATCH_SIZE = 16
PAGE_TOKENS = 256  # exllamav2's page size; the CPU engine uses the same, so grids and counts read alike


def check_display(display: str) -> str:
    if display not in DISPLAY_MODES:
        raise ValueError(f"display={display!r}: choose one of {', '.join(DISPLAY_MODES)}")
    return display


@dataclass(frozen=True)
class EngineOptions:
    """Everything that decides what gets loaded; equal options mean `load()` has nothing to do."""

    engine: str
    model_dir: Path
    cache_tokens: int
    cache_dtype: str
    max_batch_size: int
    gpu_split: tuple[float, ...] | None
    paged: str | bool
    graphs: str = "auto"
    tensor_parallel: bool = False

    @classmethod
    def resolve(
        cls,
        *,
        engine: str,
        model_dir: Path,
        cache_tokens: int | None,
        cache_dtype: str,
        max_batch_size: int | None,
        gpu_split: Sequence[float] | None,
        paged: str | bool,
        graphs: str = "auto",
        tensor_parallel: bool = False,
    ) -> EngineOptions:
        if engine not in ENGINE_NAMES:
            raise ValueError(f"unknown engine {engine!r}: choose one of {', '.join(ENGINE_NAMES)}")
        if cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"unknown cache type {cache_dtype!r}: choose one of {', '.join(CACHE_DTYPES)}")
        fmt = model_format(model_dir)
        if engine == "auto":
            engine = engine_for(fmt, cuda=cuda_available())
        check_engine_can_load(engine, fmt, model_dir)
        if engine == "cpu" and cache_dtype != "fp16":
            raise ValueError(
                f"the CPU engine keeps its cache in full precision; --cache {cache_dtype} needs exllamav2 or exllamav3"
            )
        if cache_tokens is not None and cache_tokens < PAGE_TOKENS:
            raise ValueError(f"cache_tokens={cache_tokens} is too small: give at least {PAGE_TOKENS} (one page)")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
        if paged not in PAGED_MODES.values():
            raise ValueError(f'paged={paged!r} is not one of "auto", True, False')
        if graphs not in GRAPH_MODES:
            raise ValueError(f"graphs={graphs!r}: choose one of {', '.join(GRAPH_MODES)}")
        if gpu_split or tensor_parallel:
            check_gpu_split(engine, gpu_split, tensor_parallel, cuda_device_memory())
        return cls(
            engine=engine,
            model_dir=Path(model_dir).resolve(),
            cache_tokens=cache_tokens or DEFAULT_CACHE_TOKENS,
            cache_dtype=cache_dtype,
            max_batch_size=max_batch_size or DEFAULT_MAX_BATCH_SIZE,
            gpu_split=tuple(gpu_split) if gpu_split else None,
            paged=paged,
            graphs=graphs,
            tensor_parallel=bool(tensor_parallel),
        )


# bytes per cached key or value element, by cache type (exllamav2's quantized caches keep scales besides)
_CACHE_ELEMENT_BYTES = {"fp16": 2.0, "q8": 1.0, "q6": 0.75, "q4": 0.5}


def kv_cache_bytes(model_dir: Path, cache_tokens: int, element_bytes: float) -> int:
    """Keys and values for `cache_tokens` positions of the model in `model_dir` (from its config.json)."""
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    layers = text["num_hidden_layers"]
    heads = text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    return int(2 * layers * kv_heads * head_dim * cache_tokens * element_bytes)


def check_cache_fits(options: EngineOptions) -> None:
    """Refuse a cache larger than the device's whole memory before anything is unloaded or allocated."""
    element = 4.0 if options.engine == "cpu" else _CACHE_ELEMENT_BYTES[options.cache_dtype]
    try:
        needed = kv_cache_bytes(options.model_dir, options.cache_tokens, element)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return  # a config without the usual fields: the engine's own loader decides
    total, where = device_memory_bytes(options.engine)
    if total and needed > total:
        raise ValueError(
            f"cache_tokens={options.cache_tokens} needs {needed / 2**30:,.1f} GiB for keys and values, more than "
            f"the {total / 2**30:,.1f} GiB {where} has: choose a smaller cache_tokens (default {DEFAULT_CACHE_TOKENS})"
        )


def device_memory_bytes(engine: str) -> tuple[int | None, str]:
    """The whole memory of the device an engine runs on, and what to call it."""
    if engine == "cpu":
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this machine"
        except (ValueError, OSError, AttributeError):
            return None, "this machine"
    import torch

    devices = cuda_device_memory()
    return (devices[0], torch.cuda.get_device_name(0)) if devices else (None, "the GPU")


def check_gpu_split(
    engine: str, gpu_split: Sequence[float] | None, tensor_parallel: bool, devices: Sequence[int]
) -> None:
    """Refuse a split or tensor parallelism that cannot load, before anything is unloaded: the wrong engine,
    values that are not GiB, more GPUs than `devices` (each one's total memory in bytes), a GPU given more
    than it has, tensor parallelism over fewer than two GPUs. A 0 leaves that GPU out, as both libraries read it."""
    asked = "--tensor-parallel" if tensor_parallel and not gpu_split else "--gpu-split"
    if engine not in SPLIT_ENGINES:
        raise ValueError(f"the {engine} engine runs on one device; {asked} needs {' or '.join(SPLIT_ENGINES)}")
    split = list(gpu_split or ())
    if any(not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 for v in split) or (
        split and not any(split)
    ):
        raise ValueError(f"gpu_split={tuple(split)}: give GiB per GPU, each 0 or more (0 leaves a GPU out), "
                         "at least one above 0")
    if not devices:
        raise ValueError(f"{asked} needs CUDA GPUs, and this machine has none")
    if len(split) > len(devices):
        raise ValueError(f"gpu_split={tuple(split)} names {len(split)} GPUs; this machine has {len(devices)} "
                         f"({_gpu_list(devices)})")
    for index, (gib, total) in enumerate(zip(split, devices)):
        if gib * 2**30 > total:
            raise ValueError(f"gpu_split gives cuda:{index} {gib:g} GiB; it has {total / 2**30:.1f} GiB")
    used = sum(1 for v in split if v > 0) if split else len(devices)
    if tensor_parallel and used < 2:
        where = f"gpu_split={tuple(split)} uses one" if split else f"this machine has one ({_gpu_list(devices)})"
        raise ValueError(f"tensor_parallel needs at least two GPUs: {where}")


def _gpu_list(devices: Sequence[int]) -> str:
    return ", ".join(f"cuda:{i} {total / 2**30:.1f} GiB" for i, total in enumerate(devices))


def cuda_device_memory() -> list[int]:
    """Each CUDA device's total memory in bytes; empty without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
