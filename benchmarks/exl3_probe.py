"""Why an EXL3 model loads on exllamav3 1.6.5 but cannot run (issue 13), measured on the GPU.

    python -m benchmarks.exl3_probe [--bits 4.0] [--out DIR]

The bundled model quantized to EXL3 (`exlnb.quantize.quantize`, cached) loads, and its first step fails inside
exllamav3 with "exl3_mgemm autotune: no compatible kernel shapes": the fused multi-matrix GEMM found no tile
shape for some bundle of projections. This probe lists every linear layer (its unpadded and padded sizes and
bits) and every fused bundle exllamav3 made at load (attention's K/V, Q/gate and sliced Q/K/V bundles, the
MLP's gate/up bundles and its graphed batch-1 path), then runs one tiny job: as loaded, and again after a fresh
load with each kind of bundle switched off, so the kind whose removal makes the model run is the culprit, and
once more with exlnb's fix (`exllamav3_compat`), and last through exlnb's engine. Loads apply only the MLP trim, so
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
from exlnb.templates.formats import chatml

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


def _no_graphed_mlp(model) -> int:
    found = [m for m in model if getattr(m, "bc", None) is not None and hasattr(m, "multi_gu")]
    for module in found:
        module.bc = None
    return len(found)


def _exlnbs_fix(model) -> int:
    from exlnb.engines.exllamav3_compat import drop_unpadded_mlp_paths, drop_untileable_bundles

    return (sum(bool(drop_untileable_bundles(m)) for m in model if hasattr(m, "multi_kv")) +
            sum(bool(drop_unpadded_mlp_paths(m)) for m in model if hasattr(m, "multi_gu")))


# what each variant switches off after a fresh load; "as loaded" switches off nothing
VARIANTS: dict[str, Callable | None] = {
    "as loaded": None,
    "no sliced Q/K/V bundle (multi_qkv)": _no_attention_bundle("multi_qkv"),
    "no K/V bundle (multi_kv)": _no_attention_bundle("multi_kv"),
    "no Q/gate bundle (multi_qg)": _no_attention_bundle("multi_qg"),
    "no graphed batch-1 MLP (bc)": _no_graphed_mlp,
    "no gate/up bundles (multi_gu) and no graphed MLP": _no_gate_up_bundles,
    "exlnb's fix (drop_untileable_bundles, drop_unpadded_mlp_paths)": _exlnbs_fix,
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
    """The GPU test's greedy job (a chat prompt of some 30 tokens, 40 new ones) through the generator: its text
    and why it ended, or the exception that stopped it and where (the traceback's last frames)."""
    from exllamav3 import Job
    from exllamav3.generator.sampler import ArgmaxSampler

    ids = generator.tokenizer.encode(chatml(PROMPT), encode_special_tokens=True)
    job = Job(input_ids=ids, max_new_tokens=40, sampler=ArgmaxSampler())
    pieces, ends, tokens = [], [], 0
    try:
        generator.enqueue(job)
        while generator.num_remaining_jobs():
            for r in generator.iterate():
                if r.get("stage") == "streaming":
                    pieces.append(r.get("text", ""))
                    tokens += int(r["token_ids"].numel()) if r.get("token_ids") is not None else 0
                    if r.get("eos"):
                        ends.append(str(r.get("eos_reason")))
    except Exception as error:  # noqa: BLE001 - the probe's finding
        return {"ran": False, "error": one_line(error), "where": where(error)}
    return {"ran": True, "prompt_tokens": int(ids.shape[-1]), "new_tokens": tokens, "eos_reason": ends,
            "text": "".join(pieces)}


def where(error: BaseException) -> list[str]:
    """The last frames of an exception's traceback, "file:line function", innermost last."""
    import traceback

    return [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_tb(error.__traceback__)[-8:]]


def through_exlnb(folder: Path) -> dict:
    """The same question through exlnb's engine, as the GPU test asks it; a failure's cause is the library's error."""
    from exlnb import SamplerSettings, Session

    session = Session()
    try:
        session.load(str(folder), progress=False)
        result = session.complete(chatml(PROMPT), max_new_tokens=40, sampler=SamplerSettings.greedy())
    except Exception as error:  # noqa: BLE001 - the probe's finding
        cause = error.__cause__ or error
        return {"ran": False, "error": one_line(error), "where": where(cause)}
    finally:
        session.unload()
    return {"ran": True, "new_tokens": result.new_tokens, "eos_reason": str(result.eos_reason), "text": result.text}


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
    results.append({"variant": "exlnb's engine", "modules_changed": 0, **through_exlnb(folder)})
    return {**first, "variants": results}


def table(variants: list[dict]) -> str:
    lines = [f"{'variant':52} {'changed':>7}  result"]
    for v in variants:
        outcome = f"ran: {v['text']!r}" if v["ran"] else f"failed: {v['error']} at {' < '.join(reversed(v['where']))}"
        lines.append(f"{v['variant']:52} {v['modules_changed']:>7}  {outcome[:400]}")
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
