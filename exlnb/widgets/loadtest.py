"""A load test in a notebook cell, live: `await abench(...)`, which `%exl_bench` runs in a kernel.

A line per rate, redrawn as requests are sent and end: a progress bar, the counts (finished, cancelled, in
flight, still to send), the running TTFT and TPOT and the share of requests that met the objectives (in the
error colour once one missed them); a Stop button under them. When the test has ended the output settles into a
static record of the same lines (`exlnb.widgets.record`), which says where a stop cut it short, over one compact
table, a row per rate, with vLLM's 40-line printout folded under it. ipykernel (7.4) hands widget messages to
their widgets only while a cell awaits, not while it blocks: the test runs on a worker thread and the cell
awaits it, so the button is heard.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import html
import math
import signal
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from exlnb.bench_result import BenchResult, RateRun, slo_words
from exlnb.engines.base import EosReason, wall_clock
from exlnb.engines.options import check_display
from exlnb.loadtest import Progress, bench
from exlnb.metrics import Distribution, RequestRecord, meets_slos
from exlnb.widgets.frontend import wants_widget
from exlnb.widgets.record import RecordedView
from exlnb.widgets.stream import FRAME_S, Interrupted
from exlnb.workload import Workload, rate_label

REDRAW_S = 0.2  # while no request is sent or ends, elapsed times still move at this pace


@dataclass
class RateProgress:
    """One rate's run as far as it has gone."""

    request_rate: float
    requests: int | None = None  # to send; None where it sends for a duration
    started_at: float | None = None  # wall_clock(); None until the rate starts
    ended_at: float | None = None
    sent: int = 0
    records: list[RequestRecord] = field(default_factory=list)
    run: RateRun | None = None  # once it has ended

    @property
    def state(self) -> str:
        if self.started_at is None:
            return "waiting"
        if self.ended_at is None:
            return "running"
        return "stopped" if self.run is None or self.run.stopped else "done"

    def elapsed_s(self) -> float:
        return ((self.ended_at or wall_clock()) - self.started_at) if self.started_at is not None else 0.0

    def counts(self) -> list[str]:
        """What finished, failed or was cancelled, what is in flight and what is still to send."""
        if self.run is not None:
            return [self.run.count_words()]
        ok = sum(r.succeeded for r in self.records)
        failed = sum(r.eos_reason is EosReason.FAILED for r in self.records)
        of = f"/{self.requests}" if self.requests is not None else ""
        parts = [f"{ok}{of} finished"]
        if failed:
            parts.append(f"{failed} failed")
        if len(self.records) > ok + failed:
            parts.append(f"{len(self.records) - ok - failed} cancelled")
        parts.append(f"{self.sent - len(self.records)} in flight")
        if self.requests is not None and self.ended_at is None:
            parts.append(f"{self.requests - self.sent} to send")
        return parts

    def latencies(self) -> list[str]:
        """Median and p99 TTFT, median TPOT of the requests that have run to their end."""
        ok = [r for r in self.records if r.succeeded]
        if not ok:
            return []
        ttft = Distribution.of_seconds([r.ttft_s for r in ok])
        parts = [f"TTFT median {ttft.median:.0f} ms, p99 {ttft.p99:.0f} ms"]
        tpot = Distribution.of_seconds([r.tpot_s for r in ok if r.tpot_s is not None])
        if tpot.n:
            parts.append(f"TPOT median {tpot.median:.1f} ms")
        return parts

    def slo(self, slos: Mapping[str, float] | None) -> tuple[int, int] | None:
        """Requests that ran to their end and met every objective, and how many ran to their end; None
        where no objective was given."""
        if not slos:
            return None
        ok = [r for r in self.records if r.succeeded]
        return sum(meets_slos(r, slos) for r in ok), len(ok)

    def share(self, duration_s: float | None) -> float:
        """How far along: requests ended of those to send, or time of the duration."""
        if self.requests:
            return len(self.records) / self.requests
        if self.state == "done":
            return 1.0
        return min(1.0, self.elapsed_s() / duration_s) if duration_s else 0.0


class BenchView(RecordedView, Progress):
    """A running load test, a line per rate, with a Stop button; once it ends, a static record of the lines."""

    def __init__(self, stop: threading.Event) -> None:
        super().__init__()
        self.stop = stop
        self.stopped_by: str | None = None  # "stop button" or "interrupt", once one asked
        self.ended = False  # the test is over: rates never started were cut off by a stop
        self.workload: Workload | None = None
        self.rates: list[RateProgress] = []
        self.result: BenchResult | None = None  # once the test has ended with one
        self._lock = threading.Lock()  # the test's thread reports, the cell's loop redraws
        self._rendered_at = 0.0
        self.controls = [["stop", "Stop", "cancel the requests in flight and keep the results so far"]]
        self.render()

    # -- Progress: called on the thread that runs the test ---------------------------------------------

    def started(self, workload: Workload) -> None:
        with self._lock:
            self.workload = workload
            self.rates = [RateProgress(rate) for rate in workload.request_rates]
        self.render()

    def rate_started(self, request_rate: float, requests: int | None) -> None:
        with self._lock:
            current = self._next_rate()
            current.requests, current.started_at = requests, wall_clock()
        self.render()

    def sent(self, count: int) -> None:
        with self._lock:
            self._current().sent += count
        self._render_now_and_then()

    def finished(self, record: RequestRecord) -> None:
        with self._lock:
            self._current().records.append(record)
        self._render_now_and_then()

    def rate_ended(self, run: RateRun | None) -> None:
        with self._lock:
            current = self._current()
            current.run, current.ended_at = run, wall_clock()
        self.render()

    def _next_rate(self) -> RateProgress:
        return next(r for r in self.rates if r.started_at is None)

    def _current(self) -> RateProgress:
        return next(r for r in reversed(self.rates) if r.started_at is not None)

    # -- drawing ------------------------------------------------------------------------------------------

    def _render_now_and_then(self) -> None:
        if wall_clock() - self._rendered_at >= FRAME_S:
            self.render()

    def render(self) -> None:
        with self._lock:
            self._rendered_at = wall_clock()
            self.html = self._html()

    def _html(self) -> str:
        if self.workload is None:
            return f'<div class="exlnb-head exlnb-muted">{self._unstarted_words()}</div>'
        lines = "".join(self._rate_html(rate) for rate in self.rates)
        head = f'<div class="exlnb-head">{html.escape(self._head_words())}</div>'
        return f'<div class="exlnb-bench">{head}<div class="exlnb-samples">{lines}</div>{self._table_html()}</div>'

    def _table_html(self) -> str:
        """Once it has ended: a row per rate, and vLLM's full printout folded under it."""
        if self.result is None or not self.result.runs:
            return ""
        rows = [run.compact_row() for run in self.result.runs]
        head = "".join(f"<th>{html.escape(name)}</th>" for name in rows[0])
        body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row.values()) + "</tr>" for row in rows)
        return (
            f'<table class="exlnb-bench-table"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
            f"<details><summary>vLLM's full printout</summary><pre>{html.escape(self.result.table())}</pre>"
            "</details>"
        )

    def _table_text(self) -> list[str]:
        if self.result is None or not self.result.runs:
            return []
        rows = [run.compact_row() for run in self.result.runs]
        table = [list(rows[0]), *[list(row.values()) for row in rows]]
        widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
        return ["", *("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in table)]

    def _unstarted_words(self) -> str:
        return "the load test did not start: the cell's error says why" if self.ended else "planning the requests"

    def _head_words(self) -> str:
        w = self.workload
        amount = f"for {w.duration_s:g} s" if w.duration_s is not None else f"{w.requests_per_rate} requests"
        head = f"load test: {amount} at {', '.join(rate_label(r) for r in w.request_rates)} req/s"
        if self.stopped_by is None:
            return head
        if self.ended:
            return f"{head} · stopped ({self.stopped_by})"
        return f"{head} · stopping ({self.stopped_by}): cancelling the requests in flight"

    def _state(self, rate: RateProgress) -> tuple[str, str]:
        """The rate's state for the stylesheet, and in words: a rate that has ended with a request that missed
        the objectives is drawn in the error colour, whatever share met them."""
        if rate.started_at is None and self.ended:
            return "stopped", "not run"
        if rate.state != "running" and self._slo_missed(rate):
            return "error", f"{rate.state}, SLO missed"
        return rate.state, rate.state

    def _slo_missed(self, rate: RateProgress) -> bool:
        slo = rate.slo(self.workload.slos)
        return slo is not None and slo[0] < slo[1]

    def _figures(self, rate: RateProgress) -> list[str]:
        if rate.started_at is None:
            return []
        return [*rate.counts(), *rate.latencies(), f"{rate.elapsed_s():.1f} s"]

    def _slo_figure(self, rate: RateProgress) -> str | None:
        slo = rate.slo(self.workload.slos) if rate.started_at is not None else None
        return None if slo is None else f"SLO met by {slo_words(*slo)}"

    def _rate_html(self, rate: RateProgress) -> str:
        state, label = self._state(rate)
        parts = [f'<span class="exlnb-state">{label}</span>']
        parts += [f"<span>{html.escape(words)}</span>" for words in self._figures(rate)]
        if (slo := self._slo_figure(rate)) is not None:
            missed = " exlnb-slo-missed" if self._slo_missed(rate) else ""
            parts.append(f'<span class="exlnb-slo{missed}">{html.escape(slo)}</span>')
        share = rate.share(self.workload.duration_s)
        return (
            f'<div class="exlnb-sample exlnb-{state}"><div class="exlnb-label">{rate_label(rate.request_rate)}'
            f' req/s</div><div class="exlnb-bar"><span style="width:{share:.1%}"></span></div>'
            f'<div class="exlnb-status">{"".join(parts)}</div></div>'
        )

    def text(self) -> str:
        with self._lock:
            if self.workload is None:
                return self._unstarted_words()
            lines = [
                f"{rate_label(r.request_rate)} req/s · "
                + " · ".join([self._state(r)[1], *self._figures(r), *filter(None, [self._slo_figure(r)])])
                for r in self.rates
            ]
            return "\n".join([self._head_words(), *lines, *self._table_text()])

    # -- the button, and the end ---------------------------------------------------------------------------

    def handle(self, message: dict) -> None:
        if message.get("type") == "stop":
            self.ask_to_stop("stop button")

    def ask_to_stop(self, by: str) -> None:
        """Set the test's stop event: it cancels the requests in flight and sends nothing more."""
        if self.stopped_by is None:
            self.stopped_by = by
        self.stop.set()
        self.controls = []
        self.render()

    def finish(self, result: BenchResult | None) -> None:
        """Draw the last state, without the button, and its table where the test ended with a result, and leave
        it as the output's record."""
        self.ended = True
        self.result = result
        self.controls = []
        self.render()
        self.settle()


async def abench(
    request_rate: float | Sequence[float] = math.inf,
    *,
    display: str = "auto",
    stop: threading.Event | None = None,
    progress: bool = True,
    **options,
) -> BenchResult:
    """`exlnb.bench` for a notebook cell: live progress with a Stop button where the front end renders widgets
    (`display` "auto"), always ("widget") or never ("text": a text bar per rate). `progress=False` shows
    nothing while it runs. `options` are `bench`'s.

    Stop ends the run with the results so far: requests in flight are cancelled (counted as failed), later
    ones and later rates are not sent, and the result says so. A kernel interrupt (the cell's task cancelled),
    or Ctrl-C in terminal IPython, does the same, waits until every job of the run has ended, and raises
    `Interrupted`, one line.
    """
    check_display(display)
    stop = stop or threading.Event()
    view = None
    if shows_widget(display, progress):
        view = BenchView(stop)
        view.show()
    running, thread = _in_background(
        bench, request_rate, stop=stop, progress=view if view is not None else progress, **options
    )
    result = None
    try:
        with _ctrl_c_cancels(asyncio.current_task()):
            result = await _await_redrawing(running, view)
        return result
    except asyncio.CancelledError as cancelled:
        result = _stop_and_wait(running, thread, stop, view)
        words = result.stop_words() if result is not None else None
        raise Interrupted(f"interrupted: {words or 'the load test had ended'}") from cancelled
    except BaseException:
        if not running.done():  # an interrupt on the loop's own thread: stop the test first
            _stop_and_wait(running, thread, stop, view)
        raise
    finally:
        if view is not None:
            view.finish(result)


def _in_background(fn, *args, **kwargs) -> tuple[concurrent.futures.Future, threading.Thread]:
    """`fn(*args, **kwargs)` on a daemon thread: its outcome on the returned future, and the thread. A daemon,
    unlike a ThreadPoolExecutor's worker, which the interpreter joins at exit: a test left running under a
    stopped loop held terminal IPython at exit until it had sent every request."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as error:  # noqa: BLE001 - handed to the awaiting cell
            future.set_exception(error)

    thread = threading.Thread(target=run, name="exlnb-bench", daemon=True)
    thread.start()
    return future, thread


@contextmanager
def _ctrl_c_cancels(task: asyncio.Task | None) -> Iterator[None]:
    """Where Ctrl-C raises KeyboardInterrupt (terminal IPython, a script), make it cancel `task` instead.

    Terminal IPython runs `await` with `loop.run_until_complete`: the KeyboardInterrupt rose in the loop's
    select, outside the coroutine, which never heard of it, and the test ran on with its jobs. ipykernel
    installs its own handler while a cell awaits (it cancels the cell's task), and that one is left alone.
    """
    if (
        task is None
        or threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    loop = asyncio.get_running_loop()
    signal.signal(signal.SIGINT, lambda signum, frame: loop.call_soon_threadsafe(task.cancel))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def shows_widget(display: str, progress: bool) -> bool:
    """Whether `abench` shows the live view, whose record then holds the results' table: `%exl_bench` prints
    vLLM's printout only where it does not (45 lines a rate under the widget were too many)."""
    return progress and wants_widget(display)


async def _await_redrawing(running: concurrent.futures.Future, view: BenchView | None) -> BenchResult:
    """The test's result; meanwhile the view is redrawn, so elapsed times move while no request ends."""
    waiting = asyncio.wrap_future(running)
    try:
        while not waiting.done():
            await asyncio.wait({waiting}, timeout=REDRAW_S)
            if view is not None:
                view.render()
    except BaseException:
        waiting.cancel()  # the test runs on; the caller stops it and waits
        raise
    return waiting.result()


def _stop_and_wait(
    running: concurrent.futures.Future, thread: threading.Thread, stop: threading.Event, view: BenchView | None
) -> BenchResult | None:
    """Stop the test after an interrupt and wait: its jobs and its thread have ended when this returns. Its
    result, if any."""
    if view is not None:
        view.ask_to_stop("interrupt")
    stop.set()
    concurrent.futures.wait([running])
    thread.join()  # it has set the future: what is left of it is its return
    if running.cancelled() or running.exception() is not None:
        return None
    return running.result()
