"""A widget that leaves a record: live while there is something to watch, then static HTML in the notebook.

A widget's output holds only a reference to a model that lives in the kernel: saved, exported or reopened once
the kernel has gone, it reads "Error displaying widget: model not found" (nbconvert and GitHub show its repr).
So every exlnb widget is shown under a display id and, once it has nothing more to show, `settle()` replaces
that output with its last state as HTML (with the stylesheet, so it looks the same) and plain text, and closes
the widget. JupyterLab 4 keeps a cell's execute future after the cell ends (@jupyterlab/outputarea calls
`requestExecute(content, false)`), so the update also lands when it comes from a background thread later.

A kernel that restarts or dies never settles its views. Then the front end writes the last state a view holds
into its output instead (view.js), found in the notebook by the widget's model id (`model_key`), so nothing that
was on screen is lost on save.
"""

from __future__ import annotations

import threading
from pathlib import Path
from uuid import uuid4

import anywidget
import traitlets

ASSETS = Path(__file__).parent
STYLESHEET = (ASSETS / "exlnb.css").read_text()


def record_html(body: str) -> str:
    """`body` as output that needs no widget: the stylesheet, then the markup the live view showed."""
    return f'<style>{STYLESHEET}</style><div class="exlnb exlnb-record">{body}</div>'


class RecordedView(anywidget.AnyWidget):
    """HTML drawn here (`html`), buttons under it (`controls`: [action, label, tooltip]); one widget per output."""

    _esm = (ASSETS / "view.js").read_text()
    _css = STYLESHEET
    html = traitlets.Unicode("").tag(sync=True)
    controls = traitlets.List().tag(sync=True)
    model_key = traitlets.Unicode("").tag(sync=True)  # the model id, which the view's output in the notebook names

    def __init__(self) -> None:
        super().__init__()
        self.model_key = self.model_id
        self.display_id: str | None = None
        self.settled = False
        self._display_lock = threading.Lock()
        self.on_msg(lambda _widget, content, _buffers: self.handle(content))

    def text(self) -> str:
        """The record as plain text (nbconvert's text output, GitHub without HTML, a terminal)."""
        raise NotImplementedError

    def handle(self, message: dict) -> None:
        """A message from the front end: a button's action, or whether a view can be seen."""

    def record(self) -> dict[str, str]:
        return {"text/html": record_html(self.html), "text/plain": self.text()}

    def _repr_mimebundle_(self, **kwargs) -> tuple[dict, dict]:
        # front ends without the widget manager (nbconvert, GitHub) fall back to the state when displayed
        data, metadata = super()._repr_mimebundle_(**kwargs)
        return {**data, **self.record()}, metadata

    def show(self) -> None:
        """Display the live view (its record, if it has already settled) under a display id of its own."""
        from IPython.display import display

        with self._display_lock:
            self.display_id = uuid4().hex
            display(self.record() if self.settled else self, raw=self.settled, display_id=self.display_id)

    def settle(self) -> None:
        """Leave the current state as the output's static record and close the widget; only the first call acts."""
        from IPython.display import update_display

        with self._display_lock:
            if self.settled:
                return
            self.settled = True
            if self.display_id is not None:
                update_display(self.record(), raw=True, display_id=self.display_id)
        self.close()
