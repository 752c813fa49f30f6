"""Every engine, declared once: its name, its library, the model formats it loads, what it can do, how its cache is
sized, where its results are published and where its class lives.

`engine="auto"`, the load's checks and errors, `%exl_load --engine`'s choices, docs/engines.md's table, the
versions every result records (experiments' and benchmarks' alike) and `report --publish`'s folders all read this
table, so adding an engine is its class and one `register_engine` call (at the end of this module for a built-in;
docs/architecture.md, "A new engine"). The class is named by a string and imported only when the engine is
chosen: exllamav2 and exllamav3 build their CUDA extensions on import (minutes the first time).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# what an engine can do -> what it means, in a line (the engines table's key)
CAPABILITIES = {
    "paged": "keeps its KV cache in pages that jobs share (prefix reuse)",
    "unpaged": "can also run on one contiguous cache (`paged=False`)",
    "page_map": "shows which job holds which cache page (`%exl_cache`)",
    "quantized_cache": "keeps keys and values quantized (`cache_dtype` q4, q6, q8)",
    "dry": "DRY repetition penalty (`dry_multiplier`)",
    "xtc": "XTC, exclude top choices (`xtc_probability`)",
    "sampler_all": "every `SamplerSettings` field, in exllamav2's order",
    "constraints": "JSON schema and regex constraints (`json_schema`, `regex`)",
    "token_view": "each token's probability and alternatives (`--tokens`)",
    "loop_guard": "its own loop detector serves `--loop-guard`",
    "graphs": "decode steps replayed from CUDA graphs (`graphs`)",
    "gpu_split": "a model spread over several GPUs (`gpu_split`)",
    "tensor_parallel": "every layer split over several GPUs (`tensor_parallel`)",
    "prompt_passes": "lends field report 5's prompt passes (`lend_prompt_pass`)",
    "separate_generators": "reproduces field report 2's generator per request (`run_with_separate_generators`)",
    "server_metrics": "reports the serving server's own metrics",
    "scoring": "the logits of every position of a token sequence (`Engine.score`, `exlnb.divergence`)",
}


# how an engine's KV cache is sized in memory, for the check that it fits the device before anything is loaded
KV_CACHE_SIZING = {
    "as_asked": "in the precision `cache_dtype` asks for",
    "fp32": "in fp32, whatever `cache_dtype` asks",
    "elsewhere": "not here: on the server the engine talks to",
}


@dataclass(frozen=True)
class EngineSpec:
    """One engine's declaration. `loads` holds model formats (formats.py's "hf", "exl2", "exl3") or "url" for an
    engine that talks to a server; `auto_rank` orders the engines `engine="auto"` tries for a folder's format
    (lowest first; None: never chosen by auto)."""

    name: str
    summary: str
    loads: tuple[str, ...]
    capabilities: frozenset[str]
    engine_class: str  # "package.module:Class", called with (options, progress=progress)
    needs_cuda: bool = False
    auto_rank: int | None = None
    # the Python package the engine drives: its version is in every result's record, and a load is refused where
    # it is not installed (None: exlnb's own code over the kit's dependencies)
    library: str | None = None
    # the formats tensor parallelism can split, where not every format the engine loads (None: all it loads)
    tensor_parallel_loads: tuple[str, ...] | None = None
    # the ways its tensor parallelism can all-reduce, its library's default first (empty: no choice to make)
    tensor_parallel_backends: tuple[str, ...] = ()
    kv_cache: str = "as_asked"  # a key of KV_CACHE_SIZING
    results_folder: str | None = None  # `report --publish` writes to data/results/<this>/ (None: the engine's name)

    def __post_init__(self) -> None:
        unknown = sorted(self.capabilities - CAPABILITIES.keys())
        if unknown:
            raise ValueError(
                f"engine {self.name!r} declares unknown capabilities {', '.join(unknown)}: "
                f"choose from {', '.join(CAPABILITIES)}"
            )
        if ":" not in self.engine_class:
            raise ValueError(f"engine_class={self.engine_class!r}: write it as 'package.module:Class'")
        if self.kv_cache not in KV_CACHE_SIZING:
            raise ValueError(f"kv_cache={self.kv_cache!r}: choose one of {', '.join(KV_CACHE_SIZING)}")

    @property
    def published_under(self) -> str:
        """The folder under data/results/ that `report --publish` copies this engine's results to."""
        return self.results_folder or self.name

    def splits(self, fmt: str) -> bool:
        """Whether tensor parallelism can split weights of format `fmt` on this engine."""
        return self.can("tensor_parallel") and fmt in (self.tensor_parallel_loads or self.loads)

    def can(self, capability: str) -> bool:
        if capability not in CAPABILITIES:
            raise ValueError(f"unknown capability {capability!r}: choose one of {', '.join(CAPABILITIES)}")
        return capability in self.capabilities


_ENGINES: dict[str, EngineSpec] = {}


def register_engine(spec: EngineSpec) -> None:
    """Add an engine (a plugin's, a test's); registering a name again replaces its declaration in place."""
    _ENGINES[spec.name] = spec


def unregister_engine(name: str) -> None:
    """Remove an engine registered for a while (a test's); ValueError for a name not registered."""
    engine_spec(name)
    del _ENGINES[name]


def engine_names() -> tuple[str, ...]:
    """The registered engines, in registration order."""
    return tuple(_ENGINES)


def engine_spec(name: str) -> EngineSpec:
    if name not in _ENGINES:
        raise ValueError(f"unknown engine {name!r}: choose one of {', '.join(ENGINE_CHOICES)}")
    return _ENGINES[name]


def engines_that(capability: str) -> tuple[str, ...]:
    """The registered engines with `capability`, for an error that names who can do what was asked."""
    return tuple(name for name, spec in _ENGINES.items() if spec.can(capability))


def engines_loading(fmt: str) -> tuple[EngineSpec, ...]:
    """The engines that load `fmt`, in registration order."""
    return tuple(spec for spec in _ENGINES.values() if fmt in spec.loads)


def engine_libraries() -> tuple[str, ...]:
    """The libraries the registered engines drive, in registration order: the packages whose versions every
    result records beside the kit's own."""
    return tuple(dict.fromkeys(spec.library for spec in _ENGINES.values() if spec.library))


class EngineChoices(Sequence[str]):
    """ "auto" and every registered engine, read afresh on each use: argparse's `choices` and help text and the
    API's checks hold this one object, so an engine registered after import is a valid choice everywhere."""

    def _names(self) -> tuple[str, ...]:
        return ("auto", *_ENGINES)

    def __getitem__(self, index):
        return self._names()[index]

    def __len__(self) -> int:
        return len(_ENGINES) + 1

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name == "auto" or name in _ENGINES

    def __repr__(self) -> str:
        return repr(self._names())


ENGINE_CHOICES = EngineChoices()


def engines_table() -> str:
    """The registered engines and what each capability means, as Markdown: docs/engines.md holds this text
    (a test compares them; `write_engines_doc()` writes it there)."""
    rows = [
        "| Engine | Library | Loads | Needs CUDA | `auto` order | Can | Cache | Results | What it is |",
        "|---|---|---|---|---|---|---|---|---|",
        *(
            f"| `{s.name}` | {s.library or 'exlnb'} | {_loads(s)} | {'yes' if s.needs_cuda else 'no'} | "
            f"{'never' if s.auto_rank is None else s.auto_rank} | "
            f"{', '.join(f'`{c}`' for c in CAPABILITIES if c in s.capabilities)} | {s.kv_cache} | "
            f"data/results/{s.published_under}/ | {s.summary} |"
            for s in _ENGINES.values()
        ),
        "",
        "| Capability | Means |",
        "|---|---|",
        *(f"| `{name}` | {meaning} |" for name, meaning in CAPABILITIES.items()),
        "",
        "| Cache | Sized |",
        "|---|---|",
        *(f"| {name} | {meaning} |" for name, meaning in KV_CACHE_SIZING.items()),
    ]
    return "\n".join(rows) + "\n"


def _loads(spec: EngineSpec) -> str:
    """The formats an engine loads, and those tensor parallelism can split where that is fewer."""
    split = f" (tensor parallel: {', '.join(spec.tensor_parallel_loads)})" if spec.tensor_parallel_loads else ""
    return ", ".join(spec.loads) + split


# The built-in engines. Their capabilities are what each engine's code does: exllamav3 refuses, by name, the
# sampler settings it has no step for (exllamav3/sampler.py, refused_settings) and exllamav3 1.6.5 refuses a second
# generator over one cache (SeparateGeneratorsRefused), so both stay off its list.
register_engine(
    EngineSpec(
        name="exllamav2",
        summary="ExLlamaV2's dynamic generator on CUDA: EXL2 and unquantized models, paged or not, CUDA-graph decode",
        loads=("hf", "exl2"),
        capabilities=frozenset(
            {
                "paged",
                "unpaged",
                "page_map",
                "quantized_cache",
                "dry",
                "xtc",
                "sampler_all",
                "constraints",
                "token_view",
                "graphs",
                "gpu_split",
                "tensor_parallel",
                "prompt_passes",
                "separate_generators",
                "scoring",
            }
        ),
        engine_class="exlnb.engines.exllamav2.engine:ExLlamaV2Engine",
        needs_cuda=True,
        auto_rank=1,
        library="exllamav2",
        # exllamav2 0.3.2's load_tp splits quantized tensors only: an fp16 7B-shaped model failed on four H100s with
        # "Can only split quantized tensor."
        tensor_parallel_loads=("exl2",),
        results_folder="gpu",  # the kit's first GPU engine: its results were published there before there were others
    )
)
register_engine(
    EngineSpec(
        name="exllamav3",
        summary="ExLlamaV3's generator on CUDA: EXL3 and unquantized models, its own sampler steps and loop detector, "
        "CUDA-graph decode",
        loads=("hf", "exl3"),
        capabilities=frozenset(
            {
                "paged",
                "page_map",
                "quantized_cache",
                "dry",
                "xtc",
                "constraints",
                "token_view",
                "loop_guard",
                "graphs",
                "gpu_split",
                "tensor_parallel",
                "scoring",
            }
        ),
        engine_class="exlnb.engines.exllamav3.engine:ExLlamaV3Engine",
        # exllamav3 1.6.5's `Model.load(tp_backend=...)`: its own shared-memory all-reduce through the host, or NCCL
        tensor_parallel_backends=("native", "nccl"),
        needs_cuda=True,
        auto_rank=2,
        library="exllamav3",
    )
)
register_engine(
    EngineSpec(
        name="cpu",
        summary="exlnb's own engine in PyTorch on the CPU: unquantized models, a paged cache, "
        "exllamav2's whole sampler",
        loads=("hf",),
        capabilities=frozenset(
            {
                "paged",
                "page_map",
                "dry",
                "xtc",
                "sampler_all",
                "constraints",
                "token_view",
                "separate_generators",
                "scoring",
            }
        ),
        engine_class="exlnb.engines.cpu:CpuEngine",
        auto_rank=3,
        kv_cache="fp32",
    )
)
register_engine(
    EngineSpec(
        name="openai",
        summary="an OpenAI-compatible server (TabbyAPI, vLLM, SGLang, llama.cpp) by its url: streams, "
        "cancels by disconnecting",
        loads=("url",),
        capabilities=frozenset({"token_view", "server_metrics"}),
        engine_class="exlnb.engines.remote.engine:RemoteEngine",
        auto_rank=1,
        library="httpx",
        kv_cache="elsewhere",
    )
)


TABLE_START = "<!-- engines table: written by exlnb.engines.registry.write_engines_doc() -->"
TABLE_END = "<!-- end of engines table -->"


ENGINES_DOC = Path(__file__).resolve().parents[2] / "docs" / "engines.md"


def write_engines_doc(doc: Path = ENGINES_DOC) -> None:
    """Put `engines_table()` between docs/engines.md's markers, after an engine's declaration changed."""
    text = doc.read_text()
    start, end = text.index(TABLE_START) + len(TABLE_START), text.index(TABLE_END)
    doc.write_text(f"{text[:start]}\n{engines_table()}{text[end:]}")
