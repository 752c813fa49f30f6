"""One request to a server as an exlnb job: its checked chunks read into `StreamEvent`s.

Timings come from `JobClock` and `job_event` as on every engine, read when a frame arrives, so a server's time to
first token includes the network and the server's queue: what a user of that server waits. A frame without a
token (a chat answer's role-only first frame) does not start that clock. A server does not say when it admitted a
request, so no prefill rate is reported. Token ids are the local tokenizer's reading of the streamed text (the
same model's tokenizer), or the server's own tokens where it returns logprobs; both are read off the engine
thread (`arrival`), since a large frame takes a while to tokenise and every other job would wait for it. The job
ends at its `max_new_tokens` by that count, whatever the server goes on sending. The last event carries the
server's own completion token count where it reports usage, and the answer's `Delivery`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from exlnb.engines.base import EosReason, JobClock, JobInfo, JobSpec, Stage, StreamEvent, job_event
from exlnb.engines.delivery import Delivery
from exlnb.engines.remote.chunk import Chunk, TokenLogprob, Usage
from exlnb.engines.remote.client import ServerError
from exlnb.engines.remote.prompt import RemoteTokenizer
from exlnb.engines.token_info import TokenInfo

FINISH_REASONS = {"length": EosReason.MAX_NEW_TOKENS, "stop": EosReason.STOP_TOKEN, "eos": EosReason.STOP_TOKEN}


@dataclass(frozen=True)
class Arrival:
    """One frame as the engine thread takes it: its chunk, when it came, and its tokens, read before."""

    chunk: Chunk
    at: float
    token_ids: tuple[int, ...] = ()
    token_info: tuple[TokenInfo, ...] = ()


def arrival(chunk: Chunk, at: float, tokenizer: RemoteTokenizer, top_tokens: int) -> Arrival:
    """The frame's tokens: the server's own where it returned logprobs and the job asked for them, else the local
    tokenizer's reading of its text. Runs on a worker thread (transformers' encode lets go of the GIL)."""
    infos = tuple(_info(t, tokenizer, top_tokens) for t in chunk.logprobs) if top_tokens else ()
    if infos:
        return Arrival(chunk, at, tuple(i.token_id for i in infos), infos)
    return Arrival(chunk, at, tuple(tokenizer.encode(chunk.text, special=True)) if chunk.text else ())


@dataclass
class RemoteJob:
    job_id: int
    spec: JobSpec
    clock: JobClock
    endpoint: str  # the server's endpoint, as messages name it
    tokenizer: RemoteTokenizer
    new_tokens: int = 0
    stage: Stage = Stage.PENDING
    finish_reason: str | None = None
    stop_string: bool = False
    usage: Usage | None = None
    frames: int = 0
    first_frame: float | None = None
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (when, tokens) of each frame with tokens
    failure: ServerError | None = None  # what the server sent that ends the job as failed

    def info(self) -> JobInfo:
        return JobInfo(
            self.job_id,
            self.spec.identifier,
            self.stage,
            len(self.spec.input_ids),
            self.new_tokens,
            self.spec.max_new_tokens,
            self.clock.enqueued,
            pages=0,
        )

    def receive(self, frame: Arrival) -> StreamEvent | None:
        """The event for one frame; None for a frame with no token. Past `max_new_tokens` the frame is cut there
        and `failure` says that the server sent more."""
        chunk, now = frame.chunk, frame.at
        self.frames += 1
        self.first_frame = self.first_frame if self.first_frame is not None else now
        self.usage = chunk.usage or self.usage
        if chunk.finish_reason:
            self.finish_reason, self.stop_string = chunk.finish_reason, chunk.stop_string
        ids, infos, text = frame.token_ids, frame.token_info, chunk.text
        room = self.spec.max_new_tokens - self.new_tokens
        if len(ids) > room:
            self.failure = self._overrun(len(ids), bool(infos))
            ids, infos = ids[:room], infos[:room]
            text = "".join(i.text for i in infos) if infos else self.tokenizer.decode(ids, special=True)
        if not ids:
            return None
        self.clock.token_arrived(now)
        self.stage = Stage.DECODE
        self.new_tokens += len(ids)
        self.arrivals.append((now, len(ids)))
        return self._event(now, text=text, token_ids=ids, token_info=infos)

    def end(self, now: float) -> StreamEvent:
        """The last event, once the server closed the stream with its `[DONE]` or after its finish_reason."""
        server_count = self.usage.completion_tokens if self.usage else None
        delivery = Delivery(self.clock.enqueued, self.frames, self.first_frame, tuple(self.arrivals), server_count, now)
        self.new_tokens = server_count or self.new_tokens
        reason = FINISH_REASONS.get(self.finish_reason or "stop", EosReason.STOP_TOKEN)
        if reason is EosReason.STOP_TOKEN and self.stop_string:
            reason = EosReason.STOP_STRING
        self.stage = Stage.DONE
        return self._event(now, eos_reason=reason, delivery=delivery)

    def _overrun(self, arrived: int, servers_tokens: bool) -> ServerError:
        limit = self.spec.max_new_tokens
        counted = "the server's own tokens" if servers_tokens else "the local tokenizer's count"
        return ServerError(
            f"the server at {self.endpoint} sent more than max_new_tokens={limit} tokens "
            f"({self.new_tokens + arrived} by {counted}): exlnb kept the first {limit} and closed "
            "the stream"
        )

    def _event(self, now: float, **fields) -> StreamEvent:
        usage = self.usage or Usage(None, None, None)
        return job_event(
            self.job_id,
            self.stage,
            self.clock,
            now,
            prompt_tokens=usage.prompt_tokens or len(self.spec.input_ids),
            cached_tokens=usage.cached_tokens or 0,
            new_tokens=self.new_tokens,
            **fields,
        )


def _info(token: TokenLogprob, tokenizer: RemoteTokenizer, top_tokens: int) -> TokenInfo:
    alternatives = sorted(((_id(t, tokenizer), t, _probability(lp)) for t, lp in token.top), key=lambda a: -a[2])
    return TokenInfo(
        _id(token.token, tokenizer), token.token, _probability(token.logprob), tuple(alternatives[:top_tokens])
    )


def _id(token: str, tokenizer: RemoteTokenizer) -> int:
    """The local id of a token the server names by its text; -1 where the text is not one token here."""
    ids = tokenizer.encode(token, special=True) if token else []
    return ids[0] if len(ids) == 1 else -1


def _probability(logprob: float | None) -> float:
    return 0.0 if logprob is None else math.exp(logprob)
