"""The kernel-resident session: one model, one cache, one generator per kernel process.

Every cell, widget, magic and background job talks to `get_session()`. Field report 2 is what happens
otherwise: generators created per request, sharing one cache, write over each other's pages.

A `Session` is built of parts over the one thread that owns its engine (`base.py`): loading (`loading.py`: what to
load, checked whole before the loaded model is touched; load, replace, unload), submitting (`submitting.py`: a
prompt and its options made into the engine's job, queued, cancelled), exploring (`exploring.py`: a prompt's
samples grown into one tree) and inspecting (`inspecting.py`: the job table and the cache). Delivering events to
streams is `exlnb.streaming.Deliveries`' job.
"""

from __future__ import annotations

import atexit
import threading

from exlnb.session.base import NoModelLoaded
from exlnb.session.exploring import Exploring, TreeGrowth
from exlnb.session.inspecting import Inspecting, JobRow
from exlnb.session.loading import LoadFailed, Loading, LoadOptions

__all__ = ["JobRow", "LoadFailed", "LoadOptions", "NoModelLoaded", "Session", "TreeGrowth", "get_session"]


class Session(Loading, Exploring, Inspecting):
    """Owns the engine and its thread; hands out `JobStream`s. Safe to use from any thread or task."""


_session: Session | None = None
_session_lock = threading.Lock()


def get_session() -> Session:
    """The kernel's one session, created on first use, unloaded when the process exits (an engine thread
    stopped in the middle of a forward pass at interpreter shutdown aborts the process)."""
    global _session
    with _session_lock:
        if _session is None:
            _session = Session()
            atexit.register(_session.unload)
        return _session
