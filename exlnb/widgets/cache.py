"""The cache inspector (pages coloured by owner job) and the job table (with Cancel buttons).

Both read `session.cache_view()` and `session.jobs()` and nothing else. Field report 1 is what they make
visible: a job nobody reads any more still holds pages and still counts in the batch.
"""

from __future__ import annotations

import html
from collections.abc import Mapping

from exlnb.engines.base import StreamEvent, wall_clock
from exlnb.engines.options import check_display
from exlnb.engines.views import CacheView, PageInfo, memory_per_gpu_text
from exlnb.session import JobRow, Session, get_session
from exlnb.widgets.frontend import wants_widget
from exlnb.widgets.live import LiveView

# matplotlib's tab10: ten colours told apart easily, also by most colour-blind readers, on light and dark
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def job_color(job_id: int) -> str:
    return PALETTE[job_id % len(PALETTE)]


def page_cell(page: PageInfo, page_size: int) -> tuple[str, str, str]:
    """(inline style, tooltip, kind) of one page; kind is used, shared, cached or free.

    Used pages are filled in their job's colour up to the tokens written and outlined in it, so a page a
    job has reserved but not yet written is an outline of its colour, never a free page; free pages are
    grey outlines, dashed when they still hold a prompt prefix a new job can reuse.
    """
    if page.ref_count == 0:
        kind = "cached" if page.cached else "free"
        return "", f"page {page.index}: {'free, keeps a reusable prefix' if page.cached else 'free'}", kind
    colors = [job_color(o) for o in page.owners]
    if len(colors) > 1:  # stripes of every owner's colour
        stops = ", ".join(f"{c} {i * 3}px {(i + 1) * 3}px" for i, c in enumerate(colors))
        background = f"repeating-linear-gradient(45deg, {stops})"
    else:
        fill = 100 * page.tokens_filled / page_size if page_size else 100
        background = f"linear-gradient(to top, {colors[0]} {fill:.0f}%, transparent {fill:.0f}%)"
    owners = ", ".join(str(o) for o in page.owners)
    title = f"page {page.index}: job {owners}, {page.tokens_filled}/{page_size} tokens, {page.ref_count} refs"
    return f"--exlnb-owner:{colors[0]};background:{background}", title, "shared" if page.shared else "used"


def page_square(style: str, title: str, kind: str) -> str:
    return f'<span class="exlnb-page exlnb-{kind}" style="{style}" title="{html.escape(title)}"></span>'


def cache_summary(view: CacheView) -> str:
    if not view.pages:  # an engine without a page map (a server's cache is the server's): nothing to count
        return f"this engine shows no cache pages · {view.max_tokens} tokens of context"
    used = view.total_pages - view.free_pages
    cached = sum(1 for p in view.pages if p.cached and p.ref_count == 0)
    defrags = f" · {view.defrag_count} defrags" if view.defrag_count is not None else ""
    mode = f"{view.page_size}-token pages" if view.paged else "unpaged (one sequence at a time)"
    return (
        f"{used} of {view.total_pages} pages in use ({view.shared_pages} shared), {view.free_pages} free "
        f"({cached} keep a reusable prefix) · {view.used_tokens} of {view.max_tokens} tokens · {mode}{defrags}"
        f"{gpu_memory_note(view)}"
    )


def gpu_memory_note(view: CacheView) -> str:
    """' · cuda:0 8.38 GiB + cuda:1 8.19 GiB' where the model spans several GPUs, else nothing."""
    per_gpu = view.device_memory_per_gpu
    return f" · {memory_per_gpu_text(per_gpu)}" if sum(1 for b in per_gpu if b) > 1 else ""


def job_label(row: JobRow) -> str:
    name = f" {row.info.identifier}" if row.info.identifier is not None else ""
    return f"job {row.info.job_id}{name}"


def inspector_html(view: CacheView, rows: list[JobRow]) -> str:
    """The inspector's markup: summary, one square per page, and a legend naming each job's colour."""
    grid = "".join(page_square(*page_cell(p, view.page_size)) for p in view.pages)
    swatches = [
        (
            f"--exlnb-owner:{job_color(r.info.job_id)};background:{job_color(r.info.job_id)}",
            "used",
            f"{job_label(r)} ({r.info.stage.value}, {r.info.pages} pages{'' if r.consumed else ', nobody reading'})",
        )
        for r in rows
    ]
    swatches += [("", "free", "free"), ("", "cached", "free, keeps a reusable prefix")]
    legend = "".join(f"<span>{page_square(s, t, k)}{html.escape(t)}</span>" for s, k, t in swatches)
    legend += f"<span>{page_square('--exlnb-owner:transparent', 'shared', 'shared')}shared by several jobs</span>"
    return (
        f'<div class="exlnb-cache"><div class="exlnb-summary">{html.escape(cache_summary(view))}</div>'
        f'<div class="exlnb-grid">{grid}</div><div class="exlnb-legend">{legend}</div></div>'
    )


def cache_text(view: CacheView, rows: list[JobRow]) -> str:
    """The inspector as plain text: one character per page (job id's last digit, * shared, . free)."""

    def mark(p: PageInfo) -> str:
        return "." if p.ref_count == 0 else "*" if p.shared else str(p.owners[0] % 10)

    grid = "".join(mark(p) for p in view.pages)
    lines = [cache_summary(view)] + [grid[i : i + 64] for i in range(0, len(grid), 64)]
    return "\n".join(lines + [f"{r.info.job_id % 10}: {job_label(r)}, {r.info.pages} pages" for r in rows])


class CacheInspector(LiveView):
    """Every page of the KV cache as a square: filled in its job's colour, ringed when shared, outlined when free."""

    def draw(self, rows: list[JobRow]) -> tuple[str, str]:
        view = self.session.cache_view()
        return inspector_html(view, rows), cache_text(view, rows)


JOB_COLUMNS = ("job", "stage", "age", "prompt tokens", "new / max", "pages", "stream read")
# what a reader asks of the table's less obvious words, as each heading's tooltip
JOB_HEADINGS = {
    "age": "time since the job was submitted (for a job that has ended: how long it ran)",
    "pages": "KV-cache pages the job holds now",
    "stream read": "whether something still reads the job's stream (a widget, a loop over it): a job nobody reads "
    "still holds its pages and a batch slot until it ends or is cancelled (field report 1)",
}
STREAM_READ_LEGEND = (
    "stream read: whether something still reads the job's answer as it comes; a job nobody reads "
    "still holds its pages and a batch slot"
)
Ended = Mapping[int, StreamEvent]  # the last events of jobs that have ended, by job id


def job_cells(row: JobRow, now: float, ended: StreamEvent | None = None) -> list[str]:
    """A job's row as the engine last showed it, or, for a job that has ended (`ended`, its last event), how it
    ended: a table that settles into its record says 400 / 400, not the 395 it last saw running."""
    info = row.info
    read = "yes" if row.consumed else ("no (runs on by request)" if row.abandoned_ok else "no")
    if ended is not None:
        stage = f"ended: {ended.eos_reason.words}" if ended.eos_reason else "ended"
        return [
            job_label(row),
            stage,
            f"{ended.time_produced - info.time_enqueued:.0f} s",
            str(info.prompt_tokens),
            f"{ended.new_tokens} / {info.max_new_tokens}",
            "freed",
            read,
        ]
    return [
        job_label(row),
        info.stage.value,
        f"{now - info.time_enqueued:.0f} s",
        str(info.prompt_tokens),
        f"{info.new_tokens} / {info.max_new_tokens}",
        str(info.pages),
        read,
    ]


def jobs_summary(rows: list[JobRow], view: CacheView | None = None) -> str:
    """'4 jobs, each read by its stream', or how many nobody reads and what that costs, or that there are none."""
    memory = gpu_memory_note(view) if view is not None else ""
    if not rows:
        return "no pending or active jobs" + memory
    unread = sum(not r.consumed for r in rows)
    jobs = f"{len(rows)} job{'s' if len(rows) > 1 else ''}"
    if not unread:
        read = "read by its stream" if len(rows) == 1 else "each read by its stream"
        return f"{jobs}, {read}{memory}"
    holds = "it still holds" if unread == 1 else "they still hold"
    return f"{jobs}, {unread} with nobody reading its stream ({holds} cache pages and a batch slot){memory}"


def jobs_html(rows: list[JobRow], now: float, view: CacheView | None = None, ended: Ended | None = None) -> str:
    """The job table's markup: a row per job with its colour and a Cancel button, Cancel all, and a legend of the
    stream-read column; a job in `ended` is drawn as it ended."""
    ended = ended or {}

    def row(r: JobRow) -> str:
        colour = job_color(r.info.job_id)
        cancel = f'<button class="exlnb-cancel" data-action="cancel" data-job="{r.info.job_id}">Cancel</button>'
        cells = "</td><td>".join(html.escape(c) for c in job_cells(r, now, ended.get(r.info.job_id)))
        square = page_square(f"--exlnb-owner:{colour};background:{colour}", "", "used")
        return f"<tr><td>{square}{cells}</td><td>{cancel}</td></tr>"

    def heading(column: str) -> str:
        title = JOB_HEADINGS.get(column)
        return f'<th title="{html.escape(title)}">{column}</th>' if title else f"<th>{column}</th>"

    body = "".join(row(r) for r in rows)
    header = "".join(heading(c) for c in JOB_COLUMNS)
    legend = f'<div class="exlnb-legend exlnb-muted">{html.escape(STREAM_READ_LEGEND)}</div>'
    table = f"<table><thead><tr>{header}<th></th></tr></thead><tbody>{body}</tbody></table>{legend}" if rows else ""
    cancel_all = '<button class="exlnb-cancel-all" data-action="cancel_all">Cancel all</button>' if rows else ""
    summary = html.escape(jobs_summary(rows, view))
    return f'<div class="exlnb-jobs"><div class="exlnb-summary">{summary}</div>{table}{cancel_all}</div>'


def jobs_text(rows: list[JobRow], view: CacheView | None = None, ended: Ended | None = None) -> str:
    if not rows:
        return jobs_summary(rows, view)
    now, ended = wall_clock(), ended or {}
    table = [list(JOB_COLUMNS)] + [job_cells(r, now, ended.get(r.info.job_id)) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(JOB_COLUMNS))]
    memory = gpu_memory_note(view).removeprefix(" · ") if view is not None else ""
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in table]
    return "\n".join(lines + ([memory] if memory else []))


class JobTable(LiveView):
    """Pending and active jobs: age, tokens, whether anyone reads the stream; Cancel each, Cancel all."""

    def draw(self, rows: list[JobRow], ended: Ended | None = None) -> tuple[str, str]:
        view = self.session.cache_view()
        return jobs_html(rows, wall_clock(), view, ended), jobs_text(rows, view, ended)

    def last_state(self, rows: list[JobRow]) -> tuple[str, str]:
        """The jobs last seen running, each as it ended."""
        ended = {r.info.job_id: event for r in rows if (event := self.session.ended(r.info.job_id)) is not None}
        return self.draw(rows, ended)

    def act(self, message: dict) -> None:
        if message.get("type") == "cancel":
            self.session.request_cancel(int(message["job"]))
        elif message.get("type") == "cancel_all":
            self.session.request_cancel_all()


def show_cache(session: Session | None = None, *, display: str = "auto") -> None:
    """Display the cache inspector where widgets render, plain text otherwise.

    For a handle (to `close()` it, or read `refresh_count`), `CacheInspector(get_session()).show()` yourself.
    """
    _show(CacheInspector, lambda s: cache_text(s.cache_view(), s.jobs()), session, display)


def show_jobs(session: Session | None = None, *, display: str = "auto") -> None:
    """Display the job table where widgets render, plain text otherwise."""
    _show(JobTable, lambda s: jobs_text(s.jobs(), s.cache_view()), session, display)


def _show(widget: type[LiveView], as_text, session: Session | None, display: str) -> None:
    session = session or get_session()
    check_display(display)
    if wants_widget(display):
        widget(session).show()
    else:
        print(as_text(session))
