"""One entry for every benchmark suite: `python -m benchmarks SUITE [its options]`.

    python -m benchmarks core --quick      # the core suite (the default: `python -m benchmarks --quick` is the same)
    python -m benchmarks serving --help    # any suite's own options

Each suite is a module of this package with a `main(argv)`; it writes its JSON (and figures) under
benchmarks/results, named so that a second run of the same day never replaces the first's files.
"""

from __future__ import annotations

import importlib
import sys

# suite -> (module, what it measures); benchmarks/README.md says more about each
SUITES = {
    "core": ("core", "kit overhead, engine against transformers, context length, concurrency, the 7B-shaped model"),
    "serving": ("serving", "latency under load at rising request rates, and where each setup saturates"),
    "graphs": ("graphs", "eager against CUDA-graph decode, beside transformers and the ExLlamaV3 engine (CUDA)"),
    "decode-attention": ("decode_attention", "exlnb's paged attention alone at decode, per context length (CUDA)"),
    "gemv": (
        "gemv",
        "fp16 decode GEMVs of a 7B layer: separate, fused QKV and gate/up, split-K Triton, "
        "against copy bandwidth (CUDA)",
    ),
    "gemv-sweep": (
        "gemv_sweep",
        "a 7B step's o and down products and its decode attention, each way of launching them (CUDA)",
    ),
    "norm-product-sweep": (
        "norm_product_sweep",
        "a 7B layer's norms and the fused products after them at one row, each way exlnb could run them (CUDA)",
    ),
    "kit-overhead": ("kit_overhead", "what the session adds per token, the model replaced by a fixed-cost step"),
    "profile-decode": ("profile_decode", "the torch profiler over decode steps"),
    "paged-acceptance": ("paged_acceptance", "paged against unpaged answers and speed on the ExLlamaV2 engine (CUDA)"),
    "multigpu": ("multigpu", "a model split over several GPUs, and tensor parallel (several CUDA GPUs)"),
    "cache-snapshot": ("cache_snapshot", "the cache inspector's view of real pages, as JSON and HTML"),
    "server-check": ("server_check", "a server through the remote engine: streaming, n, token view, Stop, /metrics"),
    "disconnect": ("disconnect", "the disconnect notebook against each server this machine starts, in every mode"),
    "speed": ("speed", "engines against the raw libraries, transformers and the memory floor, with the issue's goals"),
    "table": ("table", "the performance table from every committed core run"),
}


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        print("suites:\n" + "\n".join(f"  {name:<18} {what}" for name, (_, what) in SUITES.items()))
        return None
    suite, rest = (argv[0], argv[1:]) if argv and not argv[0].startswith("-") else ("core", argv)
    if suite not in SUITES:
        raise SystemExit(f"python -m benchmarks: no suite {suite!r}; choose one of {', '.join(SUITES)}")
    module = importlib.import_module(f"benchmarks.{SUITES[suite][0]}")
    return module.main(rest)


if __name__ == "__main__":
    main()
