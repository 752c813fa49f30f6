"""Which parts of an ExLlamaV2 decode step a CUDA graph can capture (issue 17), measured on the GPU.

    python -m benchmarks.graph_probe [--model bundled|7b-shaped] [--out DIR]

Loads the model as exlnb's ExLlamaV2 engine does (unpaged: a plain `ExLlamaV2Cache`), prefills a short
prompt eagerly, then tries at batch 1, each attempt on its own: every module of `model.modules` alone; the
GPU modules chained by hand as `forward_chunk` runs them, without its stream switching; and a whole
`model.forward` step, on exllamav2's own stream and on a fresh side stream as PyTorch's CUDA-graph docs do.
Per attempt: captured or not, and why not (the exception and the innermost exllamav2 line it came from);
when captured, replay on a new input against eager on it (max abs diff), replay against eager one position
later (a graph bakes in the host-side `past_len` it was captured at), and eager vs replay ms per step.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.decode import random_prompt
from benchmarks.harness import clock, device_slug, environment, summarise
from exlnb.engines import create_engine
from exlnb.engines.options import EngineOptions
from exlnb.models import BUNDLED_MODEL, resolve_model
from exlnb.random_model import SEVEN_B_SHAPED, cannot_make_here, seven_b_shaped
from exlnb.session import one_line

MODELS = ("bundled", SEVEN_B_SHAPED)
CACHE_TOKENS = 1024
PROMPT_TOKENS = 32  # prefilled eagerly; every decode step is probed at past_len = PROMPT_TOKENS
WARMUP_CALLS = 3  # on a side stream before capture, as torch.cuda.graph's docs ask
TIMED_STEPS = 50
REPLAY_TOLERANCE = 1e-2  # max abs diff / max abs eager output under which a replay counts as matching


@dataclass(frozen=True)
class Attempt:
    """One thing to capture: `run(past_len)` is one call from static inputs, `use_other_input()` writes a
    different input into those buffers, so that a replay is checked on an input it was not captured with."""

    name: str
    run: Callable[[int], torch.Tensor]
    use_other_input: Callable[[], None]
    stream: str  # "side": a fresh stream per capture; "exllamav2": exllamav2's own device stream


def cannot_probe_here(model: str) -> str | None:
    """What this machine lacks for the probe, in a line; None where it can run."""
    if not torch.cuda.is_available():
        return "graph_probe needs a CUDA GPU and exllamav2 0.3.2: this machine has no CUDA device"
    if importlib.util.find_spec("exllamav2") is None:
        return "graph_probe needs exllamav2 0.3.2: pip install exllamav2==0.3.2 (or put its wheel on PYTHONPATH)"
    return cannot_make_here() if model == SEVEN_B_SHAPED else None


@contextlib.contextmanager
def model_folder(model: str) -> Iterator[Path]:
    if model == SEVEN_B_SHAPED:
        with seven_b_shaped() as (folder, _):
            yield folder
    else:
        yield resolve_model(BUNDLED_MODEL, progress=False)


def attempts(model, cache, past_len: int, token: int, other_token: int) -> list[Attempt]:
    """Every module alone, the GPU modules chained, then whole `model.forward` steps: its `set_device_streams()`
    moves the current stream to exllamav2's own, which may leave a side-stream capture open, so it goes last."""
    from exllamav2.device import get_device_stream

    inputs, other_inputs = module_inputs(model, cache, token, past_len), module_inputs(model, cache, other_token, past_len)
    found = [_module_attempt(i, m, cache, inputs[i], other_inputs[i]) for i, m in enumerate(model.modules)]
    first_gpu = next(i for i, m in enumerate(model.modules) if _on_gpu(m))
    found.append(_chain_attempt(model.modules[first_gpu:], cache, inputs[first_gpu], other_inputs[first_gpu]))
    ids = torch.tensor([[token]])

    def forward(past: int) -> torch.Tensor:
        cache.current_seq_len = past  # model.forward reads and advances it: each call is the same step
        return model.forward(ids, cache)

    device_stream = get_device_stream(torch.cuda.current_device())
    for stream in ("exllamav2", "side") if device_stream is not None else ("side",):
        found.append(Attempt(f"model.forward ({stream} stream)", forward, lambda: ids.fill_(other_token), stream))
    return found


def module_inputs(model, cache, token: int, past_len: int) -> list[torch.Tensor]:
    """What each module's forward receives in an eager decode step of `token` at `past_len` (as forward_chunk
    moves it: the embedding runs on the CPU by default, so its output is copied to the first GPU module)."""
    from exllamav2.attn import ExLlamaV2Attention
    from exllamav2.compat import safe_move_tensor

    params = ExLlamaV2Attention.Params(1, 1, past_len, None, None)
    x, inputs = torch.tensor([[token]]), []
    for module in model.modules:
        if _on_gpu(module) and x.device != torch.device("cuda", module.device_idx):
            x = safe_move_tensor(x, module.device_idx, non_blocking=True)
        inputs.append(x.clone())  # attention and MLP add their residual into their input in place
        x = module.forward(x, cache=cache, attn_params=params, past_len=past_len)
    return inputs


def _on_gpu(module) -> bool:
    return module.device_idx is not None and module.device_idx >= 0


def _module_attempt(index: int, module, cache, static: torch.Tensor, other: torch.Tensor) -> Attempt:
    from exllamav2.attn import ExLlamaV2Attention

    source, work = static.clone(), static.clone()

    def run(past_len: int) -> torch.Tensor:
        work.copy_(source)
        params = ExLlamaV2Attention.Params(1, 1, past_len, None, None)  # exllamav2 builds it per call
        return module.forward(work, cache=cache, attn_params=params, past_len=past_len)

    name = f"module {index} {type(module).__name__} {module.key} (device {module.device_idx})"
    return Attempt(name, run, lambda: source.copy_(other), "side")


def _chain_attempt(modules, cache, static: torch.Tensor, other: torch.Tensor) -> Attempt:
    from exllamav2.attn import ExLlamaV2Attention

    source, work = static.clone(), static.clone()

    def run(past_len: int) -> torch.Tensor:
        x = work.copy_(source)
        params = ExLlamaV2Attention.Params(1, 1, past_len, None, None)
        for module in modules:
            x = module.forward(x, cache=cache, attn_params=params, past_len=past_len)
        return x

    name = f"modules {modules[0].key}..{modules[-1].key} chained by hand (no model.forward)"
    return Attempt(name, run, lambda: source.copy_(other), "side")


def probe(attempt: Attempt, past_len: int) -> dict:
    """Capture the attempt after warm-up calls; if it captured, check and time its replay."""
    from exllamav2.device import get_device_stream

    row: dict = {"name": attempt.name, "capture_stream": attempt.stream, "captured": False}
    capture_stream = get_device_stream(torch.cuda.current_device()) if attempt.stream == "exllamav2" else torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    try:
        torch.cuda.synchronize()
        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):
            for _ in range(WARMUP_CALLS):
                attempt.run(past_len)
        torch.cuda.current_stream().wait_stream(warm)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:  # torch warns, not raises, on an empty graph
            warnings.simplefilter("always")
            with torch.cuda.graph(graph, stream=capture_stream):
                output = attempt.run(past_len)
        torch.cuda.synchronize()
        row["captured"] = True
        row["capture_warnings"] = [str(w.message).splitlines()[0] for w in caught]
    except Exception as error:  # recorded: which call broke the capture is what the probe is for
        row |= _failure(error) | _end_open_capture(graph, capture_stream)
        return row
    try:
        row |= _check_replay(attempt, graph, output, past_len)
    except Exception as error:
        row |= {"replay_" + key: value for key, value in _failure(error).items()}
    return row


def _check_replay(attempt: Attempt, graph, output: torch.Tensor, past_len: int) -> dict:
    captured_input_output = output.clone()
    attempt.use_other_input()
    expected = attempt.run(past_len).clone()
    graph.replay()
    torch.cuda.synchronize()
    # a copy: modules add their residual into their input in place, so `output` may be the very buffer the
    # eager call below writes into (the first run of this probe compared that buffer with itself)
    replayed = output.clone()
    diff, scale = _max_abs(replayed, expected), _max_abs(expected, torch.zeros_like(expected))
    next_position = attempt.run(past_len + 1).clone()  # eager one token later, on the same input
    return {
        "replay_max_abs_diff": _finite(diff),
        "replay_matches_eager": bool(diff <= REPLAY_TOLERANCE * max(scale, 1e-6)),
        "eager_output_moved_with_input_by": _finite(_max_abs(expected, captured_input_output)),
        "replay_vs_eager_at_past_len_plus_1_max_abs_diff": _finite(_max_abs(replayed, next_position)),
        "eager_ms": _timed(lambda: attempt.run(past_len)),
        "replay_ms": _timed(graph.replay),
    }


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max())


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None  # strict JSON has no NaN


def _timed(call: Callable[[], object]) -> dict:
    samples = []
    for _ in range(TIMED_STEPS):
        start = clock()
        call()
        samples.append(1000 * (clock() - start))
    return summarise(samples)


def _failure(error: BaseException) -> dict:
    """The exception, the earlier ones it was raised over (torch.cuda.graph's exit raises over the original),
    and the innermost line of exllamav2 in the original's traceback."""
    chain = [error]
    while chain[-1].__context__ is not None and len(chain) < 5:
        chain.append(chain[-1].__context__)
    frames = [f for f in traceback.extract_tb(chain[-1].__traceback__) if "/exllamav2/" in f.filename]
    where = frames[-1] if frames else None
    return {
        "error": one_line(error),
        "raised_over": [one_line(e) for e in chain[1:]],
        "exllamav2_line": f"{Path(where.filename).name}:{where.lineno} {where.line}" if where else None,
    }


def _end_open_capture(graph, stream) -> dict:
    """torch ends a capture only on the stream it began on: when exllamav2 moved the current stream away,
    the capture is still open, and every later attempt would fail on it. End it here and say so."""
    with torch.cuda.stream(stream):
        if not torch.cuda.is_current_stream_capturing():
            return {}
        try:
            graph.capture_end()
            return {"open_capture": "left open by the failure; ended by the probe"}
        except Exception as error:
            return {"open_capture": f"left open by the failure; ending it failed: {one_line(error)}"}


def run_probe(model_name: str) -> dict:
    with model_folder(model_name) as folder, torch.inference_mode():
        options = EngineOptions.resolve(engine="exllamav2", model_dir=folder, cache_tokens=CACHE_TOKENS, cache_dtype="fp16",
                                        max_batch_size=1, gpu_split=None, paged=False)
        engine = create_engine(options, progress=False)
        try:
            model, cache = engine.model, engine.cache
            prompt = random_prompt(PROMPT_TOKENS + 2, seed=0)
            cache.current_seq_len = 0
            model.forward(torch.tensor([prompt[:PROMPT_TOKENS]]), cache, preprocess_only=True)
            rows = [probe(a, PROMPT_TOKENS) for a in attempts(model, cache, PROMPT_TOKENS, *prompt[PROMPT_TOKENS:])]
            return {"engine": engine.status().line(), "cache": type(cache).__name__, "cache_tokens": cache.max_seq_len,
                    "past_len": PROMPT_TOKENS, "capture_error_mode": "global (torch.cuda.graph's default)",
                    "attempts": rows}
        finally:
            engine.close()


def table(rows: list[dict]) -> str:
    lines = [f"{'attempt':72} {'captured':8} {'eager ms':>9} {'replay ms':>9} {'max diff':>9}  error"]
    for r in rows:
        eager, replay = (f"{r[k]['median']:9.3f}" if k in r else f"{'':9}" for k in ("eager_ms", "replay_ms"))
        diff = r.get("replay_max_abs_diff")
        diff_text = f"{diff:9.2g}" if diff is not None else f"{'':9}"
        error = r.get("error") or r.get("replay_error") or ""
        where = f" [{r['exllamav2_line']}]" if r.get("exllamav2_line") else ""
        lines.append(f"{r['name'][:72]:72} {'yes' if r['captured'] else 'no':8} {eager} {replay} {diff_text}  {error[:90]}{where}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.graph_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="bundled")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    reason = cannot_probe_here(args.model)
    if reason:
        parser.exit(2, reason + "\n")
    env = environment()
    result = {"environment": env, "model": args.model, **run_probe(args.model)}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"graph-probe-{args.model}-{device_slug(env)}-{env['date'][:10]}.json"
    path.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    print(table(result["attempts"]))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
