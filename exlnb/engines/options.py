"""What can be loaded and shown, and how: the one list of each choice, used by the API, magics and scripts."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from exlnb.engines.formats import check_engine_can_load, engine_for, model_format
from exlnb.engines.registry import ENGINE_CHOICES, engine_names, engine_spec, engines_loading, engines_that

ENGINE_NAMES = ENGINE_CHOICES  # "auto" and every registered engine, read afresh (registry.py)
CACHE_DTYPES = ("fp16", "q4", "q6", "q8")
DISPLAY_MODES = ("auto", "widget", "text")
DISPLAY_HELP = "auto: a widget where the front end renders widgets, plain text otherwise (papermill, terminal)"
TOKEN_COLOURS = ("probability", "latency", "margin")  # what the token view's shades say
PAGED_MODES = {"auto": "auto", "on": True, "off": False}  # `paged=` as command lines write it
UNPAGED_ENGINES = engines_that("unpaged")  # the built-in engines that can also run unpaged; the others always page
GRAPH_MODES = ("auto", "off")  # CUDA-graph decode (the "graphs" engines): auto is on where the load check passes
SERVER_DIALECTS = ("vllm", "sglang", "tabbyapi", "llama.cpp", "transformers", "openai")  # the fields a server takes
SERVER_APIS = ("chat", "completions")  # a server's endpoint (openai engine): its chat template, or exlnb's rendering

AUTO_SPLIT = "auto"  # gpu_split: the library fills the GPUs in turn (exllamav2's autosplit, exllamav3's default)
DEFAULT_CACHE_TOKENS = 8192
DEFAULT_MAX_BATCH_SIZE = 16
PAGE_TOKENS = 256  # exllamav2's page size; the CPU engine uses the same, so grids and counts read alike


def parse_gpu_split(text: str) -> list[float] | str:
    """`--gpu-split` as typed: '20,24' -> [20.0, 24.0] (GiB per GPU); 'auto' -> 'auto' (the library fills the GPUs
    in turn)."""
    if text == AUTO_SPLIT:
        return AUTO_SPLIT
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--gpu-split {text!r}: give {AUTO_SPLIT}, or GiB per GPU separated by commas, e.g. 20,24"
        ) from None


def parse_paged(text: str) -> str | bool:
    """`--paged` as typed: auto, on or off."""
    if text not in PAGED_MODES:
        raise ValueError(f"--paged {text!r}: give {', '.join(PAGED_MODES)}")
    return PAGED_MODES[text]


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
    gpu_split: tuple[float, ...] | str | None  # GiB per GPU, or AUTO_SPLIT
    paged: str | bool
    graphs: str = "auto"
    tensor_parallel: bool = False
    tp_backend: str | None = None  # tensor parallelism's all-reduce, one of the engine's; None: its library's own
    url: str | None = None  # an OpenAI-compatible server's API base (openai engine); model_dir then gives the tokenizer
    api_key_env: str | None = None  # the environment variable holding the server's API key
    api: str = "chat"  # one of SERVER_APIS
    served_model: str | None = None  # the server's name for the model; None: the one it serves
    dialect: str | None = None  # one of SERVER_DIALECTS; None: read from the server's /v1/models

    def split_gib(self) -> list[float] | None:
        """GiB per GPU as the libraries take it; None lets the library fill the GPUs in turn."""
        return None if self.gpu_split in (None, AUTO_SPLIT) else list(self.gpu_split)

    @classmethod
    def resolve(
        cls,
        *,
        engine: str,
        model_dir: Path,
        cache_tokens: int | None,
        cache_dtype: str,
        max_batch_size: int | None,
        gpu_split: Sequence[float] | str | None,
        paged: str | bool,
        graphs: str = "auto",
        tensor_parallel: bool = False,
        tp_backend: str | None = None,
        url: str | None = None,
        api_key_env: str | None = None,
        api: str = "chat",
        served_model: str | None = None,
        dialect: str | None = None,
    ) -> EngineOptions:
        """The options an engine is built with, once every check that needs nothing loaded has passed: the values
        themselves, the engine (`engine_for`'s choice for "auto") and what it can do with the folder's format."""
        check_values(
            cache_tokens=cache_tokens,
            cache_dtype=cache_dtype,
            max_batch_size=max_batch_size,
            paged=paged,
            graphs=graphs,
            url=url,
            api_key_env=api_key_env,
            api=api,
            dialect=dialect,
        )
        engine, fmt = choose_engine(engine, Path(model_dir), url)
        check_engine_offers(
            engine,
            fmt,
            Path(model_dir),
            cache_dtype=cache_dtype,
            paged=paged,
            gpu_split=gpu_split,
            tensor_parallel=tensor_parallel,
            tp_backend=tp_backend,
        )
        return cls(
            engine=engine,
            model_dir=Path(model_dir).resolve(),
            cache_tokens=cache_tokens or DEFAULT_CACHE_TOKENS,
            cache_dtype=cache_dtype,
            max_batch_size=max_batch_size or DEFAULT_MAX_BATCH_SIZE,
            gpu_split=AUTO_SPLIT if gpu_split == AUTO_SPLIT else tuple(gpu_split) if gpu_split else None,
            paged=paged,
            graphs=graphs,
            tensor_parallel=bool(tensor_parallel),
            tp_backend=tp_backend,
            url=url,
            api_key_env=api_key_env,
            api=api,
            served_model=served_model,
            dialect=dialect,
        )


def check_values(
    *,
    cache_tokens: int | None,
    cache_dtype: str,
    max_batch_size: int | None,
    paged: str | bool,
    graphs: str,
    url: str | None,
    api_key_env: str | None,
    api: str,
    dialect: str | None = None,
) -> None:
    """Refuse a value no engine takes: a choice outside its list, a count too small, a server's url that cannot be
    one (`check_server_url`)."""
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"unknown cache type {cache_dtype!r}: choose one of {', '.join(CACHE_DTYPES)}")
    if api not in SERVER_APIS:
        raise ValueError(f"api={api!r}: choose one of {', '.join(SERVER_APIS)}")
    if dialect is not None and dialect not in SERVER_DIALECTS:
        raise ValueError(f"dialect={dialect!r}: choose one of {', '.join(SERVER_DIALECTS)}")
    if dialect is not None and url is None:
        raise ValueError("dialect= names a server's kind: give the server's url too")
    if url is not None:
        check_server_url(url, api_key_env)
    if cache_tokens is not None and cache_tokens < PAGE_TOKENS:
        raise ValueError(f"cache_tokens={cache_tokens} is too small: give at least {PAGE_TOKENS} (one page)")
    if max_batch_size is not None and max_batch_size < 1:
        raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
    if paged not in PAGED_MODES.values():
        raise ValueError(f'paged={paged!r} is not one of "auto", True, False')
    if graphs not in GRAPH_MODES:
        raise ValueError(f"graphs={graphs!r}: choose one of {', '.join(GRAPH_MODES)}")


def choose_engine(engine: str, model_dir: Path, url: str | None) -> tuple[str, str]:
    """The engine to load and the format it loads: a server by its url ("url"), else the folder's format; "auto"
    picks by that format and whether CUDA is here. An unknown engine, or a url given to an engine that loads
    folders (or none to one that loads a url), is refused."""
    if engine != "auto" and ("url" in engine_spec(engine).loads) != bool(url):  # an unknown name fails here
        raise ValueError(
            f'the {engine} engine talks to a server: give its url, e.g. url="http://127.0.0.1:8000/v1"'
            if url is None
            else f'url={url!r} is for a server: load it with engine="auto" or '
            f"{' or '.join(s.name for s in engines_loading('url'))}, not the {engine} engine"
        )
    # a server is loaded by its url; the local folder only lends its tokenizer and chat template
    fmt = "url" if url else model_format(model_dir)
    if engine == "auto":
        engine = engine_for(fmt, cuda=cuda_available())
    check_engine_can_load(engine, fmt, model_dir)
    return engine, fmt


def check_engine_offers(
    engine: str,
    fmt: str,
    model_dir: Path,
    *,
    cache_dtype: str,
    paged: str | bool,
    gpu_split: Sequence[float] | str | None,
    tensor_parallel: bool,
    tp_backend: str | None = None,
) -> None:
    """Refuse what the engine's declaration does not offer: a quantized cache, an unpaged one, a split over GPUs
    (or one the machine's GPUs cannot hold), tensor parallelism over weights its library cannot split, or with an
    all-reduce it does not have."""
    if cache_dtype != "fp16" and not engine_spec(engine).can("quantized_cache"):
        raise ValueError(
            f"the {engine} engine keeps its cache in full precision; --cache {cache_dtype} needs "
            f"{' or '.join(engines_that('quantized_cache'))}"
        )
    if paged is False and not engine_spec(engine).can("unpaged"):
        raise ValueError(f"the {engine} engine always pages: paged=False needs {' or '.join(engines_that('unpaged'))}")
    if gpu_split or tensor_parallel:
        check_gpu_split(engine, gpu_split, tensor_parallel, cuda_device_memory())
    if tensor_parallel:
        check_tensor_parallel_format(engine, fmt, model_dir)
    if tp_backend is not None:
        check_tp_backend(engine, tp_backend, tensor_parallel)


def check_tp_backend(engine: str, tp_backend: str, tensor_parallel: bool) -> None:
    backends = engine_spec(engine).tensor_parallel_backends
    if not backends:
        able = [s.name for s in engines_with_tp_backends()]
        raise ValueError(f"the {engine} engine has no choice of all-reduce: tp_backend needs {' or '.join(able)}")
    if tp_backend not in backends:
        raise ValueError(f"tp_backend={tp_backend!r}: the {engine} engine's are {', '.join(backends)}")
    if not tensor_parallel:
        raise ValueError(f"tp_backend={tp_backend!r} is for tensor parallelism: add tensor_parallel=True")


def engines_with_tp_backends() -> list:
    return [engine_spec(name) for name in engine_names() if engine_spec(name).tensor_parallel_backends]


def tp_backend_choices() -> str:
    """Each engine's all-reduces for tensor parallelism, as help text says them ("exllamav3: native, nccl")."""
    return "; ".join(f"{s.name}: {', '.join(s.tensor_parallel_backends)}" for s in engines_with_tp_backends())


def check_engine_runs_here(engine: str) -> None:
    """Refuse, before anything is unloaded, an engine this machine cannot run: one that needs a CUDA GPU where
    there is none, one whose library is not installed."""
    spec = engine_spec(engine)
    if spec.needs_cuda and not cuda_available():
        able = [s.name for s in engines_loading("hf") if not s.needs_cuda]
        instead = f' (engine="{able[0]}" runs unquantized models here)' if able else ""
        raise ValueError(f"the {engine} engine needs a CUDA GPU, and this machine has none{instead}")
    if spec.library and importlib.util.find_spec(spec.library) is None:
        raise ValueError(
            f"the {engine} engine runs on {spec.library}, which is not installed here: install it "
            f"(pip install {spec.library}) or load another engine"
        )


def check_server_url(url: str, api_key_env: str | None) -> None:
    """Refuse a server address that cannot be an API base, or that carries a key, before anything is unloaded.

    A key in the url (`http://user:KEY@host`, `?key=...`) was printed in the status line, every error and every
    result; exlnb sends a key only as a bearer header, read from the environment variable `api_key_env` names.
    No message here repeats a url that may hold one.
    """
    carries = isinstance(url, str) and any(mark in url for mark in "@?#")
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        given = "the url (not repeated here: it holds @, ? or #)" if carries else f"url={url!r}"
        raise ValueError(f"{given} is not an http(s) address: give the API's base, e.g. http://127.0.0.1:8000/v1")
    if carries:
        raise ValueError(
            f"the url of {shown_url(url)} carries credentials or a query (user:key@ or ?key=..., not repeated here): "
            "exlnb sends a key only from the environment variable that --api-key-env (api_key_env=) names; "
            "give the API's base alone"
        )
    if api_key_env is not None and not os.environ.get(api_key_env):
        raise ValueError(f"api_key_env={api_key_env!r}: that environment variable is not set (or empty)")


def shown_url(url: str) -> str:
    """`url` as exlnb ever shows it: scheme, host, port and path, without user, password, query or fragment."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 address keeps its brackets
        host = f"[{host}]"
    try:
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:  # a port that is not a number is shown as no port
        port = ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


# bytes per cached key or value element, by precision (exllamav2's quantized caches keep scales besides)
_CACHE_ELEMENT_BYTES = {"fp32": 4.0, "fp16": 2.0, "q8": 1.0, "q6": 0.75, "q4": 0.5}


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
    """Refuse a cache larger than the device's whole memory before anything is unloaded or allocated, sized as the
    engine's declaration says it keeps its cache (`kv_cache`)."""
    sizing = engine_spec(options.engine).kv_cache
    if sizing == "elsewhere":
        return  # a server's cache is on the server
    element = _CACHE_ELEMENT_BYTES[options.cache_dtype if sizing == "as_asked" else sizing]
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
    if not engine_spec(engine).needs_cuda:
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this machine"
        except (ValueError, OSError, AttributeError):
            return None, "this machine"
    import torch

    devices = cuda_device_memory()
    return (devices[0], torch.cuda.get_device_name(0)) if devices else (None, "the GPU")


def check_gpu_split(
    engine: str, gpu_split: Sequence[float] | str | None, tensor_parallel: bool, devices: Sequence[int]
) -> None:
    """Refuse a split or tensor parallelism that cannot load, before anything is unloaded: the wrong engine,
    values that are not GiB, more GPUs than `devices` (each one's total memory in bytes), a GPU given more
    than it has, tensor parallelism over fewer than two GPUs. A 0 leaves that GPU out, as both libraries read it."""
    asked = "--tensor-parallel" if tensor_parallel and not gpu_split else "--gpu-split"
    capability = "tensor_parallel" if tensor_parallel else "gpu_split"
    if not engine_spec(engine).can(capability):
        raise ValueError(
            f"the {engine} engine runs on one device; {asked} needs {' or '.join(engines_that(capability))}"
        )
    split = [] if gpu_split == AUTO_SPLIT else list(gpu_split or ())
    if any(not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 for v in split) or (
        split and not any(split)
    ):
        raise ValueError(
            f"gpu_split={tuple(split)}: give GiB per GPU, each 0 or more (0 leaves a GPU out), at least one above 0"
        )
    if not devices:
        raise ValueError(f"{asked} needs CUDA GPUs, and this machine has none")
    if len(split) > len(devices):
        raise ValueError(
            f"gpu_split={tuple(split)} names {len(split)} GPUs; this machine has {len(devices)} ({_gpu_list(devices)})"
        )
    for index, (gib, total) in enumerate(zip(split, devices)):
        if gib * 2**30 > total:
            raise ValueError(f"gpu_split gives cuda:{index} {gib:g} GiB; it has {total / 2**30:.1f} GiB")
    used = sum(1 for v in split if v > 0) if split else len(devices)
    if tensor_parallel and used < 2:
        where = f"gpu_split={tuple(split)} uses one" if split else f"this machine has one ({_gpu_list(devices)})"
        raise ValueError(f"tensor_parallel needs at least two GPUs: {where}")


def check_tensor_parallel_format(engine: str, fmt: str, model_dir: Path) -> None:
    """Refuse tensor parallelism over weights the engine's library cannot split (its declaration's
    `tensor_parallel_loads`), before anything is unloaded."""
    spec = engine_spec(engine)
    if not spec.splits(fmt):
        formats = " or ".join(spec.tensor_parallel_loads or spec.loads).upper()
        able = [s.name for s in engines_loading(fmt) if s.splits(fmt)]
        instead = f", or the {' or '.join(able)} engine" if able else ""
        raise ValueError(
            f"the {engine} engine splits only {formats} weights with tensor parallelism; "
            f"{model_dir.name} is {fmt.upper()}: use --gpu-split for a layer split{instead}"
        )


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
