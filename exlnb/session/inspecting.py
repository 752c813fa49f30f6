"""Inspecting: the job table and the cache's pages, read without waiting for an engine step."""

from __future__ import annotations

from dataclasses import dataclass

from exlnb.engine_thread import EngineStopped, EngineViews
from exlnb.engines.base import CacheView, JobInfo, StreamEvent
from exlnb.session.base import NoModelLoaded, SessionBase


@dataclass(frozen=True)
class JobRow:
    """A job as the job table shows it: the engine's view plus whether anyone still reads its stream."""

    info: JobInfo
    consumed: bool  # a consumer is iterating the stream right now
    abandoned_ok: bool  # submitted with cancel_when_abandoned=False (runs on with nobody reading)


class Inspecting(SessionBase):
    """What `%exl_jobs`, `%exl_cache` and the widgets show."""

    def jobs(self) -> list[JobRow]:
        """Pending and active jobs with whether their streams are being read; during a long step, as the engine
        last published them (`EngineThread.views`), so a view waits for no step unless a command was queued
        before it (a cancel asked for without waiting), which it shows."""
        return [
            JobRow(info, self._deliveries.consumed(info.job_id), self._deliveries.detached(info.job_id))
            for info in self._views().jobs
        ]

    def ended(self, job_id: int) -> StreamEvent | None:
        """The last event of a job that has ended lately: how a job table that saw it running says it ended."""
        return self._deliveries.ended(job_id)

    def cache_view(self) -> CacheView:
        """The KV cache's pages; like `jobs`, never waits for a step (a long prefill held `%exl_cache` 3-5 s)."""
        return self._views().cache

    def _views(self) -> EngineViews:
        try:
            return self._engine_thread().views()
        except EngineStopped:
            raise NoModelLoaded() from None
