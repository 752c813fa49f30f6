"""One request to a server as an exlnb job: its streamed chunks read into `StreamEvent`s.

Timings come from `JobClock` and `job_event` as on every engine, read when a chunk arrives here, so a server's
time to first token includes the network and the server's queue: what a user of that server waits. A server does
not say when it admitted a request, so no prefill rate is reported. Token ids are the local tokenizer's reading of
the streamed text (the same model's tokenizer), or the server's own tokens where it returns logprobs; the last
event carries the server's own completion token count where it reports usage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from exlnb.engines.base import EosReason, JobClock, JobInfo, JobSpec, Stage, StreamEvent, job_event
from exlnb.engines.remote.prompt import RemoteTokenizer
from exlnb.engines.token_info import TokenInfo

FINISH_REASONS = {"length": EosReason.MAX_NEW_TOKENS, "stop": EosReason.STOP_TOKEN, "eos": EosReason.STOP_TOKEN}


@dataclass
class RemoteJob:
    job_id: int
    spec: JobSpec
    clock: JobClock
    chat: bool  # chunks carry `delta.content` (chat) or `text` (completions)
    tokenizer: RemoteTokenizer
    new_tokens: int = 0
    stage: Stage = Stage.PENDING
    finish_reason: str | None = None
    stop_string: bool = False
    usage: dict = field(default_factory=dict)

    def info(self) -> JobInfo:
        return JobInfo(self.job_id, self.spec.identifier, self.stage, len(self.spec.input_ids), self.new_tokens,
                       self.spec.max_new_tokens, self.clock.enqueued, pages=0)

    def receive(self, chunk: dict, now: float) -> StreamEvent | None:
        """The event for one streamed chunk; None for a chunk with nothing new (a role or usage chunk)."""
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if not choices:
            return None
        choice = choices[0]
        text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
        text = text or ""
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
            self.stop_string = isinstance(choice.get("stop_reason"), str)  # vLLM names the stop string it met
        infos = self._token_infos(choice.get("logprobs"))
        ids = [i.token_id for i in infos] if infos else (self.tokenizer.encode(text, special=True) if text else [])
        if not text and not infos:
            return None
        self.clock.token_arrived(now)
        self.stage = Stage.DECODE
        self.new_tokens += len(infos) if infos else max(1, len(ids))
        return self._event(now, text=text, token_ids=ids, token_info=infos)

    def end(self, now: float) -> StreamEvent:
        """The last event, once the server closed the stream with its `[DONE]`."""
        self.new_tokens = int(self.usage.get("completion_tokens") or self.new_tokens)
        reason = FINISH_REASONS.get(self.finish_reason or "stop", EosReason.STOP_TOKEN)
        if reason is EosReason.STOP_TOKEN and self.stop_string:
            reason = EosReason.STOP_STRING
        self.stage = Stage.DONE
        return self._event(now, eos_reason=reason)

    def _event(self, now: float, **fields) -> StreamEvent:
        prompt = int(self.usage.get("prompt_tokens") or len(self.spec.input_ids))
        cached = int((self.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        return job_event(self.job_id, self.stage, self.clock, now, prompt_tokens=prompt, cached_tokens=cached,
                         new_tokens=self.new_tokens, **fields)

    def _token_infos(self, logprobs: dict | None) -> list[TokenInfo]:
        """The chunk's tokens from OpenAI's chat (`content`) or completions (`tokens`, `top_logprobs`) logprobs."""
        if not logprobs or not self.spec.top_tokens:
            return []
        if "content" in logprobs:
            return [self._info(t["token"], t["logprob"], [(a["token"], a["logprob"]) for a in t.get("top_logprobs") or []])
                    for t in logprobs["content"] or []]
        tops = logprobs.get("top_logprobs") or [{}] * len(logprobs.get("tokens") or [])
        return [self._info(token, logprob, list((top or {}).items()))
                for token, logprob, top in zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or [], tops)]

    def _info(self, token: str, logprob: float | None, top: list[tuple[str, float]]) -> TokenInfo:
        alternatives = sorted(((self._id(t), t, _probability(lp)) for t, lp in top), key=lambda a: -a[2])
        return TokenInfo(self._id(token), token, _probability(logprob), tuple(alternatives[: self.spec.top_tokens]))

    def _id(self, token: str) -> int:
        """The local id of a token the server names by its text; -1 where the text is not one token here."""
        ids = self.tokenizer.encode(token, special=True) if token else []
        return ids[0] if len(ids) == 1 else -1


def _probability(logprob: float | None) -> float:
    return 0.0 if logprob is None else math.exp(logprob)
