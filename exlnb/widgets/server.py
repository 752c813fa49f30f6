"""The server view: what `%exl_cache` shows in place of the page map when the model is behind a server.

A server keeps its KV cache to itself, so there are no pages to draw. What can be seen is this kernel's jobs in
flight (the job table, with Cancel buttons: a cancel closes the job's connection) and the server's own count of
requests running and waiting and its KV-cache use, read from its Prometheus `/metrics` where it has one (vLLM,
SGLang, llama.cpp's server); where it has none the view says so rather than showing zeros. Under them, the delivery
audit of the latest answers (`exlnb.engines.delivery`): what this client received against what the server says
it generated, chunks per token, frames against tokens per second, inter-token latency per token.
"""

from __future__ import annotations

import html

from exlnb.engines.base import wall_clock
from exlnb.engines.delivery import DeliveryAudit
from exlnb.engines.options import check_display
from exlnb.engines.registry import engine_spec
from exlnb.session import JobRow, Session, get_session
from exlnb.widgets.cache import Ended, JobTable, jobs_html, jobs_text, show_cache
from exlnb.widgets.frontend import wants_widget

NO_METRICS = "server: no /metrics page, so its queue, running requests and KV-cache use are not known here"
NO_DELIVERY = "delivery: no answer has finished yet"


def server_line(session: Session) -> str:
    """The server's own gauges as a line, or why there are none. `server_metrics` reads only the server's
    address, so it is called here, off the engine thread, and a slow server never holds up a step."""
    metrics = session.engine.server_metrics()
    return NO_METRICS if metrics is None else metrics.line()


def delivery_line(session: Session) -> str:
    """The delivery audit of the server's latest answers, read as the engine last published it (any thread)."""
    audit = DeliveryAudit.of(session.engine.recent_deliveries())
    return NO_DELIVERY if audit is None else audit.line()


def server_text(session: Session, rows: list[JobRow], ended: Ended | None = None) -> str:
    status = session.status()
    return (
        f"{status.model} at {status.device}\n{server_line(session)}\n{delivery_line(session)}\n"
        f"{jobs_text(rows, ended=ended)}"
    )


class ServerView(JobTable):
    """The server's gauges over this kernel's in-flight jobs, refreshed while visible; Cancel buttons as in
    %exl_jobs."""

    def draw(self, rows: list[JobRow], ended: Ended | None = None) -> tuple[str, str]:
        status = self.session.status()
        head = f"{status.model} at {status.device} · {server_line(self.session)}"
        lines = "".join(
            f'<div class="exlnb-summary">{html.escape(line)}</div>' for line in (head, delivery_line(self.session))
        )
        body = f"{lines}{jobs_html(rows, wall_clock(), ended=ended)}"
        return f'<div class="exlnb-server">{body}</div>', server_text(self.session, rows, ended)


def serves_metrics(session: Session) -> bool:
    options = session.options
    return options is not None and engine_spec(options.engine).can("server_metrics")


def show_server(session: Session | None = None, *, display: str = "auto") -> None:
    """Display the server view where widgets render, plain text otherwise."""
    session = session or get_session()
    check_display(display)
    if wants_widget(display):
        ServerView(session).show()
    else:
        print(server_text(session, session.jobs()))


def show_cache_or_server(session: Session | None = None, *, display: str = "auto") -> None:
    """`%exl_cache`: the page map of an engine in this kernel, the server view of a model behind a server."""
    session = session or get_session()
    (show_server if serves_metrics(session) else show_cache)(session, display=display)
