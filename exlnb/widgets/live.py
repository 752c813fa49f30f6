"""A widget that shows session state and keeps it current only while someone can see it and jobs run.

The front end reports each view's visibility (on screen, browser tab in front); a refresh thread redraws
every `interval` seconds while a view is visible and jobs are running, checks for new jobs every
`idle_check` seconds otherwise, and sleeps while every view is hidden and it has shown no jobs yet. Once
the jobs it showed have all ended and none has started for `retire_after` seconds, the view settles into a
static record of its last state with jobs (see `exlnb.widgets.record`); `%exl_cache` again shows a live one.
"""

from __future__ import annotations

import html
import threading
import time

from exlnb.session import JobRow, NoModelLoaded, Session
from exlnb.widgets.record import RecordedView

LIVE = "live: redrawn while jobs run and this view can be seen"
IDLE = "idle: no job is running"


def liveness_html(words: str) -> str:
    """Whether the view is live, idle, or a record whose jobs had ended: said once, under what it shows, and
    hidden by the front end once the kernel has gone (view.js)."""
    return f'<div class="exlnb-liveness exlnb-muted">{html.escape(words)}</div>'


class LiveView(RecordedView):
    def __init__(
        self, session: Session, *, interval: float = 0.5, idle_check: float = 1.0, retire_after: float = 5.0
    ) -> None:
        super().__init__()
        self.session = session
        self.interval = interval
        self.idle_check = idle_check
        self.retire_after = retire_after
        self.refreshing = False  # redrawing on a timer right now (jobs running and a view visible)
        self.refresh_count = 0
        self._busy: list[JobRow] | None = None  # the jobs of the last state drawn with jobs running
        self._busy_drawn: tuple[str, str] = ("", "")  # that state's html and text
        self._visible_views: set[str] = set()
        self._stale = False  # a view came into sight: draw once, whether or not jobs run
        self._after_action = False  # a button acted: the next drawing is not a state to settle into
        self._wake = threading.Event()
        self._closed = False
        self.refresh()
        self._thread = threading.Thread(target=self._run, name=f"exlnb-{type(self).__name__}", daemon=True)
        self._thread.start()

    # subclasses: the state as HTML and as text, drawn from the job rows that decide whether jobs are running
    def draw(self, rows: list[JobRow]) -> tuple[str, str]:
        raise NotImplementedError

    def act(self, message: dict) -> None:
        """A button's message (e.g. a Cancel click); the view redraws after it."""

    def last_state(self, rows: list[JobRow]) -> tuple[str, str]:
        """The last state with jobs (`rows`) as the record keeps it once they have all ended: as it was drawn, unless
        a view can say how each job ended."""
        return self._busy_drawn

    def refresh(self, *, record: bool = True) -> bool:
        """Redraw; whether jobs are running. `record=False`: not a state to settle into (jobs being cancelled)."""
        try:
            # one read of the job table for both: a second read could find the jobs ended since, and a state
            # recorded as running would then show no job (the table's record after a Cancel all did)
            rows = self.session.jobs()
            running = bool(rows)
            drawn, self._text = self.draw(rows)
        except NoModelLoaded as error:
            running = False
            drawn, self._text = f'<div class="exlnb-summary">{html.escape(str(error))}</div>', str(error)
        if running and record:
            self._busy, self._busy_drawn = rows, (drawn, self._text)
        self.html = drawn + liveness_html(LIVE if running else IDLE)
        self.refresh_count += 1
        return running

    def text(self) -> str:
        return self._text

    @property
    def visible(self) -> bool:
        return bool(self._visible_views)

    def handle(self, message: dict) -> None:
        if message.get("type") == "visible":
            if message["visible"]:
                self._visible_views.add(message["view"])
                self._stale = True
            else:
                self._visible_views.discard(message["view"])
            self._wake.set()
        else:  # on the kernel's event loop: queue the action, let the refresh thread redraw after it
            self.act(message)
            self._after_action = True
            self._stale = True
            self._wake.set()

    def retire(self) -> None:
        """Settle into the last state that had jobs, saying when they had all ended."""
        if self._busy is not None:
            busy_html, busy_text = self.last_state(self._busy)
            ended = f"all these jobs had ended by {time.strftime('%H:%M:%S')}"
            self.html = busy_html + liveness_html(ended)
            self._text = f"{busy_text}\n{ended}"
        self.settle()

    def _jobs_running(self) -> bool:
        try:
            return bool(self.session.jobs())
        except NoModelLoaded:
            return False

    def _run(self) -> None:
        running, idle_since = True, None
        while not self._closed:
            if not self._visible_views and self._busy is None and not self._after_action:
                self.refreshing = False
                self._wake.wait()
            elif (self._visible_views and (running or self._stale)) or self._after_action:
                self._stale, acted, self._after_action = False, self._after_action, False
                running = self.refresh(record=not acted)
                self.refreshing = running
                self._wake.wait(self.interval)
            else:
                self.refreshing = False
                running = self._jobs_running()
                idle_since = None if running else idle_since or time.monotonic()
                if (
                    self._busy is not None
                    and idle_since is not None
                    and time.monotonic() - idle_since >= self.retire_after
                ):
                    self.retire()
                    return
                self._wake.wait(self.idle_check)
            self._wake.clear()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        super().close()
