"""A load test in a notebook cell with a Stop button: `await abench(...)`.

ipykernel (7.4) hands widget messages to their widgets only while a cell awaits, not while it blocks, so a
button beside a plain `bench(...)` call would be heard after the run. Here the run goes to a worker thread
and the cell awaits it; the button sets the run's `stop` event.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
from collections.abc import Sequence

from exlnb.loadtest import BenchResult, bench
from exlnb.widgets.frontend import widget_frontend


def stop_button(stop: threading.Event):
    """A button that sets `stop`: the run cancels its requests in flight and returns what it has."""
    import ipywidgets as w

    button = w.Button(description="Stop", icon="stop", button_style="danger", layout=w.Layout(width="96px"),
                      tooltip="cancel the requests in flight and keep the results so far")

    def clicked(_) -> None:
        stop.set()
        button.disabled = True
        button.description = "Stopping"

    button.on_click(clicked)
    return button


async def abench(
    request_rate: float | Sequence[float] = math.inf,
    *,
    display: str = "auto",
    stop: threading.Event | None = None,
    **options,
) -> BenchResult:
    """`exlnb.bench` for a notebook cell, with a Stop button where the front end renders widgets (`display`
    "auto"), always ("widget") or never ("text"). `options` are `bench`'s.

    Stop ends the run with the results so far (requests in flight cancelled, counted as failed). Cancelling
    the cell's task stops the run and waits until its jobs are cancelled before it propagates.
    """
    from IPython.display import display as show

    if display not in ("auto", "widget", "text"):
        raise ValueError(f'display={display!r}: use "auto", "widget" or "text"')
    stop = stop or threading.Event()
    button = None
    if display == "widget" or (display == "auto" and widget_frontend()):
        button = stop_button(stop)
        show(button)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="exlnb-bench") as pool:
        running = pool.submit(bench, request_rate, stop=stop, **options)
        try:
            return await asyncio.wrap_future(running)
        except BaseException:
            stop.set()
            concurrent.futures.wait([running])
            raise
        finally:
            if button is not None:
                button.disabled = True
