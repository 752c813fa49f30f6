"""A server driven through the remote engine, as a notebook drives it: one JSON of what each step showed.

    python -m benchmarks server-check --url http://127.0.0.1:5000/v1 [--api-key-env VAR] [--out DIR]

Over both APIs (`/v1/chat/completions` with the server's template, `/v1/completions` with exlnb's): a greedy
answer streamed in pieces, its time to first token; `n=2` samples; the token view where the server returns
`logprobs` (or the one line saying it does not); Stop in the middle of a long answer, and how long the job
took to end after it; the server's `/metrics`, where it has one, through the live server view's reader. A
step that fails is recorded with its one-line error and the next step runs. The tests run the same steps
against the servers they start; this is the record of a server they cannot start (TabbyAPI on a GPU).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.harness import environment, new_result_path, write_json
from benchmarks.suites import _or_its_error
from exlnb import generation
from exlnb.models import BUNDLED_MODEL
from exlnb.session import Session
from exlnb.widgets.server import server_line

WAIT_S = 120  # every wait here is bounded
PROMPT = "Name three colours."


def finished(gen: generation.Generation) -> generation.Generation:
    if not gen.wait_done(WAIT_S):
        gen.cancel("the check's time limit")
        raise TimeoutError(f"not done within {WAIT_S} s")
    return gen


def answer(session: Session) -> dict:
    gen = finished(generation.start(PROMPT, session=session, max_new_tokens=24, temperature=0))
    [sample] = gen.samples
    return {
        "text": sample.text,
        "pieces": sum(bool(e.text) for e in sample.events),
        "errors": gen.errors,
        "end": sample.eos_reason.words,
        "ttft_s": sample.last.time_to_first_token_s,
    }


def samples(session: Session) -> dict:
    gen = finished(generation.start("Say a number.", n=2, seed=3, session=session, max_new_tokens=8))
    return {"texts": gen.texts, "errors": gen.errors}


def token_view(session: Session) -> dict:
    try:
        gen = finished(generation.start(PROMPT, session=session, max_new_tokens=6, temperature=0, tokens=3))
    except ValueError as refusal:
        return {"refused": str(refusal)}
    records = gen.results[0].tokens()
    return {
        "tokens": [
            {"text": row.text, "probability": row.probability, "alternatives": len(row.alternatives)}
            for _, row in records.iterrows()
        ],
        "text_matches": "".join(records.text) == gen.texts[0],
    }


def stop(session: Session) -> dict:
    gen = generation.start("Write a long story about a lighthouse.", session=session, max_new_tokens=400, temperature=0)
    deadline = time.monotonic() + WAIT_S
    while not gen.samples[0].token_ids and time.monotonic() < deadline:
        time.sleep(0.02)
    pressed = time.perf_counter()
    gen.cancel("stop button")
    finished(gen)
    return {
        "tokens_before_stop": len(gen.samples[0].token_ids),
        "end": gen.samples[0].eos_reason.words,
        "ended_after_stop_s": time.perf_counter() - pressed,
        "jobs_left": len(session.jobs()),
    }


def metrics(session: Session) -> dict:
    return {"server": server_line(session)}


STEPS = {"answer": answer, "samples": samples, "token_view": token_view, "stop": stop, "metrics": metrics}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m benchmarks server-check", description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the server's OpenAI API base, e.g. http://127.0.0.1:5000/v1")
    parser.add_argument("--served-model", help="the server's name for the model (default: the one it serves)")
    parser.add_argument("--api-key-env", help="environment variable holding the server's API key")
    parser.add_argument("--name", default="server", help="a word for the file name, e.g. tabbyapi")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    record = {"benchmark": "server-check", "url": args.url, "environment": environment(), "apis": {}}
    for api in ("chat", "completions"):
        session = Session()
        loaded = _or_its_error(
            lambda: {
                "status": session.load(
                    BUNDLED_MODEL,
                    url=args.url,
                    served_model=args.served_model,
                    api_key_env=args.api_key_env,
                    api=api,
                    progress=False,
                ).line()
            }
        )
        steps = record["apis"][api] = {"load": loaded}
        if "error" not in loaded:
            for name, step in STEPS.items():
                steps[name] = _or_its_error(lambda: step(session))
                print(f"{api} {name}: {steps[name]}", flush=True)
            session.unload()
    path = new_result_path(args.out, f"server-check-{args.name}-{record['environment']['date'][:10]}")
    write_json(path, record, indent=1)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
