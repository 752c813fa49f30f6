"""The benchmarks: each compares two things measured side by side in the same run, and returns raw samples,
medians and spreads (`harness.summarise`) plus the ratio its target is stated in.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from benchmarks import decode
from benchmarks.harness import clock, summarise
from benchmarks.profile_decode import profile_steps
from exlnb.engines.base import one_line
from exlnb.models import resolve_model
from exlnb.session import Session


@dataclass(frozen=True)
class Plan:
    repeats: int
    warmup: int
    new_tokens: int
    prompt_tokens: int
    context_lengths: tuple[int, ...]
    context_new_tokens: int
    concurrency: tuple[int, ...]
    concurrency_new_tokens: int

    @classmethod
    def for_mode(cls, quick: bool, cuda: bool) -> Plan:
        if quick:
            return cls(
                repeats=2,
                warmup=1,
                new_tokens=8,
                prompt_tokens=32,
                context_lengths=(128, 512),
                context_new_tokens=4,
                concurrency=(1, 2),
                concurrency_new_tokens=8,
            )
        # 2 CPU cores prefill about 400 tokens/s and decode about 13 tokens/s: fewer repeats, shorter runs
        return cls(
            repeats=5 if cuda else 3,
            warmup=2 if cuda else 1,
            new_tokens=128 if cuda else 64,
            prompt_tokens=128,
            context_lengths=(128, 256, 512, 1024, 2048, 4096, 8160),
            context_new_tokens=32 if cuda else 16,
            concurrency=(1, 2, 4, 8),
            concurrency_new_tokens=64,
        )


def kit(session: Session, plan: Plan) -> dict:
    """Kit overhead: the same job through the session's stream and by hand over the engine's own generator
    (interleaved, so drift hits both), and time to first token through `%%exl_generate`."""
    samples = {"session": [], "raw": []}
    for run in range(plan.warmup + plan.repeats):
        pair = {
            "session": decode.session_decode(session, decode.random_prompt(plan.prompt_tokens, run), plan.new_tokens),
            "raw": decode.raw_decode(session, decode.random_prompt(plan.prompt_tokens, 1000 + run), plan.new_tokens),
        }
        if run >= plan.warmup:
            for side, result in pair.items():
                samples[side].append(result)
    out = {
        side: {
            "decode_tokens_per_s": summarise([r.decode_tokens_per_s for r in runs]),
            "ttft_s": summarise([r.ttft_s for r in runs]),
        }
        for side, runs in samples.items()
    }
    out["ratio_decode_session_over_raw"] = (
        out["session"]["decode_tokens_per_s"]["median"] / out["raw"]["decode_tokens_per_s"]["median"]
    )
    out["ttft_overhead_ms"] = 1000 * (out["session"]["ttft_s"]["median"] - out["raw"]["ttft_s"]["median"])
    out["magic"] = magic(session, plan)
    out["token_view"] = token_view(session, plan)
    return out


TOKEN_VIEW_K = 5  # alternatives per token, as `%%exl_generate --tokens 5`


def token_view(session: Session, plan: Plan) -> dict:
    """Decode with the token view off (top_tokens=0, nothing computed) and on (k = 5), interleaved: the view
    off must cost nothing, and on, what it costs is on record."""
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for run in range(plan.warmup + plan.repeats):
        for side, k in (("off", 0), ("on", TOKEN_VIEW_K)):
            result = decode.session_decode(
                session, decode.random_prompt(plan.prompt_tokens, 2000 + run), plan.new_tokens, k
            )
            if run >= plan.warmup:
                rates[side].append(result.decode_tokens_per_s)
    out = {side: summarise(values) for side, values in rates.items()}
    out["ratio_decode_on_over_off"] = out["on"]["median"] / out["off"]["median"]
    return out


def magic(session: Session, plan: Plan) -> dict:
    """`%%exl_generate` for one new token against the raw generator's time to first token, on prompts of one
    length that differ: exllamav2 copies even a partial page's keys from an earlier job with the same
    prompt, so the second of two runs of one prompt skips its prefill (a 71 ms "overhead" on an H100)."""
    try:
        from IPython.core.error import UsageError

        import exlnb.magics  # noqa: F401 - only to learn whether this build has the magics
    except ImportError as missing:
        # a GPU machine often has no IPython at all; the magic's cost does not depend on the device
        return {"skipped": f"the %%exl_generate magic cannot run here: {missing}"}
    magic_s, job_s, raw_s = [], [], []
    for run in range(plan.warmup + plan.repeats):
        text = session.tokenizer.decode(decode.random_prompt(plan.prompt_tokens, 5000 + run))
        try:
            m, job = decode.magic_ttft(session, text)
        except UsageError as refused:  # the magic is not registered, or takes other options than assumed
            return {"skipped": f"%%exl_generate --max-new-tokens 1 did not run: {refused}"}
        length = len(session.tokenizer.encode(text, special=True))  # what the magic's job prefills
        r = decode.raw_decode(session, decode.random_prompt(length, 6000 + run), 1).ttft_s
        if run >= plan.warmup:
            magic_s.append(m), job_s.append(job), raw_s.append(r)
    out = {"magic_cell_s": summarise(magic_s), "magic_job_ttft_s": summarise(job_s), "raw_ttft_s": summarise(raw_s)}
    out["ttft_overhead_ms"] = 1000 * (out["magic_cell_s"]["median"] - out["raw_ttft_s"]["median"])
    return out


def peer(session: Session, plan: Plan) -> dict:
    """The engine against transformers `generate` on the same device and model (batch 1, greedy), and against
    exllamav3's own generator (ExLlamaV3, the maintained successor) where it is installed on a CUDA machine."""
    model_dir = resolve_model("smollm2-135m-instruct")
    model = decode.load_hf_peer(model_dir)
    exllamav3 = decode.load_exllamav3_peer(model_dir) if decode.exllamav3_peer_available(session) else None
    prefill_tokens = 4 * plan.prompt_tokens
    rows: dict[str, list[float]] = defaultdict(list)
    for run in range(plan.warmup + plan.repeats):
        prompt = decode.random_prompt(plan.prompt_tokens, 2000 + run)
        long_prompt = decode.random_prompt(prefill_tokens, 3000 + run)
        result = {
            "engine_decode": decode.session_decode(session, prompt, plan.new_tokens).decode_tokens_per_s,
            "hf_decode": decode.hf_decode(model, prompt, plan.new_tokens),
            "engine_prefill": decode.session_decode(session, long_prompt, 1).prefill_tokens_per_s,
            "hf_prefill": decode.hf_prefill(model, long_prompt),
        }
        if exllamav3 is not None:
            result["exllamav3_decode"] = decode.exllamav3_by_hand(
                exllamav3, prompt, plan.new_tokens
            ).decode_tokens_per_s
            result["exllamav3_prefill"] = decode.exllamav3_by_hand(exllamav3, long_prompt, 1).prefill_tokens_per_s
        if run >= plan.warmup:
            for key, value in result.items():
                rows[key].append(value)
    del model
    if exllamav3 is not None:
        exllamav3.model.unload()
        del exllamav3
    v3_engine = (
        _or_its_error(lambda: _exllamav3_engine_throughput(model_dir, plan))
        if decode.exllamav3_peer_available(session)
        else None
    )
    profile = profile_steps(session, tokens=max(plan.new_tokens // 4, 2))
    out = {f"{key}_tokens_per_s": summarise(values) for key, values in rows.items()}
    out |= {
        "prefill_prompt_tokens": prefill_tokens,
        "prefill_method": "engine: submit to first token through the session; transformers: one forward pass; "
        "exllamav3: its generator's submit to first token",
        "hf_dtype": "float16" if torch.cuda.is_available() else "float32",
        "engine_profile": profile,
    }
    if v3_engine is not None:
        out["exllamav3_engine"] = v3_engine
    for peer_name in ("hf", "exllamav3"):
        for kind in ("decode", "prefill"):
            if f"{peer_name}_{kind}" in rows:
                out[f"ratio_{kind}_engine_over_{peer_name}"] = (
                    out[f"engine_{kind}_tokens_per_s"]["median"] / out[f"{peer_name}_{kind}_tokens_per_s"]["median"]
                )
    return out


def _or_its_error(measure) -> dict:
    """A peer's measurement, or why it failed: a peer that cannot run must not cost the run its own numbers."""
    try:
        return measure()
    except Exception as error:  # noqa: BLE001 - recorded in the results
        return {"error": one_line(error)}


def _exllamav3_engine_throughput(model_dir, plan: Plan) -> dict:
    """The ExLlamaV3 engine on the same model in the same run: aggregate new tokens/s of 1 and 8 jobs submitted
    together, as `concurrency` measures the run's own engine."""
    v3 = Session()
    status = v3.load(str(model_dir), engine="exllamav3", progress=False)
    try:
        decode.aggregate_throughput(v3, 1, plan.concurrency_new_tokens, seed=999)  # warm-up
        rows = {
            n: summarise(
                [
                    decode.aggregate_throughput(v3, n, plan.concurrency_new_tokens, seed=run)
                    for run in range(plan.repeats)
                ]
            )
            for n in (1, 8)
        }
    finally:
        v3.unload()
    return {
        "status": status.line(),
        "aggregate_tokens_per_s": {str(n): row for n, row in rows.items()},
        "ratio_8_over_1": rows[8]["median"] / rows[1]["median"],
    }


def context(session: Session, plan: Plan) -> dict:
    """Decode and prefill speed against context length (field reports 4 and 5): one run gives both, the
    prompt's prefill (submit to first token) and the decode that follows at that context."""
    cache = session.status().cache_tokens
    lengths = [n for n in plan.context_lengths if n + plan.context_new_tokens <= cache]
    rows = []
    for length in lengths:
        runs = [
            decode.session_decode(session, decode.random_prompt(length, length * 10 + run), plan.context_new_tokens)
            for run in range(plan.repeats)
        ]
        rows.append(
            {
                "context_tokens": length,
                "decode_tokens_per_s": summarise([r.decode_tokens_per_s for r in runs]),
                "prefill_tokens_per_s": summarise([r.prefill_tokens_per_s for r in runs]),
            }
        )
    return {"rows": rows, "new_tokens_per_run": plan.context_new_tokens}


def concurrency(session: Session, plan: Plan) -> dict:
    """Aggregate new tokens/s with 1, 2, 4, 8 jobs submitted together (continuous batching)."""
    rows = {
        n: summarise(
            [
                decode.aggregate_throughput(session, n, plan.concurrency_new_tokens, seed=run)
                for run in range(plan.repeats)
            ]
        )
        for n in plan.concurrency
    }
    out = {"aggregate_tokens_per_s": {str(n): row for n, row in rows.items()}}
    for n in (2, 4, 8):
        if n in rows:
            out[f"ratio_{n}_over_1"] = rows[n]["median"] / rows[1]["median"]
    return out


def hardware(plan: Plan) -> dict:
    """A 7B-shaped model decoded at batch 1 by the ExLlamaV2 engine, against weights / copy bandwidth: as the
    engine loads by default (paged where it can be) and unpaged (exllamav2's own attention, one job at a time);
    and by the ExLlamaV3 engine where exllamav3 is installed, on the same weights."""
    import importlib.util

    from benchmarks.hardware import copy_bandwidth
    from exlnb.random_model import seven_b_shaped

    bandwidth = copy_bandwidth()
    start = time.perf_counter()
    v3 = None
    with seven_b_shaped() as (folder, weight_bytes):
        written_s = time.perf_counter() - start
        default, profile = _decode_7b(str(folder), "auto", plan, profile=True)
        unpaged, _ = _decode_7b(str(folder), False, plan, profile=False)
        if importlib.util.find_spec("exllamav3") is not None:
            v3 = _or_its_error(lambda: _decode_7b(str(folder), "auto", plan, profile=False, engine="exllamav3")[0])
    floor_ms = 1000 * weight_bytes / bandwidth
    if v3 is not None and "error" not in v3:
        v3["ratio_over_floor"] = v3["ms_per_token"]["median"] / floor_ms
    extra = {} if v3 is None else {"exllamav3_engine": v3}
    return extra | {
        "copy_bandwidth_bytes_per_s": bandwidth,
        "weight_bytes_read_per_token": weight_bytes,
        "weights_folder": str(folder.parent),
        "weights_written_s": written_s,
        "floor_ms_per_token": floor_ms,
        "status": default["status"],
        "warmup_ms_per_token": default["warmup_ms_per_token"],
        "ms_per_token": default["ms_per_token"],
        "ratio_over_floor": default["ms_per_token"]["median"] / floor_ms,
        "unpaged": {**unpaged, "ratio_over_floor": unpaged["ms_per_token"]["median"] / floor_ms},
        "profile": profile,
        "profile_kernel_ms_over_floor": profile["gpu_kernel_ms_per_step"] / floor_ms,
    }


def _decode_7b(
    folder: str, paged: str | bool, plan: Plan, *, profile: bool, engine: str = "exllamav2"
) -> tuple[dict, dict | None]:
    session = Session()
    status = session.load(folder, engine=engine, cache_tokens=2048, paged=paged, progress=False)
    try:
        runs = [
            decode.raw_decode(session, decode.random_prompt(32, run), plan.new_tokens)
            for run in range(plan.warmup + plan.repeats)
        ]
        steps = profile_steps(session, tokens=32) if profile else None
    finally:
        session.unload()
    ms_per_token = [1000 / r.decode_tokens_per_s for r in runs]
    measured = {
        "status": status.line(),
        "warmup_ms_per_token": ms_per_token[: plan.warmup],
        "ms_per_token": summarise(ms_per_token[plan.warmup :]),
    }
    return measured, steps


def timed(run, *args) -> dict:
    """Run one benchmark and record how long it took (the GPU run must fit in a few minutes)."""
    start = clock()
    result = run(*args)
    result["elapsed_s"] = clock() - start
    return result
