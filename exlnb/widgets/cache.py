"""The cache inspector (pages coloured by owner job) and the job table (with Cancel buttons).

Both read `session.cache_view()` and `session.jobs()` and nothing else. Field report 1 is what they make
visible: a job nobody reads any more still holds pages and still counts in the batch.
"""

from __future__ import annotations

import html

import traitlets

from exlnb.engines.base import CacheView, PageInfo, wall_clock
from exlnb.engines.options import check_display
from exlnb.session import JobRow, Session, get_session
from exlnb.widgets.frontend import widget_frontend
from exlnb.widgets.live import LiveView, front_end_module

# matplotlib's tab10: ten colours told apart easily, also by most colour-blind readers
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
FREE = "#f1f1f1"
CACHED = "#e3f4f1"  # free, but still holding a prompt prefix that a new job can reuse


def job_color(job_id: int) -> str:
    return PALETTE[job_id % len(PALETTE)]


def page_cell(page: PageInfo, page_size: int) -> tuple[str, str, str]:
    """(CSS background, tooltip, kind) of one page: kind is used, shared, cached or free."""
    if page.ref_count == 0:
        kind = "cached" if page.cached else "free"
        return (CACHED if page.cached else FREE), f"page {page.index}: {kind}", kind
    colors = [job_color(o) for o in page.owners]
    if len(colors) > 1:  # stripes of every owner's colour
        stops = ", ".join(f"{c} {i * 4}px {(i + 1) * 4}px" for i, c in enumerate(colors))
        background = f"repeating-linear-gradient(45deg, {stops})"
    else:
        fill = 100 * page.tokens_filled / page_size if page_size else 100
        background = f"linear-gradient(to top, {colors[0]} {fill:.0f}%, {FREE} {fill:.0f}%)"
    owners = ", ".join(str(o) for o in page.owners)
    title = f"page {page.index}: job {owners}, {page.tokens_filled}/{page_size} tokens, {page.ref_count} refs"
    return background, title, "shared" if page.shared else "used"


def cache_summary(view: CacheView) -> str:
    used = view.total_pages - view.free_pages
    cached = sum(1 for p in view.pages if p.cached and p.ref_count == 0)
    defrags = f" · {view.defrag_count} defrags" if view.defrag_count is not None else ""
    mode = f"{view.page_size}-token pages" if view.paged else "unpaged (one sequence at a time)"
    return (
        f"{used} of {view.total_pages} pages in use ({view.shared_pages} shared), {view.free_pages} free "
        f"({cached} keep a reusable prefix) · {view.used_tokens} of {view.max_tokens} tokens · {mode}{defrags}"
    )


def job_label(row: JobRow) -> str:
    name = f" {row.info.identifier}" if row.info.identifier is not None else ""
    return f"job {row.info.job_id}{name}"


class CacheInspector(LiveView):
    """Every page of the KV cache as a square: coloured by owner job, outlined when shared, pale when free."""

    _esm = front_end_module("cache.js")
    cells = traitlets.List().tag(sync=True)
    legend = traitlets.Unicode("").tag(sync=True)

    def draw(self, running: bool) -> None:
        view, rows = self.session.cache_view(), self.session.jobs()
        with self.hold_sync():
            self.cells = [list(page_cell(p, view.page_size)) for p in view.pages]
            self.summary = html.escape(cache_summary(view)) + (" · live" if running else " · idle")
            swatches = [(job_color(r.info.job_id), f"{job_label(r)} ({r.info.stage.value}, {r.info.pages} pages)")
                        for r in rows]
            swatches += [(FREE, "free"), (CACHED, "free, reusable prefix")]
            self.legend = "".join(
                f'<span><span class="swatch" style="background:{c}"></span>{html.escape(t)}</span>' for c, t in swatches
            ) + "<span>outlined: shared by several jobs</span>"


JOB_COLUMNS = ("job", "stage", "age", "prompt tokens", "new / max", "pages", "stream read")


def job_cells(row: JobRow, now: float) -> list[str]:
    info = row.info
    read = "yes" if row.consumed else ("no (runs on by request)" if row.abandoned_ok else "no")
    return [
        job_label(row), info.stage.value, f"{now - info.time_enqueued:.1f} s", str(info.prompt_tokens),
        f"{info.new_tokens} / {info.max_new_tokens}", str(info.pages), read,
    ]


class JobTable(LiveView):
    """Pending and active jobs: age, tokens, whether anyone reads the stream; Cancel each, Cancel all."""

    _esm = front_end_module("jobs.js")
    columns = traitlets.List(list(JOB_COLUMNS)).tag(sync=True)
    rows = traitlets.List().tag(sync=True)

    def draw(self, running: bool) -> None:
        rows, now = self.session.jobs(), wall_clock()
        with self.hold_sync():
            self.rows = [{"job_id": r.info.job_id, "cells": [html.escape(c) for c in job_cells(r, now)]} for r in rows]
            unread = sum(not r.consumed for r in rows)
            self.summary = f"{len(rows)} jobs, {unread} with nobody reading" if rows else "no pending or active jobs"

    def handle(self, message: dict) -> None:
        if message.get("type") == "cancel":
            self.session.cancel(int(message["job_id"]))
        elif message.get("type") == "cancel_all":
            self.session.cancel_all()


def cache_text(view: CacheView, rows: list[JobRow]) -> str:
    """The inspector as plain text: one character per page (job id's last digit, * shared, . free)."""
    def mark(p: PageInfo) -> str:
        return "." if p.ref_count == 0 else "*" if p.shared else str(p.owners[0] % 10)

    grid = "".join(mark(p) for p in view.pages)
    lines = [cache_summary(view)] + [grid[i : i + 64] for i in range(0, len(grid), 64)]
    return "\n".join(lines + [f"{r.info.job_id % 10}: {job_label(r)}, {r.info.pages} pages" for r in rows])


def jobs_text(rows: list[JobRow]) -> str:
    if not rows:
        return "no pending or active jobs"
    now = wall_clock()
    table = [list(JOB_COLUMNS)] + [job_cells(r, now) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(JOB_COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in table)


def show_cache(session: Session | None = None, *, display: str = "auto") -> None:
    """Display the cache inspector where widgets render, plain text otherwise.

    For a handle (to `close()` it, or read `refresh_count`), display `CacheInspector(get_session())` yourself.
    """
    _show(CacheInspector, lambda s: cache_text(s.cache_view(), s.jobs()), session, display)


def show_jobs(session: Session | None = None, *, display: str = "auto") -> None:
    """Display the job table where widgets render, plain text otherwise."""
    _show(JobTable, lambda s: jobs_text(s.jobs()), session, display)


def _show(widget: type[LiveView], as_text, session: Session | None, display: str) -> None:
    from IPython.display import display as show

    session = session or get_session()
    check_display(display)
    if display == "widget" or (display == "auto" and widget_frontend()):
        show(widget(session))
    else:
        print(as_text(session))
