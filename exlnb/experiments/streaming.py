"""Field report 3: streaming that stalls, then bursts.

A real HTTP server (tornado, Jupyter's own web framework) streams each chunk of one job to a real client
over a local socket; the client stamps each chunk's arrival. Three ways of feeding the handler:

- "nested": the reporter's set-up. The generator runs on the web server's event loop, as exllamav2's
  `ExLlamaV2DynamicGeneratorAsync` does (`iterate()`, hand out results, `await asyncio.sleep(0)`), and
  the handler's body is an async generator doing `async for` over the job.
- "collector queue": the fix field report 3 proposes (TabbyAPI's): a task iterates the job and puts
  results on an `asyncio.Queue`; the handler reads the queue. The generator still runs on the event loop.
- "exlnb session": the engine runs on the session's engine thread and puts results on the stream's
  queue (`call_soon_threadsafe`); the event loop only ever delivers.

What a web stack does per chunk matters: anyio-based stacks (Starlette's middleware streams, sse-starlette's
send lock) call `checkpoint()`, one pass of the event loop, for every send. Each pass of a loop that also
runs forward passes waits for one. The handler here makes `checkpoints` such passes per chunk (0 to 3),
so the measurement shows where the pile-up starts rather than assuming one web stack.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator, Callable

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from exlnb.analysis import median_interval, rate_interval
from exlnb.engines.base import Engine, JobSpec, SamplerSettings, StreamEvent, wall_clock
from exlnb.experiments.record import Effect, ExperimentResult, environment
from exlnb.session import Session
from exlnb.templates import chatml

PATTERNS = ("nested", "collector queue", "exlnb session")
PROMPT = "Write a long story about a fox who wants to fly."
BURST_WINDOW_S = 0.010  # chunks arriving within this of the last chunk arrive "at once" with it


def run(
    session: Session,
    *,
    max_new_tokens: int = 40,
    checkpoints: tuple[int, ...] = (0, 1, 2, 3),
    symptom_checkpoints: int = 2,
) -> ExperimentResult:
    """One streamed request per pattern and per number of event-loop passes the handler makes per chunk."""
    if symptom_checkpoints not in checkpoints:
        raise ValueError(f"symptom_checkpoints={symptom_checkpoints} must be one of checkpoints={checkpoints}")
    spec = JobSpec(
        input_ids=tuple(session.tokenizer.encode(chatml(PROMPT), special=True)),
        max_new_tokens=max_new_tokens,
        sampler=SamplerSettings.greedy(),
        identifier="streamed request",
    )
    rows = []
    for passes in checkpoints:
        for pattern in PATTERNS:
            if pattern == "exlnb session":
                chunks = _in_thread(
                    lambda: asyncio.run(_serve_one_request(lambda: _session_source(session, spec), passes))
                )
            else:
                chunks = session.run_on_engine(lambda engine: _on_event_loop(engine, spec, pattern, passes))
            rows += [{"pattern": pattern, "checkpoints": passes, **chunk} for chunk in chunks]
    parameters = dict(
        max_new_tokens=max_new_tokens, checkpoints=list(checkpoints), symptom_checkpoints=symptom_checkpoints
    )
    return _summarise({"chunks": pd.DataFrame(rows)}, parameters, environment(session))


# -- producers ------------------------------------------------------------------------------------------------


class LoopResidentGenerator:
    """ExLlamaV2DynamicGeneratorAsync's loop over an exlnb engine: the forward pass runs on the event loop.

    As in exllamav2 0.3.2's `_run_iteration`: step the generator, put each result on its job's queue, then
    `await asyncio.sleep(0)`, the only moment anything else on the loop gets to run.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._queues: dict[int, asyncio.Queue[StreamEvent]] = {}
        self._work = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run_iteration())

    def enqueue(self, spec: JobSpec) -> AsyncIterator[StreamEvent]:
        job_id = self._engine.enqueue(spec)
        self._queues[job_id] = asyncio.Queue()
        self._work.set()
        return _until_eos(self._queues[job_id])

    async def _run_iteration(self) -> None:
        while True:
            if not self._queues:
                self._work.clear()
                await self._work.wait()
            for event in self._engine.step():
                await self._queues[event.job_id].put(event)
                if event.eos:
                    del self._queues[event.job_id]
            await asyncio.sleep(0)

    def close(self) -> None:
        self._task.cancel()


async def _until_eos(queue: asyncio.Queue[StreamEvent]) -> AsyncIterator[StreamEvent]:
    while True:
        event = await queue.get()
        yield event
        if event.eos:
            return


async def _nested_source(generator: LoopResidentGenerator, spec: JobSpec) -> AsyncIterator[StreamEvent]:
    """The application's stream: an async generator over the job, itself iterated by the web handler."""
    async for event in generator.enqueue(spec):
        yield event


async def _collector_source(generator: LoopResidentGenerator, spec: JobSpec) -> AsyncIterator[StreamEvent]:
    """TabbyAPI's shape: a collector task drains the job into a queue; the response reads the queue."""
    queue: asyncio.Queue[StreamEvent] = asyncio.Queue()

    async def collect() -> None:
        async for event in generator.enqueue(spec):
            await queue.put(event)

    collector = asyncio.create_task(collect())
    try:
        async for event in _until_eos(queue):
            yield event
    finally:
        collector.cancel()


async def _session_source(session: Session, spec: JobSpec) -> AsyncIterator[StreamEvent]:
    async for event in session.submit(spec):
        yield event


def _on_event_loop(engine: Engine, spec: JobSpec, pattern: str, passes: int) -> list[dict]:
    """Serve one request with the generator on this thread's event loop (run on the engine thread)."""
    if engine.has_work():
        raise RuntimeError("the engine has jobs running; the event-loop patterns need it to themselves")

    async def serve() -> list[dict]:
        generator = LoopResidentGenerator(engine)
        source = _nested_source if pattern == "nested" else _collector_source
        try:
            return await _serve_one_request(lambda: source(generator, spec), passes)
        finally:
            generator.close()

    return asyncio.run(serve())


# -- the web server and its client ------------------------------------------------------------------------------


async def _serve_one_request(make_source: Callable[[], AsyncIterator[StreamEvent]], passes: int) -> list[dict]:
    """Start a tornado server on a free local port, let a client fetch one stream, return its chunks."""
    import tornado.httpserver
    import tornado.netutil
    import tornado.web

    sent: dict[int, float] = {}

    class StreamHandler(tornado.web.RequestHandler):
        async def get(self) -> None:
            async for n, event in _numbered(make_source()):
                self.write(
                    json.dumps({"n": n, "produced": event.time_produced, "text": event.text, "eos": event.eos}) + "\n"
                )
                await self.flush()
                sent[n] = wall_clock()
                for _ in range(passes):
                    await asyncio.sleep(0)  # one pass of the event loop, like anyio's checkpoint()

    sockets = tornado.netutil.bind_sockets(0, "127.0.0.1")
    server = tornado.httpserver.HTTPServer(tornado.web.Application([("/", StreamHandler)]))
    server.add_sockets(sockets)
    client = ChunkClient(sockets[0].getsockname()[1])
    client.start()
    while client.is_alive():
        await asyncio.sleep(0.005)
    server.stop()
    if client.error is not None:
        raise RuntimeError("the streaming client failed") from client.error
    request_start = client.request_sent
    return [
        {
            "chunk": chunk["n"],
            "produced_s": chunk["produced"] - request_start,
            "sent_s": sent[chunk["n"]] - request_start,
            "arrived_s": arrived - request_start,
            "text": chunk["text"],
        }
        for chunk, arrived in client.chunks
    ]


async def _numbered(source: AsyncIterator[StreamEvent]) -> AsyncIterator[tuple[int, StreamEvent]]:
    n = 0
    async for event in source:
        if event.text or event.eos:  # chunks a client would see
            yield n, event
            n += 1


class ChunkClient(threading.Thread):
    """An HTTP client on its own thread: sends one GET, stamps each line of the body when it arrives."""

    def __init__(self, port: int) -> None:
        super().__init__(name="exlnb-stream-client", daemon=True)
        self._port = port
        self.chunks: list[tuple[dict, float]] = []
        self.request_sent = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._fetch()
        except BaseException as error:  # noqa: BLE001 - re-raised on the caller's side
            self.error = error

    def _fetch(self) -> None:
        with socket.create_connection(("127.0.0.1", self._port), timeout=120) as sock:
            self.request_sent = wall_clock()
            sock.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
            buffer = b""
            while True:
                data = sock.recv(65536)
                arrived = wall_clock()
                if not data:
                    return
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                # chunked transfer framing (sizes, blank lines) sits between the JSON lines; skip it
                for line in lines:
                    if line.startswith(b"{"):
                        chunk = json.loads(line)
                        self.chunks.append((chunk, arrived))
                        if chunk["eos"]:
                            return


def _in_thread(fn: Callable[[], list[dict]]) -> list[dict]:
    """Run `fn` on a fresh thread: a notebook's own event loop is already running on this one."""
    result: list = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    thread = threading.Thread(target=target, name="exlnb-stream-server")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


# -- summary and figure ----------------------------------------------------------------------------------------


def _per_run(chunks: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (pattern, passes), run in chunks.groupby(["pattern", "checkpoints"], sort=False):
        last_produced = run.produced_s.max()
        # the report's "then the rest arrives at once": chunks delivered together with the very last one
        burst = run.arrived_s >= run.arrived_s.max() - BURST_WINDOW_S
        rows.append(
            {
                "pattern": pattern,
                "checkpoints": passes,
                "chunks": len(run),
                "median_delay_s": (run.arrived_s - run.produced_s).median(),
                "max_delay_s": (run.arrived_s - run.produced_s).max(),
                "final_burst_chunks": int(burst.sum()),
                "production_s": last_produced,
                "last_arrival_s": run.arrived_s.max(),
            }
        )
    return pd.DataFrame(rows)


def _summarise(tables: dict[str, pd.DataFrame], parameters: dict, env: dict) -> ExperimentResult:
    chunks = tables["chunks"]
    chunks["delay_s"] = chunks.arrived_s - chunks.produced_s
    chunks["arrival_gap_s"] = chunks.groupby(["pattern", "checkpoints"]).arrived_s.diff()
    runs = tables["runs"] = _per_run(chunks)
    d = parameters["symptom_checkpoints"]
    at = {p: chunks[(chunks.pattern == p) & (chunks.checkpoints == d)] for p in PATTERNS}
    run_at = runs[runs.checkpoints == d].set_index("pattern")

    def burst(pattern: str):
        return rate_interval(int(run_at.loc[pattern, "final_burst_chunks"]), int(run_at.loc[pattern, "chunks"]))

    def delay(pattern: str):
        return median_interval(at[pattern].delay_s, "s")

    measures = (
        (f"delay from production to arrival ({d} event-loop passes per chunk), median", delay),
        (f"share of chunks arriving at once with the last ({d} passes per chunk)", burst),
    )
    # the symptom against exlnb's fix and against the one field report 3 proposes
    effects = [
        Effect(name, measure("nested"), measure(fix), "nested", fix)
        for name, measure in measures
        for fix in ("exlnb session", "collector queue")
    ]
    return ExperimentResult(
        name="streaming",
        field_reports=(3,),
        tables=tables,
        effects=effects,
        parameters=parameters,
        environment=env,
        findings=_findings(runs, d),
        values={"runs": runs.to_dict(orient="records")},
    )


def _findings(runs: pd.DataFrame, d: int) -> list[str]:
    lines = []
    for passes, group in runs.groupby("checkpoints"):
        by = group.set_index("pattern")
        lines.append(
            f"{passes} event-loop passes per chunk: "
            + "; ".join(
                f"{p} - median delay {by.loc[p, 'median_delay_s'] * 1000:.1f} ms, "
                f"{by.loc[p, 'final_burst_chunks']} of {by.loc[p, 'chunks']} chunks at once with the last"
                for p in PATTERNS
            )
            + "."
        )
    by = runs[runs.checkpoints == d].set_index("pattern")
    nested, collector = by.loc["nested"], by.loc["collector queue"]
    lines.append(
        f"Total time (request to last chunk) at {d} passes: nested {nested.last_arrival_s:.2f} s, collector queue "
        f"{collector.last_arrival_s:.2f} s, exlnb session {by.loc['exlnb session', 'last_arrival_s']:.2f} s; "
        "the report says the total is unchanged by the burst."
    )
    if collector.final_burst_chunks >= 0.5 * nested.final_burst_chunks > 1:
        lines.append(
            "The collector queue alone (field report 3's fix) does not remove the pile-up here: the generator still "
            "runs on the event loop, so each pass of the loop the handler needs waits for a forward pass. Running the "
            "generator off the loop does."
        )
    return lines


def plot(result: ExperimentResult):
    """Arrival against production for each chunk (timeline) and the gaps between arrivals."""
    chunks = result.tables["chunks"]
    d = result.parameters["symptom_checkpoints"]
    at = chunks[chunks.checkpoints == d]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    sns.lineplot(data=at, x="produced_s", y="arrived_s", hue="pattern", style="pattern", markers=True, ax=axes[0])
    top = at[["produced_s", "arrived_s"]].to_numpy().max()
    axes[0].plot([0, top], [0, top], color="grey", linestyle=":", label="arrives when produced")
    axes[0].set(
        xlabel="produced (s after request)",
        ylabel="arrived at client (s)",
        title=f"Field report 3: timeline, {d} loop passes per chunk",
    )
    axes[0].legend()
    # chunks that arrive in one socket read have a gap of 0; show them at 0.01 ms on the log axis
    gaps = at.dropna(subset=["arrival_gap_s"]).assign(gap_ms=lambda t: (t.arrival_gap_s * 1000).clip(lower=0.01))
    sns.ecdfplot(data=gaps, x="gap_ms", hue="pattern", log_scale=True, ax=axes[1])
    axes[1].set(xlabel="gap between arrivals (ms; 0 shown as 0.01)", title="Gap distribution")
    runs = result.tables["runs"]
    sns.barplot(data=runs, x="checkpoints", y="final_burst_chunks", hue="pattern", ax=axes[2])
    axes[2].set(
        xlabel="event-loop passes per chunk in the handler",
        ylabel="chunks arriving at once with the last",
        title="Where the pile-up starts",
    )
    fig.tight_layout()
    return fig
