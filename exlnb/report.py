"""The main job (`make report`): prepare the bundled model, load the default engine, stream an answer.

    python -m exlnb.report [--engine auto|exllamav2|cpu] [--out reports]

It writes `reports/summary.md` with what was measured. The default engine is ExLlamaV2 where CUDA is
available, the CPU engine otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from exlnb import SamplerSettings, get_session
from exlnb.templates import chatml

QUESTION = "What is the capital of France?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exlnb.report", description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="auto", choices=("auto", "exllamav2", "cpu"))
    parser.add_argument("--out", type=Path, default=Path("reports"))
    args = parser.parse_args(argv)

    session = get_session()
    status = session.load(engine=args.engine)
    print(status.line())
    for note in status.notes:
        print(f"note: {note}")
    print(f"\n> {QUESTION}\n")
    stream = session.generate(chatml(QUESTION), max_new_tokens=64, sampler=SamplerSettings.greedy())
    for event in stream:
        print(event.text, end="", flush=True)
    result = stream.result()
    stats = (
        f"{result.new_tokens} tokens, eos: {result.eos_reason.value}, TTFT {result.time_to_first_token_s * 1000:.0f} ms, "
        f"prefill {result.prefill_tokens_per_s or 0:.0f} tokens/s, decode {result.decode_tokens_per_s or 0:.1f} tokens/s"
    )
    print(f"\n\n{stats}")
    args.out.mkdir(parents=True, exist_ok=True)
    summary = args.out / "summary.md"
    summary.write_text(f"# exlnb report\n\n- {status.line()}\n- {QUESTION} -> {result.text.strip()!r} ({stats})\n")
    print(f"wrote {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
