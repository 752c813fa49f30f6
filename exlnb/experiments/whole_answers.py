"""Non-streaming requests, sent straight to a server's own API and abandoned by a client-side timeout.

exlnb's engine always streams. A client that asks for the whole answer at once (`"stream": false`, the `openai`
client's default) and gives up after its read timeout leaves a server differently: the server has nothing to
write until the answer is done, so it learns of the departure only if it looks. `transformers serve` runs such a
request to its end in both its modes (its non-streaming handler awaits the whole generation). The request is the
one the `openai` engine would send for the same job (`request_body`), with streaming off; the client is httpx's,
its read timeout the moment of leaving.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from exlnb.engines.base import JobSpec, wall_clock
from exlnb.engines.remote.client import CONNECT_TIMEOUT_S, ServerAddress, ServerError, refusal, unreachable
from exlnb.engines.remote.prompt import PATHS, prompt_field
from exlnb.engines.remote.request import request_body
from exlnb.session import Session

AT_ONCE_S = 0.001  # the queued phase's read timeout: the request is written, then its client leaves
MAX_ANSWER_BYTES = 1 << 20  # an answer that comes back before the client leaves is read up to this much
ANSWER_LIMIT_S = 30.0  # and for at most this long after its first byte: a server cannot hold a client for ever


@dataclass(frozen=True)
class WholeAnswerRequest:
    """One non-streaming request as the server's API takes it."""

    address: ServerAddress
    path: str  # under the API base: /chat/completions or /completions
    body: dict


def whole_answer_requests(session: Session, specs: list[JobSpec]) -> list[WholeAnswerRequest]:
    """The request the `openai` engine loaded in `session` would send for each spec, with streaming off."""

    def build(engine) -> list[WholeAnswerRequest]:
        eos = frozenset(engine.tokenizer.eos_token_ids)
        requests = []
        for spec in specs:
            body = request_body(
                spec, engine.dialect, engine.model, prompt_field(engine.tokenizer, engine.api, spec.input_ids), eos
            )
            body.pop("stream_options", None)  # OpenAI's API and vLLM refuse stream options on a whole answer
            requests.append(WholeAnswerRequest(engine.address, PATHS[engine.api], body | {"stream": False}))
        return requests

    return session.run_on_engine(build)


def abandon(requests: list[WholeAnswerRequest], leave_after_s: float) -> int:
    """Send every request at once, each from its own client with a read timeout of `leave_after_s`: a client
    whose answer has not begun by then closes its connection. Returns when all have left or been answered,
    with how many were answered first (those were not abandoned). ServerError, in the server's words, where
    one is refused or cannot be sent."""
    with ThreadPoolExecutor(max_workers=len(requests), thread_name_prefix="exlnb-whole-answer") as pool:
        answered = list(pool.map(lambda request: _send(request, leave_after_s), requests))
    return sum(answered)


def _send(request: WholeAnswerRequest, leave_after_s: float) -> bool:
    """True where the answer came (read up to its limits), False where the client left first."""
    address = request.address
    timeout = httpx.Timeout(leave_after_s, connect=CONNECT_TIMEOUT_S, write=CONNECT_TIMEOUT_S)
    try:
        with (
            httpx.Client(timeout=timeout) as client,
            client.stream(
                "POST", f"{address.base}{request.path}", json=request.body, headers=address.headers()
            ) as response,
        ):
            started, size, text = wall_clock(), 0, b""
            for piece in response.iter_bytes():
                size += len(piece)
                text += piece[: max(0, 2000 - len(text))]  # enough of an error body to quote
                if size > MAX_ANSWER_BYTES or wall_clock() - started > ANSWER_LIMIT_S:
                    break
    except httpx.ReadTimeout:
        return False  # the client's timeout: leaving the block closed the connection
    except httpx.HTTPError as error:
        raise ServerError(unreachable(address, error)) from error
    if response.is_error:
        raise ServerError(refusal(address, response.status_code, text.decode(errors="replace")))
    return True
