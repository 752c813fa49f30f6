"""Whether output can be a live widget, or must be plain text."""

from __future__ import annotations

import os


def widget_frontend() -> bool:
    """Whether output lands in a front end that renders widgets.

    A kernel started by a Jupyter server for a notebook (JupyterLab, Notebook 7) has JPY_SESSION_NAME set
    by jupyter_server; papermill and nbclient start kernels without one and terminal IPython has no kernel.
    """
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None and "JPY_SESSION_NAME" in os.environ


def wants_widget(display: str) -> bool:
    """Whether `display` ("auto", "widget" or "text") asks for a widget here."""
    return display == "widget" or (display == "auto" and widget_frontend())
