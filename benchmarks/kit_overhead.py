"""What the session itself costs per token, with the model's work replaced by a step of fixed cost.

    python -m benchmarks kit-overhead [--step-ms 0 12] [--tokens 200] [--repeats 6] [--out DIR]

The kit row of `python -m benchmarks` compares a session stream with the engine's generator driven by hand on
a real model, where host noise is as large as the effect (GPU runs since the typed request read 0.78 to 0.91,
with interquartile ranges of 10-30%). Here the CPU engine's forward pass returns logits computed once, after a
fixed cost: 0 ms (the session's own bookkeeping is all there is) or a step of Python that holds the GIL for
the given milliseconds, as exllamav2's host-bound decode step does on a small model (12 ms is the bundled
model's step on the H100). Both sides run the same engine code, so the difference per token is what the
session adds: the engine thread's delivery, the stream's queue, and the consumer waking for every token.
The consumer reads its clock when it gets the GIL, which a GIL-holding step can delay: a late first token
shortens the span the rate is taken over, so with a long step the session's figure is, if anything, flattered
by up to one switch interval (5 ms) spread over the run's tokens.
Writes kit-overhead-<device>-<date>.json under --out (-2, -3, ... for a later run of the same day).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks import decode
from benchmarks.harness import device_slug, environment, new_result_path, summarise, write_json
from exlnb import Session
from exlnb.models import BUNDLED_MODEL


def fixed_cost_forward(engine, step_s: float) -> None:
    """Replace the CPU engine's forward pass with reused logits after `step_s` seconds of GIL-holding Python."""
    runner = engine._runner
    real, computed = runner.forward, {}

    def forward(chunks):
        end = time.perf_counter() + step_s
        while time.perf_counter() < end:
            pass  # Python holding the GIL, as a library issuing kernel launches does
        if len(chunks) not in computed:
            computed[len(chunks)] = real(chunks)  # real logits, once per batch size
        return computed[len(chunks)]

    runner.forward = forward


def measure(step_ms: float, tokens: int, repeats: int) -> dict:
    session = Session()
    session.load(BUNDLED_MODEL, engine="cpu", progress=False)
    try:
        session.run_on_engine(lambda engine: fixed_cost_forward(engine, step_ms / 1000))
        samples = {"session": [], "by_hand": []}
        for run in range(repeats + 1):  # the first pair warms up
            pair = (
                decode.session_decode(session, decode.random_prompt(16, run), tokens),
                decode.raw_decode(session, decode.random_prompt(16, 1000 + run), tokens),
            )
            if run:
                for side, result in zip(samples, pair):
                    samples[side].append(1000 / result.decode_tokens_per_s)
    finally:
        session.unload()
    out = {side: summarise(ms) for side, ms in samples.items()}
    out["session_cost_per_token_ms"] = out["session"]["median"] - out["by_hand"]["median"]
    out["ratio_decode_session_over_by_hand"] = out["by_hand"]["median"] / out["session"]["median"]
    return {"step_ms": step_ms, "ms_per_token": out}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m benchmarks kit-overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, nargs="+", default=[0.0, 12.0], help="fixed cost of each step")
    parser.add_argument("--tokens", type=int, default=200, help="new tokens per generation")
    parser.add_argument("--repeats", type=int, default=6, help="pairs measured per step cost (after one warm-up)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    env = environment()
    results = [measure(step, args.tokens, args.repeats) for step in args.step_ms]
    for r in results:
        m = r["ms_per_token"]
        print(
            f"step {r['step_ms']:g} ms: session {m['session']['median']:.3f} ms/token, by hand "
            f"{m['by_hand']['median']:.3f}: the session adds {1000 * m['session_cost_per_token_ms']:.0f} us a token "
            f"(ratio {m['ratio_decode_session_over_by_hand']:.3f})"
        )
    path = new_result_path(args.out, f"kit-overhead-{device_slug(env)}-{env['date'][:10]}")
    payload = {
        "benchmark": "kit_overhead",
        "environment": env,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "results": results,
    }
    write_json(path, payload, indent=2)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
