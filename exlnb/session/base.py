"""What every part of the session shares: the thread that owns the loaded engine, and the calls that reach it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

from exlnb.engine_thread import EngineStopped, EngineThread
from exlnb.engines.base import Engine, EngineStatus, Tokenizer
from exlnb.engines.options import EngineOptions
from exlnb.streaming import Deliveries

T = TypeVar("T")


class NoModelLoaded(RuntimeError):
    def __init__(self) -> None:
        super().__init__("no model is loaded: call get_session().load() or run %exl_load first")


class SessionBase:
    """The engine thread (None while nothing is loaded), the options it was loaded with, and the deliveries of
    its jobs' events. The engine is reached only through the thread, the one that ever calls it."""

    def __init__(self) -> None:
        self._load_lock = threading.RLock()  # load/unload; held while waiting on the engine thread
        self._thread: EngineThread | None = None
        self._options: EngineOptions | None = None
        self._deliveries = Deliveries()

    @property
    def loaded(self) -> bool:
        return self._thread is not None

    @property
    def options(self) -> EngineOptions | None:
        """What is loaded (None when nothing is)."""
        return self._options

    def _engine_thread(self) -> EngineThread:
        thread = self._thread
        if thread is None:
            raise NoModelLoaded()
        return thread

    def _call(self, fn: Callable[[Engine], T]) -> T:
        try:
            return self._engine_thread().call(fn)
        except EngineStopped:
            raise NoModelLoaded() from None

    async def _acall(self, fn: Callable[[Engine], T]) -> T:
        """`_call` for a coroutine: awaits the engine thread's answer, so the event loop never waits for a step."""
        try:
            return await asyncio.wrap_future(self._engine_thread().submit(fn))
        except EngineStopped:
            raise NoModelLoaded() from None

    def status(self) -> EngineStatus:
        return self._call(lambda engine: engine.status())

    @property
    def tokenizer(self) -> Tokenizer:
        return self._engine_thread().engine.tokenizer

    @property
    def engine(self) -> Engine:
        """The engine itself, for experiments that compare against driving it by hand.

        Call it only through `run_on_engine` while the session runs, so that one thread owns it.
        """
        return self._engine_thread().engine

    def run_on_engine(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        return self._call(fn)
