"""The openai engine: jobs streamed from an OpenAI-compatible server, side by side, handed over by `step()`.

Each job's request runs as a task on an asyncio loop of the engine's own (one thread), so every stream is read as
it arrives, however many are open; each frame is checked there (`answer.py`, `chunk.py`) and its tokens read on a
worker thread (`job.arrival`), so `step()` only collects what arrived and turns it into events. `cancel()`
cancels the job's task, which leaves the stream's `async with` and so closes its connection at once: a Stop
button, a kernel interrupt and an abandoned stream all reach the server as the client going away. Whatever goes
wrong with one request (a refusal, a bad frame, an answer past its bounds) fails its job alone (`JobFailed`),
in one line with the server's own words.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from exlnb.engines.base import (
    CacheView,
    Engine,
    EngineStatus,
    JobClock,
    JobFailed,
    JobInfo,
    JobSpec,
    StreamEvent,
    wall_clock,
)
from exlnb.engines.checks import is_number
from exlnb.engines.delivery import Delivery
from exlnb.engines.options import EngineOptions
from exlnb.engines.remote.answer import answer_chunks
from exlnb.engines.remote.client import ServerAddress, get_json
from exlnb.engines.remote.job import RemoteJob, arrival
from exlnb.engines.remote.metrics import ServerMetrics, read_metrics
from exlnb.engines.remote.prompt import PATHS, RemoteTokenizer, prompt_field
from exlnb.engines.remote.request import Dialect, defaults_not_sent, dialect_for, refused, request_body

API_WORDS = {
    "chat": "/v1/chat/completions (the server's chat template)",
    "completions": "/v1/completions (exlnb's templates)",
}
assert set(API_WORDS) == set(PATHS), "a server API without its words"
# a branch's prompt is the answer's prompt and its first tokens, which a chat server would wrap in its template again
CHAT_CANNOT_BRANCH = (
    "branching on a server needs --api completions: with api='chat' the server applies its own "
    "chat template to whole messages, so it cannot continue an answer from one of its tokens; "
    "%exl_load the server with --api completions (api='completions') to branch"
)
STEP_WAIT_S = 0.02  # how long step() waits for a chunk: the engine thread then runs its queued commands
RECENT_DELIVERIES = 256  # the answers the server view audits: enough for a median, bounded in memory
_DONE = object()  # a stream's honest end: its [DONE], or its close after a finish_reason


@dataclass(frozen=True)
class ServerStatus(EngineStatus):
    """The openai engine's status. A server keeps its attention, cache and batching to itself, so its line says
    what is known instead: the server and its dialect (`library`), the API the prompts go through, whether it
    returns logprobs (the token view needs them) and its context length."""

    api: str = ""
    logprobs: bool = False

    def line(self) -> str:
        return (
            f"{self.engine} engine | {self.model} | server {self.device}, {self.library} dialect | API {self.api} "
            f"| logprobs {'yes' if self.logprobs else 'no'} | context {self.cache_tokens} tokens"
        )


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
        self.dialect: Dialect = dialect_for(entry.get("owned_by"), listing, named=options.dialect)
        self.tokenizer = RemoteTokenizer(options.model_dir)
        self.max_seq_len = max_seq_len(entry, options.model_dir, self.address)
        if self.api == "chat":
            self.branch_refusal = CHAT_CANNOT_BRANCH
        self._options = options
        self._jobs: dict[int, RemoteJob] = {}
        self._tasks: dict[int, asyncio.Future] = {}
        self._arrived: queue.SimpleQueue[tuple[int, object, float]] = queue.SimpleQueue()
        self._taken: deque[tuple[int, object, float]] = deque()  # arrived, not yet turned into events
        self._recent: tuple[Delivery, ...] = ()  # replaced whole, so any thread may read it
        self._next_id = 1
        # tokenising a large frame takes a while (1 MB: 1.1 s): never on the engine thread or the streams' loop
        self._tokenising = ThreadPoolExecutor(max_workers=2, thread_name_prefix="exlnb-openai-tokens")
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
        clock = JobClock(enqueued=wall_clock())
        self._jobs[job_id] = RemoteJob(job_id, spec, clock, self.address.endpoint(PATHS[self.api]), self.tokenizer)
        self._tasks[job_id] = asyncio.run_coroutine_threadsafe(self._stream(job_id, spec, body), self._loop)
        return job_id

    async def _stream(self, job_id: int, spec: JobSpec, body: dict) -> None:
        try:
            async for chunk, at in answer_chunks(
                self._client,
                self.address,
                PATHS[self.api],
                body,
                chat=self.api == "chat",
                max_new_tokens=spec.max_new_tokens,
            ):
                frame = await self._loop.run_in_executor(
                    self._tokenising, arrival, chunk, at, self.tokenizer, spec.top_tokens
                )
                self._arrived.put((job_id, frame, at))
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
        """What arrived, as events. Anything wrong with one job's frames fails that job alone; the frames taken
        after it wait for the next step."""
        events: list[StreamEvent] = []
        self._take()
        while self._taken:
            job_id, item, now = self._taken.popleft()
            job = self._jobs.get(job_id)
            if job is None:
                continue  # cancelled: what was already on its way is dropped
            failure = self._apply(job, item, now, events)
            if failure is not None:
                self.cancel(job_id)  # closes its connection, should the server still be sending
                raise JobFailed([job_id], failure, events)
        return events

    def _apply(self, job: RemoteJob, item: object, now: float, events: list[StreamEvent]) -> BaseException | None:
        """Turn one arrived item into the job's event; the failure that ends the job, if any."""
        if isinstance(item, BaseException):
            return item
        try:
            event = job.end(now) if item is _DONE else job.receive(item)
        except Exception as error:  # noqa: BLE001 - a frame one job could not read fails that job alone
            return error
        if event is not None:
            events.append(event)
        if event is not None and event.delivery is not None:
            self._recent = (*self._recent[1 - RECENT_DELIVERIES :], event.delivery)
        if item is _DONE:
            self._forget(job.job_id)
        return job.failure

    def _take(self) -> None:
        """Move what arrived since the last step to `_taken`, waiting a moment for the first."""
        if not self._taken:
            try:
                self._taken.append(self._arrived.get(timeout=STEP_WAIT_S))
            except queue.Empty:
                return
        while True:
            try:
                self._taken.append(self._arrived.get_nowait())
            except queue.Empty:
                return

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

    def recent_deliveries(self) -> tuple[Delivery, ...]:
        """The latest answers' deliveries (at most RECENT_DELIVERIES), for the server view's audit; any thread."""
        return self._recent

    def status(self) -> EngineStatus:
        notes = [
            f"the server takes exlnb's defaults {', '.join(missing)} under no name: its own defaults apply"
            for missing in [defaults_not_sent(self.dialect)]
            if missing
        ]
        notes.append(
            "token counts are the local tokenizer's reading of the streamed text, and the server's own "
            "count at the end where it reports usage"
        )
        if not self.dialect.logprobs:
            notes.append("this server returns no logprobs: no token view (--tokens)")
        return ServerStatus(
            engine=self.name,
            model=self.model,
            device=self.address.shown,
            paged=False,
            attention="the server's",
            cache_tokens=self.max_seq_len,
            cache_dtype="the server's",
            max_batch_size=self._options.max_batch_size,
            notes=tuple(notes),
            library=self.dialect.name,
            api=API_WORDS[self.api],
            logprobs=self.dialect.logprobs,
        )

    def close(self) -> None:
        for job_id in list(self._jobs):
            self.cancel(job_id)
        asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._tokenising.shutdown(wait=False, cancel_futures=True)


def served_entry(listing: dict, wanted: str | None, model_dir: Path, address: ServerAddress) -> dict:
    """The server's /v1/models entry for the model to use: `wanted`, else the one it serves, else the one named
    like the local folder; ValueError naming what it serves otherwise. A server that lists no model at all is
    taken at its word for `wanted` (transformers serve before 5.24, started on a folder, lists only its Hub
    cache): its first answer says whether it serves that name."""
    entries = [e for e in listing.get("data") or [] if isinstance(e, dict) and isinstance(e.get("id"), str)]
    ids = [e["id"] for e in entries]
    if wanted is not None and not entries:
        return {"id": wanted}
    if not entries:
        raise ValueError(
            f"the server at {address.shown} lists no models: give the name it answers to with served_model= "
            "(for transformers serve started on a folder, that folder's path, and dialect='transformers')"
        )
    if wanted is not None:
        match = [e for e in entries if e["id"] == wanted]
        if not match:
            raise ValueError(
                f"the server at {address.shown} serves no model {wanted!r}: it lists "
                f"{', '.join(map(repr, ids)) or 'none'}"
            )
        return match[0]
    if len(entries) == 1:
        return entries[0]
    named = [e for e in entries if Path(e["id"]).name == model_dir.name]
    if len(named) == 1:
        return named[0]
    raise ValueError(
        f"the server at {address.shown} lists {len(ids)} models ({', '.join(map(repr, ids[:8])) or 'none'}): "
        "choose one with served_model="
    )


def max_seq_len(entry: dict, model_dir: Path, address: ServerAddress) -> int:
    """The server's context length for the model (vLLM's `max_model_len`), else the local config's; ValueError
    for one that is not a positive integer (a server reported -5, and exlnb sized its checks by it)."""
    reported = entry.get("max_model_len")
    if reported is None:
        return _context_length(model_dir)
    if not is_number(reported, int) or reported < 1:
        raise ValueError(
            f"the server at {address.shown} reports max_model_len={reported!r} for {entry['id']!r}, "
            "which is not a positive number of tokens: fix the server's settings"
        )
    return int(reported)


def _context_length(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("text_config", config).get("max_position_embeddings") or 2048)
