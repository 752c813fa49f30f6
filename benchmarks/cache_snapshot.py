"""What the cache inspector shows while jobs run: a snapshot of the engine's real pages, as JSON and as HTML.

    python -m benchmarks cache-snapshot [--engine exllamav2|cpu] [--out benchmarks/results]

Three jobs share one long prompt (its full pages are shared: ref count 3), two run other prompts, and one is
abandoned by its reader with `cancel_when_abandoned=False` (field report 1: it holds its pages with nobody
reading). The snapshot is taken while all six decode. The HTML page is the inspector's grid drawn from the
same cells, summary and legend the widget sends to the front end, so that a GPU machine without a browser
can record what the widget would show; open it in a browser, or screenshot it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import html
import json
import time
from pathlib import Path

from benchmarks.decode import GREEDY
from benchmarks.harness import device_slug, environment
from exlnb import get_session
from exlnb.engines.base import Stage
from exlnb.engines.options import ENGINE_NAMES
from exlnb.session import Session
from exlnb.templates import chatml
from exlnb.widgets.cache import cache_summary, inspector_html
from exlnb.widgets.record import record_html

SHARED_PROMPT = chatml(
    " ".join(f"Record {i}: the parcel for house {i} goes out on day {i % 7}." for i in range(1, 140))
    + "\nWhich day does the parcel for house 12 go out?"
)
OTHER_PROMPTS = [chatml("Write a long story about a lighthouse keeper."), chatml("Explain how tides work.")]
ABANDONED_PROMPT = chatml("List every prime number you know, one per line.")


def start_jobs(session: Session, max_new_tokens: int) -> list:
    """Six jobs decoding at once; returns their streams (the abandoned one already left by its reader)."""
    streams = [
        session.generate(SHARED_PROMPT, max_new_tokens=max_new_tokens, sampler=GREEDY, stop_at_eos=False)
        for _ in range(3)
    ]
    streams += [
        session.generate(p, max_new_tokens=max_new_tokens, sampler=GREEDY, stop_at_eos=False) for p in OTHER_PROMPTS
    ]
    abandoned = session.generate(
        ABANDONED_PROMPT, max_new_tokens=max_new_tokens, sampler=GREEDY, stop_at_eos=False, cancel_when_abandoned=False
    )
    for _ in zip(range(2), abandoned):  # read two tokens, then leave without cancelling
        pass
    return streams + [abandoned]


def wait_until_all_decode(session: Session, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = session.jobs()
        if len(rows) == count and all(r.info.stage is Stage.DECODE for r in rows):
            return
        time.sleep(0.002)
    raise TimeoutError(f"the {count} jobs were not all decoding within {timeout_s} s")


def snapshot_html(view, rows, title: str) -> str:
    """The inspector as a static page: the widget's own record of this state, under a title."""
    return (
        f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title><style>body{{margin:12px}}</style>"
        f"<h3 class='exlnb'>{html.escape(title)}</h3>{record_html(inspector_html(view, rows))}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks cache-snapshot", description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="auto", choices=ENGINE_NAMES)
    parser.add_argument("--cache-tokens", type=int, default=16384)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)

    session = get_session()
    status = session.load(engine=args.engine, cache_tokens=args.cache_tokens)
    streams = start_jobs(session, max_new_tokens=400)
    wait_until_all_decode(session, len(streams))
    view, rows = session.cache_view(), session.jobs()
    session.cancel_all()
    for stream in streams[:-1]:
        stream.result()
    idle = session.cache_view()

    env = environment()
    slug = f"cache-{status.engine}-{device_slug(env)}-{datetime.date.today()}"
    title = f"{status.line()}: six jobs decoding"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{slug}.html").write_text(snapshot_html(view, rows, title))
    record = {
        "environment": env,
        "status": status.line(),
        "while_running": {"cache": dataclasses.asdict(view), "jobs": [dataclasses.asdict(r) for r in rows]},
        "after_cancel_all": {
            "free_pages": idle.free_pages,
            "total_pages": idle.total_pages,
            "defrag_count": idle.defrag_count,
        },
    }
    (args.out / f"{slug}.json").write_text(json.dumps(record, indent=2, default=str))
    print(cache_summary(view))
    print(f"wrote {args.out / slug}.json and .html")


if __name__ == "__main__":
    main()
