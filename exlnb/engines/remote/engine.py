"""The openai engine: jobs streamed from an OpenAI-compatible server, side by side, handed over by `step()`.

Each job's request runs as a task on an asyncio loop of the engine's own (one thread), so every stream is read as
it arrives, however many are open; `step()` only collects what arrived and turns it into events. `cancel()`
cancels the job's task, which leaves the stream's `async with` and so closes its connection at once: a Stop
button, a kernel interrupt and an abandoned stream all reach the server as the client going away. A request that
fails fails its job alone (`JobFailed`), with the server's own message.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from pathlib import Path

import httpx

from exlnb.engines.base import (
    CacheView, Engine, EngineStatus, JobClock, JobFailed, JobInfo, JobSpec, StreamEvent, wall_clock,
)
from exlnb.engines.options import EngineOptions
from exlnb.engines.remote.client import ServerAddress, get_json, stream_events
from exlnb.engines.remote.job import RemoteJob
from exlnb.engines.remote.metrics import ServerMetrics, read_metrics
from exlnb.engines.remote.prompt import PATHS, RemoteTokenizer, prompt_field
from exlnb.engines.remote.request import Dialect, defaults_not_sent, dialect_for, refused, request_body

STEP_WAIT_S = 0.02  # how long step() waits for a chunk: the engine thread then runs its queued commands
_DONE = object()  # a stream's end, after its [DONE]


class RemoteEngine(Engine):
    name = "openai"

    def __init__(self, options: EngineOptions, *, progress: bool = True) -> None:
        if not options.url:
            raise ValueError('the openai engine needs the server\'s url, e.g. url="http://127.0.0.1:8000/v1"')
        self.address = ServerAddress(options.url, options.api_key_env)
        self.api = options.api
        listing = get_json(self.address, "/models")
        entry = served_entry(listing, options.served_model, options.model_dir, self.address)
        self.model: str = entry["id"]
        self.dialect: Dialect = dialect_for(entry.get("owned_by"), listing)
        self.tokenizer = RemoteTokenizer(options.model_dir)
        self.max_seq_len = int(entry.get("max_model_len") or _context_length(options.model_dir))
        self._options = options
        self._jobs: dict[int, RemoteJob] = {}
        self._tasks: dict[int, asyncio.Future] = {}
        self._arrived: queue.SimpleQueue[tuple[int, object, float]] = queue.SimpleQueue()
        self._next_id = 1
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="exlnb-openai-streams", daemon=True)
        self._thread.start()
        # no pool limit: the server, not exlnb, decides how many requests run at once
        self._client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=32))

    # -- jobs (engine thread) ---------------------------------------------------------------------------

    def unsupported(self, spec: JobSpec) -> list[str]:
        return refused(spec, self.dialect, frozenset(self.tokenizer.eos_token_ids))

    def enqueue(self, spec: JobSpec) -> int:
        self.refuse_unsupported(spec)
        eos = frozenset(self.tokenizer.eos_token_ids)
        body = request_body(spec, self.dialect, self.model, prompt_field(self.tokenizer, self.api, spec.input_ids), eos)
        job_id, self._next_id = self._next_id, self._next_id + 1
        self._jobs[job_id] = RemoteJob(job_id, spec, JobClock(enqueued=wall_clock()), self.api == "chat", self.tokenizer)
        self._tasks[job_id] = asyncio.run_coroutine_threadsafe(self._stream(job_id, body), self._loop)
        return job_id

    async def _stream(self, job_id: int, body: dict) -> None:
        try:
            async for chunk in stream_events(self._client, self.address, PATHS[self.api], body):
                self._arrived.put((job_id, chunk, wall_clock()))
            self._arrived.put((job_id, _DONE, wall_clock()))
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - handed to step(), which fails this job alone
            self._arrived.put((job_id, error, wall_clock()))

    def cancel(self, job_id: int) -> bool:
        job = self._jobs.pop(job_id, None)
        task = self._tasks.pop(job_id, None)
        if task is not None:
            task.cancel()  # the stream's `async with` exits on the loop's next turn: the connection closes
        return job is not None

    def step(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        for job_id, item, now in self._take():
            job = self._jobs.get(job_id)
            if job is None:
                continue  # cancelled: what was already on its way is dropped
            if isinstance(item, BaseException):
                self._forget(job_id)
                raise JobFailed([job_id], item, events)
            event = job.end(now) if item is _DONE else job.receive(item, now)
            if item is _DONE:
                self._forget(job_id)
            if event is not None:
                events.append(event)
        return events

    def _take(self) -> list[tuple[int, object, float]]:
        """What arrived since the last step, waiting a moment for the first; a failure ends the batch, so the
        chunks before it are delivered and the ones after wait for the next step."""
        try:
            items = [self._arrived.get(timeout=STEP_WAIT_S)]
        except queue.Empty:
            return []
        while not isinstance(items[-1][1], BaseException):
            try:
                items.append(self._arrived.get_nowait())
            except queue.Empty:
                break
        return items

    def _forget(self, job_id: int) -> None:
        self._jobs.pop(job_id, None)
        self._tasks.pop(job_id, None)

    def jobs(self) -> list[JobInfo]:
        return [job.info() for job in self._jobs.values()]

    def cache_view(self) -> CacheView:
        """The server keeps its cache to itself: no pages to show (the server view reads its /metrics instead)."""
        return CacheView(paged=False, page_size=0, pages=(), max_tokens=self.max_seq_len)

    def server_metrics(self) -> ServerMetrics | None:
        """The server's own running and waiting requests and KV-cache use, or None where it has no /metrics."""
        return read_metrics(self.address)

    def status(self) -> EngineStatus:
        notes = [f"the server takes exlnb's defaults {', '.join(missing)} under no name: its own defaults apply"
                 for missing in [defaults_not_sent(self.dialect)] if missing]
        notes.append("token counts are the local tokenizer's reading of the streamed text, and the server's own "
                     "count at the end where it reports usage")
        if not self.dialect.logprobs:
            notes.append("this server returns no logprobs: no token view (--tokens)")
        endpoint = ("/v1/chat/completions, the server's chat template" if self.api == "chat"
                    else "/v1/completions, exlnb's templates")
        return EngineStatus(
            engine=self.name, model=self.model, device=self.address.base, paged=False,
            attention=f"{self.dialect.describe()}", cache_tokens=self.max_seq_len, cache_dtype="server's",
            max_batch_size=self._options.max_batch_size, notes=tuple(notes), library=self.dialect.name,
            decode=f"prompts: {endpoint}",
        )

    def close(self) -> None:
        for job_id in list(self._jobs):
            self.cancel(job_id)
        asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


def served_entry(listing: dict, wanted: str | None, model_dir: Path, address: ServerAddress) -> dict:
    """The server's /v1/models entry for the model to use: `wanted`, else the one it serves, else the one named
    like the local folder; ValueError naming what it serves otherwise."""
    entries = [e for e in listing.get("data") or [] if isinstance(e, dict) and "id" in e]
    ids = [e["id"] for e in entries]
    if wanted is not None:
        match = [e for e in entries if e["id"] == wanted]
        if not match:
            raise ValueError(f"the server at {address.base} serves no model {wanted!r}: it lists "
                             f"{', '.join(map(repr, ids)) or 'none'}")
        return match[0]
    if len(entries) == 1:
        return entries[0]
    named = [e for e in entries if Path(e["id"]).name == model_dir.name]
    if len(named) == 1:
        return named[0]
    raise ValueError(f"the server at {address.base} lists {len(ids)} models ({', '.join(map(repr, ids[:8])) or 'none'}): "
                     "choose one with served_model=")


def _context_length(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("text_config", config).get("max_position_embeddings") or 2048)

