"""A widget that shows session state and keeps it current only while someone can see it and jobs run.

The front end reports each view's visibility (on screen, browser tab in front); a refresh thread redraws
every `interval` seconds while a view is visible and jobs are running, checks for new jobs once a second
while visible and idle, and sleeps while every view is hidden or closed.
"""

from __future__ import annotations

import threading
from pathlib import Path

import anywidget
import traitlets

from exlnb.session import NoModelLoaded, Session

ASSETS = Path(__file__).parent


def front_end_module(name: str) -> str:
    """An ES module for anywidget: the shared visibility watcher, then the widget's own code."""
    return (ASSETS / "visibility.js").read_text() + (ASSETS / name).read_text()


class LiveView(anywidget.AnyWidget):
    _css = (ASSETS / "live.css").read_text()
    summary = traitlets.Unicode("").tag(sync=True)

    def __init__(self, session: Session, *, interval: float = 0.5, idle_check: float = 1.0) -> None:
        super().__init__()
        self.session = session
        self.interval = interval
        self.idle_check = idle_check
        self.refreshing = False  # redrawing on a timer right now (jobs running and a view visible)
        self.refresh_count = 0
        self._visible_views: set[str] = set()
        self._wake = threading.Event()
        self._closed = False
        self.on_msg(self._on_front_end_message)
        self.refresh()
        self._thread = threading.Thread(target=self._run, name=f"exlnb-{type(self).__name__}", daemon=True)
        self._thread.start()

    # subclasses: draw the current state; return whether jobs are running
    def draw(self, running: bool) -> None:
        raise NotImplementedError

    def handle(self, message: dict) -> None:
        """A message from the front end other than visibility (e.g. a Cancel click)."""

    def refresh(self) -> bool:
        try:
            running = bool(self.session.jobs())
            self.draw(running)
        except NoModelLoaded as error:
            self.summary = str(error)
            running = False
        self.refresh_count += 1
        return running

    @property
    def visible(self) -> bool:
        return bool(self._visible_views)

    def _on_front_end_message(self, _widget, content: dict, _buffers) -> None:
        if content.get("type") == "visible":
            if content["visible"]:
                self._visible_views.add(content["view"])
            else:
                self._visible_views.discard(content["view"])
            self._wake.set()
        else:
            self.handle(content)
            self.refresh()

    def _run(self) -> None:
        running = True
        while not self._closed:
            if not self._visible_views:
                self.refreshing = False
                self._wake.wait()
            elif running:
                running = self.refresh()
                self.refreshing = running
                self._wake.wait(self.interval)
            else:
                try:
                    running = bool(self.session.jobs())
                except NoModelLoaded:
                    running = False
                self._wake.wait(self.idle_check)
            self._wake.clear()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        super().close()
