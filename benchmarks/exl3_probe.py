"""Why an EXL3 model loads on exllamav3 1.6.5 but cannot run (issue 13), measured on the GPU.

    python -m benchmarks.exl3_probe [--bits 4.0] [--out DIR]

The bundled model quantized to EXL3 (`exlnb.quantize.quantize`, cached) loads, and its first step fails inside
exllamav3 with "exl3_mgemm autotune: no compatible kernel shapes": the fused multi-matrix GEMM found no tile
shape for some bundle of projections. This probe lists every linear layer (its unpadded and padded sizes and
bits) and every fused bundle exllamav3 made at load (attention's K/V, Q/gate and sliced Q/K/V bundles, the
MLP's gate/up bundles and its graphed batch-1 path), then runs one tiny job: as loaded, and again after a fresh
load with each kind of bundle switched off, so the kind whose removal makes the model run is the culprit, and
once more with exlnb's fix (`exllamav3_compat.drop_untileable_bundles`). Loads apply only the MLP trim, so
"as loaded" is exllamav3 as shipped.
Writes exl3-probe-<device>-<date>.json (and prints a table).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.harness import device_slug, environment
from exlnb.models import BUNDLED_MODEL
from exlnb.session import one_line

CACHE_TOKENS = 2048
PROMPT = "What is the capital of France?"


def cannot_probe_here() -> str | None:
    if not torch.cuda.is_available():
        return "exl3_probe needs a CUDA GPU: this machine has no CUDA device"
    if importlib.util.find_spec("exllamav3") is None:
        return "exl3_probe needs exllamav3 1.6.5: pip install exllamav3==1.6.5"
    return None


def _no_attention_bundle(name: str) -> Callable:
    def switch_off(model) -> int:
        found = [m for m in model if getattr(m, name, None) is not None]
        for module in found:
            setattr(module, name, None)
        return len(found)

    return switch_off


def _no_gate_up_bundles(model) -> int:
    found = [m for m in model if any(b is not None for b in getattr(m, "multi_gu", None) or ())]
    for module in found:
        module.multi_gu = [None] * len(module.multi_gu)
        module.bc = None  # the graphed batch-1 path is built over the bundle at load
    return len(found)


def _exlnbs_fix(model) -> int:
    from exlnb.engines.exllamav3_compat import drop_untileable_bundles

    return sum(bool(drop_untileable_bundles(m)) for m in model if hasattr(m, "multi_kv"))


# what each variant switches off after a fresh load; "as loaded" switches off nothing
VARIANTS: dict[str, Callable | None] = {
    "as loaded": None,
    "no sliced Q/K/V bundle (multi_qkv)": _no_attention_bundle("multi_qkv"),
    "no K/V bundle (multi_kv)": _no_attention_bundle("multi_kv"),
    "no Q/gate bundle (multi_qg)": _no_attention_bundle("multi_qg"),
    "no gate/up bundles (multi_gu) and no graphed MLP": _no_gate_up_bundles,
    "exlnb's fix (drop_untileable_bundles)": _exlnbs_fix,
}


def load(folder: Path):
    import exllamav3 as exl3

    from exlnb.engines.exllamav3_compat import trim_padded_mlp_outputs

    trim_padded_mlp_outputs()
    config = exl3.Config.from_directory(str(folder))
    model = exl3.Model.from_config(config)
    cache = exl3.Cache(model, max_num_tokens=CACHE_TOKENS)
    model.load(progressbar=False, max_chunk_size=CACHE_TOKENS)
    generator = exl3.Generator(model=model, cache=cache, tokenizer=exl3.Tokenizer.from_config(config))
    return model, generator


def layers(model) -> list[dict]:
    """Every linear layer: its sizes before and after exllamav3's padding to 128, and its quantization."""
    rows = []
    for module in model:
        if not hasattr(module, "out_features_unpadded"):
            continue
        inner = getattr(module, "inner", None)
        trellis = getattr(inner, "trellis", None)
        rows.append({
            "key": module.key,
            "in": [module.in_features_unpadded, module.in_features],
            "out": [module.out_features_unpadded, module.out_features],
            "trim_padded_out": bool(getattr(module, "trim_padded_out", False)),
            "quant_type": getattr(module, "quant_type", None),
            "bits": getattr(inner, "K", None),
            "trellis_shape": list(trellis.shape) if trellis is not None else None,
        })
    return rows


def bundles(model) -> list[dict]:
    """The fused bundles exllamav3 made at load, with the sizes its mgemm kernels see."""
    rows = []
    for module in model:
        for name in ("multi_kv", "multi_qg", "multi_qkv"):
            bundle = getattr(module, name, None)
            if bundle is not None:
                rows.append({"module": module.key, "bundle": name, "in_features": bundle.in_features,
                             "out_features": getattr(bundle, "out_features", None), "width": getattr(bundle, "width", None),
                             "bits": bundle.K, "linears": [linear.key for linear in bundle.linears]})
        for index, bundle in enumerate(getattr(module, "multi_gu", None) or ()):
            if bundle is not None:
                rows.append({"module": module.key, "bundle": f"multi_gu[{index}]", "in_features": bundle.in_features,
                             "out_features": bundle.out_features, "width": None, "bits": bundle.K,
                             "linears": [linear.key for linear in bundle.linears]})
        if getattr(module, "bc", None) is not None and hasattr(module, "multi_gu"):
            rows.append({"module": module.key, "bundle": "bc (graphed batch-1 MLP)", "in_features": None,
                         "out_features": None, "width": None, "bits": None, "linears": []})
    return rows


def one_job(generator) -> dict:
    """A short greedy job through the generator: its text, or the exception that stopped it."""
    from exllamav3 import Job
    from exllamav3.generator.sampler import ArgmaxSampler

    ids = generator.tokenizer.encode(PROMPT)
    job = Job(input_ids=ids, max_new_tokens=8, sampler=ArgmaxSampler())
    pieces = []
    try:
        generator.enqueue(job)
        while generator.num_remaining_jobs():
            pieces += [r.get("text", "") for r in generator.iterate() if r.get("stage") == "streaming"]
    except Exception as error:  # noqa: BLE001 - the probe's finding
        return {"ran": False, "error": one_line(error)}
    return {"ran": True, "text": "".join(pieces)}


def run_probe(folder: Path) -> dict:
    results, first = [], None
    for name, switch_off in VARIANTS.items():
        model, generator = load(folder)
        if first is None:
            first = {"layers": layers(model), "bundles": bundles(model)}
        switched_off = switch_off(model) if switch_off else 0
        results.append({"variant": name, "modules_changed": switched_off, **one_job(generator)})
        generator.close()
        model.unload()
        del model, generator
        torch.cuda.empty_cache()
    return {**first, "variants": results}


def table(variants: list[dict]) -> str:
    lines = [f"{'variant':52} {'changed':>7}  result"]
    for v in variants:
        outcome = f"ran: {v['text']!r}" if v["ran"] else f"failed: {v['error']}"
        lines.append(f"{v['variant']:52} {v['modules_changed']:>7}  {outcome[:120]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.exl3_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=float, default=4.0, help="bits per weight of the EXL3 quantization (cached)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    reason = cannot_probe_here()
    if reason:
        parser.exit(2, reason + "\n")
    from exlnb.quantize import quantize

    folder = quantize(BUNDLED_MODEL, format="exl3", bits=args.bits, progress=False)
    env = environment()
    result = {"environment": env, "model": f"{BUNDLED_MODEL} EXL3 {args.bits:g} bpw", **run_probe(folder)}
    for row in result["bundles"]:
        print(row)
    print(table(result["variants"]))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"exl3-probe-{device_slug(env)}-{env['date'][:10]}.json"
    path.write_text(json.dumps(result, indent=2, allow_nan=False, default=str) + "\n")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
