"""How a server's answer reached the client, against what the server says it generated: the delivery audit.

A server streams frames (server-sent events). A frame may carry one token, several, or none: a chat answer's
first frame often holds only the role, and the last ones the finish reason and the usage. vLLM's benchmark
client counts one inter-token latency per frame, whatever it carries, so a server that packs four tokens a frame
shows a quarter as many, four times longer gaps; and a role-only first frame, counted as the first token, would
make time to first token look shorter than it is. `Delivery` is one answer's frames as the client received them
(the openai engine fills it in; an engine in the kernel has no frames), and `DeliveryAudit` sums several: chunks
per token, frames and tokens per second, inter-token latency per token, how far the first frame came before the
first token (which time to first token leaves out), and the tokens received against the server's own count.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Delivery:
    """One answer's frames as the client received them; times are `wall_clock()` readings."""

    sent: float  # the request went
    frames: int  # data frames received, [DONE] excluded: role-only, finish-only and usage frames count
    first_frame: float | None
    arrivals: tuple[tuple[float, int], ...]  # (when, how many tokens) for each frame that carried tokens
    server_tokens: int | None  # what the server says it generated (usage.completion_tokens); None if not said
    ended: float  # the stream's end

    @property
    def received_tokens(self) -> int:
        return sum(count for _, count in self.arrivals)

    @property
    def stream_s(self) -> float:
        """First frame to the stream's end: the span frames and tokens per second are measured over."""
        return self.ended - self.first_frame if self.first_frame is not None else 0.0

    @property
    def first_frame_lead_s(self) -> float | None:
        """How long before the first token its first frame came (a role-only frame); 0 where it held the token."""
        if self.first_frame is None or not self.arrivals:
            return None
        return self.arrivals[0][0] - self.first_frame

    def itl_per_token_s(self) -> list[float]:
        """Each token's share of the gap before the frame that brought it: k tokens after a gap g are k gaps of
        g / k, so the gaps sum to first token to last, as time per output token reads it."""
        gaps: list[float] = []
        for (before, _), (at, count) in zip(self.arrivals, self.arrivals[1:]):
            gaps += [(at - before) / count] * count
        return gaps


@dataclass(frozen=True)
class DeliveryAudit:
    """Answers' deliveries summed: the ratios over their totals, the latencies as medians (milliseconds)."""

    answers: int
    frames: int
    token_chunks: int  # frames that carried tokens
    received_tokens: int
    server_tokens: int | None  # summed over the answers whose server gave a count; None where none did
    counted_by_server: int  # answers whose server gave its count
    stream_s: float
    itl_per_token_ms: float | None  # median
    itl_per_chunk_ms: float | None  # median, vLLM's way (one gap per token-carrying frame), for comparison
    first_frame_lead_ms: float | None  # median

    @classmethod
    def of(cls, deliveries: Iterable[Delivery | None]) -> DeliveryAudit | None:
        """The audit of the answers that have a delivery; None where none has."""
        known = [d for d in deliveries if d is not None]
        if not known:
            return None
        counted = [d.server_tokens for d in known if d.server_tokens is not None]
        per_chunk = [b[0] - a[0] for d in known for a, b in zip(d.arrivals, d.arrivals[1:])]
        return cls(
            answers=len(known),
            frames=sum(d.frames for d in known),
            token_chunks=sum(len(d.arrivals) for d in known),
            received_tokens=sum(d.received_tokens for d in known),
            server_tokens=sum(counted) if counted else None,
            counted_by_server=len(counted),
            stream_s=sum(d.stream_s for d in known),
            itl_per_token_ms=_median_ms([g for d in known for g in d.itl_per_token_s()]),
            itl_per_chunk_ms=_median_ms(per_chunk),
            first_frame_lead_ms=_median_ms([d.first_frame_lead_s for d in known if d.first_frame_lead_s is not None]),
        )

    @property
    def chunks_per_token(self) -> float | None:
        """Token-carrying frames per token received: 1.0 is a token a frame, 0.25 four tokens a frame."""
        return self.token_chunks / self.received_tokens if self.received_tokens else None

    @property
    def frames_per_s(self) -> float | None:
        return self.frames / self.stream_s if self.stream_s > 0 else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.received_tokens / self.stream_s if self.stream_s > 0 else None

    def line(self) -> str:
        """The audit as one line, e.g. 'delivery of 3 answers: 12 tokens received, 12 by the server's count;
        1.00 chunks per token; 40.1 frames/s against 22.9 tokens/s; ITL 41.2 ms per token (41.2 per chunk);
        the first frame 3.1 ms before the first token, left out of TTFT'."""
        server = (
            "the server gave no count"
            if self.server_tokens is None
            else f"{self.server_tokens} by the server's count"
            + ("" if self.counted_by_server == self.answers else f" (for {self.counted_by_server} of them)")
        )
        parts = [
            f"delivery of {self.answers} answer{'s' if self.answers != 1 else ''}: "
            f"{self.received_tokens} tokens received, {server}"
        ]
        if self.chunks_per_token is not None:
            parts.append(f"{self.chunks_per_token:.2f} chunks per token")
        if self.frames_per_s is not None:
            parts.append(f"{self.frames_per_s:.1f} frames/s against {self.tokens_per_s:.1f} tokens/s")
        if self.itl_per_token_ms is not None:
            parts.append(f"ITL {self.itl_per_token_ms:.1f} ms per token ({self.itl_per_chunk_ms:.1f} per chunk)")
        if self.first_frame_lead_ms:
            parts.append(f"the first frame {self.first_frame_lead_ms:.1f} ms before the first token, left out of TTFT")
        return "; ".join(parts)

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "chunks_per_token": self.chunks_per_token,
            "frames_per_s": self.frames_per_s,
            "tokens_per_s": self.tokens_per_s,
        }


def _median_ms(seconds: list[float]) -> float | None:
    return 1000 * statistics.median(seconds) if seconds else None
