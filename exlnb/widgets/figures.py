"""What a generation looks like: its figures in words, its samples as HTML (live and in the record) and as text.

One definition of each: the live widget, the static record it leaves and the plain-text output all say the
same things with the same words.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

from exlnb.engines.base import DecodeSpan, EosReason, SamplerSettings, StreamEvent, Tokenizer
from exlnb.engines.declaration import declared
from exlnb.generation import Generation, Sample
from exlnb.templates import summarise
from exlnb.widgets.branches import branch_key
from exlnb.widgets.tokens import sample_token_records, tokens_html, tokens_text

FINDINGS_SHOWN = 3  # template findings listed in the warning (another template's tags are one); the rest counted
SAMPLING_SHAPE = ("temperature", "top_k", "top_p")  # what "greedy" says in one word
MAIN_SETTINGS = (*SAMPLING_SHAPE, "token_repetition_penalty")  # shown even at their defaults: they shape every answer


# -- figures, in words -------------------------------------------------------------------------------------


QUEUED_SHARE = 0.2  # a TTFT says how long its job waited before its prefill where that is this much of it


@dataclass(frozen=True)
class PromptWork:
    """What one sample's prompt cost before its first token, as the samples' events tell it.

    Samples started together share the prompt's pages: one computes them while the others wait for them, so
    the others' prefill time is mostly that wait ("prefill 91 tokens in 2760 ms (22 tok/s)" for a sample whose
    prompt sample 0 had computed). Such a sample says whose prefill it waited for, and gives no prefill time."""

    prompt_tokens: int
    ttft_ms: float | None
    queued_ms: float | None  # submit -> its prefill began, where that is a notable part of the TTFT
    cached: int  # prompt tokens found in the cache when the generation started
    waited_for: int | None  # the sample whose prefill computed `shared` of its prompt tokens
    shared: int
    computed: int  # prompt tokens its own prefill computed
    prefill_ms: float | None  # how long that took, where known and not mostly a wait
    prefill_rate: float | None

    @classmethod
    def of(cls, index: int, events: Sequence[StreamEvent | None]) -> PromptWork:
        """Sample `index`'s prompt work among the latest events of all its generation's samples (by index)."""
        event = events[index]
        cached = min(e.cached_tokens for e in events if e is not None)
        shared = event.cached_tokens - cached
        waited_for = next(i for i, e in enumerate(events) if e is not None and e.cached_tokens == cached)
        rate = event.prefill_tokens_per_s if event.computed_prompt_tokens and not shared else None
        prefill_ms = 1000 * event.computed_prompt_tokens / rate if rate else None
        ttft_ms = None if event.time_to_first_token_s is None else 1000 * event.time_to_first_token_s
        queued = ttft_ms - prefill_ms if ttft_ms is not None and prefill_ms is not None else None
        return cls(
            event.prompt_tokens,
            ttft_ms,
            queued if queued and queued >= QUEUED_SHARE * ttft_ms else None,
            cached,
            waited_for if shared else None,
            shared,
            event.computed_prompt_tokens,
            prefill_ms,
            rate,
        )

    def same_work(self, other: PromptWork) -> bool:
        """Whether two samples did the same prompt work (then their figures are said once, above them)."""
        return (self.cached, self.waited_for, self.shared, self.computed) == (
            other.cached,
            other.waited_for,
            other.shared,
            other.computed,
        )

    def figures(self) -> list[tuple[str, str, str]]:
        """(name, value, the words of the plain-text status) of each figure known: the TTFT (with how long the job
        waited before its prefill, where that is much of it), the tokens cached, the sample waited for, and
        what the prefill computed in how long, before its rate: a cache hit leaves few tokens to compute, and a
        rate over a few tokens is mostly fixed cost (issue 12: 512 of 599 tokens cached read "prefill 38 tok/s")."""
        figures = []
        if self.ttft_ms is not None:
            queued = f" ({self.queued_ms:.0f} ms before its prefill began)" if self.queued_ms is not None else ""
            figures.append(("TTFT", f"{self.ttft_ms:.0f} ms{queued}", f"TTFT {self.ttft_ms:.0f} ms{queued}"))
        if self.cached:
            figures.append(("cached", str(self.cached), f"{self.cached} of {self.prompt_tokens} prompt tokens cached"))
        if self.waited_for is not None:
            waited = f"sample {self.waited_for}'s prefill of {self.shared} prompt tokens"
            figures.append(("waited for", waited, f"waited for {waited}"))
        if self.prefill_ms is not None:
            took = f"{self.computed} tokens in {self.prefill_ms:.0f} ms"
            figures.append(("prefill", took, f"prefill {took} ({self.prefill_rate:.0f} tok/s)"))
        elif self.waited_for is not None:
            figures.append(("prefill", f"{self.computed} tokens", f"prefill {self.computed} tokens"))
        return figures


def prompt_works(generation: Generation) -> list[PromptWork | None]:
    """Each sample's prompt work, None for a sample with no event yet."""
    events = [s.last for s in generation.samples]
    return [None if e is None else PromptWork.of(i, events) for i, e in enumerate(events)]


def shared_work(works: Sequence[PromptWork | None]) -> bool:
    """Whether every sample that has started did the same prompt work, so that the head says it once."""
    started = [w for w in works if w is not None]
    return all(w.same_work(started[0]) for w in started)


def decode_together(generation: Generation) -> tuple[str, str] | None:
    """The samples' decode rate as one (`DecodeSpan`), and for several samples what it divides, in words."""
    span = DecodeSpan.of([s.last for s in generation.samples if s.last is not None])
    if span.tokens_per_s is None:
        return None
    samples = len(generation.samples)
    how = (
        f"({samples} samples together: {span.tokens} tokens over the {span.seconds:.1f} s while any was decoding)"
        if samples > 1
        else ""
    )
    return f"{span.tokens_per_s:.1f} tok/s", how


def end_words(sample: Sample) -> str:
    """Why a sample ended, in plain words (`EosReason.words`), and who stopped it when it was cancelled."""
    reason = sample.eos_reason.words if sample.eos_reason else "ended"
    return f"ended: {reason}" + (f" ({sample.stopped_by})" if sample.stopped_by else "")


def sample_state(sample: Sample, generation: Generation) -> str:
    """running, done, stopped (Stop, an interrupt, the job table, the loop guard) or error (the engine failed)."""
    if sample.done:
        return {EosReason.CANCELLED: "stopped", EosReason.FAILED: "error"}.get(sample.eos_reason, "done")
    return "error" if generation.done else "running"


def status_line(sample: Sample, generation: Generation) -> str:
    """state, tokens, TTFT, prefill and decode speed, elapsed time, and why it ended (the plain-text status)."""
    event = sample.last
    if event is None:
        return "pending"
    state = sample_state(sample, generation)
    parts = [state if state != "running" else event.stage.value, f"{event.new_tokens} tokens"]
    parts += [words for _name, _value, words in prompt_works(generation)[sample.index].figures()]
    if event.decode_tokens_per_s:
        parts.append(f"decode {event.decode_tokens_per_s:.1f} tok/s")
    parts.append(f"{sample.elapsed_s():.1f} s")
    parts += [w for w in (taken_back_words(event),) if w]
    if event.eos:
        parts.append(end_words(sample))
        if sample.loop is not None:
            parts.append(loop_words(sample))
    return " · ".join(parts)


def taken_back_words(event: StreamEvent) -> str | None:
    """When a ban took text back: the engine spelled a banned string and rewound it (the text shown never held it)."""
    if not event.taken_back:
        return None
    times = "once" if event.taken_back == 1 else f"{event.taken_back} times"
    return f"a banned string was taken back {times}"


def loop_words(sample: Sample) -> str:
    """The repetition the loop guard found (`exlnb.analysis.find_tail_loop` looks at the last 32 tokens)."""
    period = f", period {sample.loop.period} tokens" if sample.loop.period else ""
    return f"loop: {sample.loop.repeated_fraction:.0%} of the last 32 tokens repeat{period}"


def template_warning(generation: Generation) -> str | None:
    """One line on a prompt that breaks its template (the model then answers garbage), or None."""
    findings = generation.prompt_findings
    if not findings:
        return None
    return (
        f"the prompt does not follow the template: {len(findings)} finding{'s' if len(findings) > 1 else ''}, "
        f"the answer may be garbage (--show-prompt shows the tokens)"
    )


def finding_lines(generation: Generation) -> list[str]:
    """The template findings under the warning: another template's tags as one finding, then the others."""
    return summarise(generation.prompt_findings, generation.request.template, generation.session.tokenizer)


def sample_text(sample: Sample, generation: Generation) -> str:
    """One sample's text, its tokens when asked for, and its status, as plain output prints it when it ends."""
    head = f"--- sample {sample.index} ---\n" if len(generation.samples) > 1 else ""
    return f"{head}{sample.text}\n{token_line(sample, generation)}[{status_line(sample, generation)}]"


def token_line(sample: Sample, generation: Generation) -> str:
    """The plain token view and a newline, or nothing when the request did not ask for tokens."""
    records, request = sample_token_records(sample), generation.request
    if not records:
        return ""
    return tokens_text(records, special_ids(generation), request.show_whitespace, request.token_colour) + "\n"


def special_ids(generation: Generation) -> set[int]:
    return set(generation.session.tokenizer.special_tokens().values())


def generation_text(generation: Generation) -> str:
    warning = template_warning(generation)
    decode = decode_together(generation) if len(generation.samples) > 1 else None
    blocks = (
        [settings_words(generation)]
        + ([f"decode {' '.join(decode)}"] if decode else [])
        + [sample_text(s, generation) for s in generation.samples]
    )
    return "\n".join(([f"warning: {warning}"] if warning else []) + blocks)


# -- as HTML -----------------------------------------------------------------------------------------------


def figure(name: str, value: str) -> str:
    return f'<span class="exlnb-figure">{name} <b>{html.escape(value)}</b></span>'


def one_or_each(values: Sequence[str]) -> str:
    """A figure the samples share once; where they differ, each sample's in order."""
    return values[0] if len(set(values)) == 1 else " / ".join(values)


def header_html(generation: Generation) -> str:
    """The figures the samples share, once: the prompt, what of it was cached or computed and the TTFT (where
    every sample did the same prompt work), the decode rate of all samples together, and the sampler settings."""
    works = [w for w in prompt_works(generation) if w is not None]
    if not works:
        return '<div class="exlnb-head exlnb-muted">waiting for the engine</div>'
    figures = [figure("prompt", f"{works[0].prompt_tokens} tokens")]
    if shared_work(works):
        named: dict[str, list[str]] = {}
        for work in works:
            for name, value, _words in work.figures():
                named.setdefault(name, []).append(value)
        figures += [figure(name, one_or_each(values)) for name, values in named.items()]
    figures.append(figure("elapsed", f"{max(s.elapsed_s() for s in generation.samples):.1f} s"))
    if decode := decode_together(generation):  # last: what it divides is said beside it, and may wrap
        rate, how = decode
        figures.append(
            f'<span class="exlnb-figure exlnb-figure-named">decode <b>{rate}</b> '
            f'<span class="exlnb-muted">{html.escape(how)}</span></span>'
        )
    settings = html.escape(settings_words(generation))
    return f'<div class="exlnb-head">{"".join(figures)}</div><div class="exlnb-settings exlnb-muted">{settings}</div>'


def settings_words(generation: Generation) -> str:
    """The sampler settings in effect and what else bounds the answer: the main knobs always (exllamav2's
    defaults are in effect too), every other setting that differs from its default (DRY, XTC, penalties, ...),
    banned strings, stop strings and the constraint."""
    request, sampler = generation.request, generation.request.sampler
    changed = sampler.changed()
    options = declared(SamplerSettings)
    main = [o for o in options if o.name in MAIN_SETTINGS and not (sampler.is_greedy and o.name in SAMPLING_SHAPE)]
    shown = [o for o in options if o in main or (o.name in changed and o.name not in SAMPLING_SHAPE)]
    settings = ["greedy"] * sampler.is_greedy + [f"{o.keyword} {_setting(getattr(sampler, o.name))}" for o in shown]
    words = ["sampler: " + ", ".join(settings)]
    if request.banned_strings:
        words.append("banned: " + ", ".join(repr(b) for b in request.banned_strings))
    stops = [s for s in request.stop if isinstance(s, str)]
    if stops:
        words.append("stop: " + ", ".join(repr(s) for s in stops))
    constraint = generation.samples[0].stream.constraint
    if constraint is not None:
        words.append(f"answer constrained by a {constraint.describe()}")
    return " · ".join(words)


def _setting(value: object) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (frozenset, tuple)):
        return "{" + ", ".join(sorted(repr(v) for v in value)) + "}"
    return str(value)


def sample_html(sample: Sample, generation: Generation, max_new_tokens: int) -> str:
    """One sample's text and its compact status: state, tokens of max with a bar, decode rate, end reason."""
    state = sample_state(sample, generation)
    event = sample.last
    tokens = event.new_tokens if event else 0
    share = min(1.0, tokens / max_new_tokens) if max_new_tokens else 0.0
    parts = [f'<span class="exlnb-state">{state}</span>', f"<span>{tokens}/{max_new_tokens} tokens</span>"]
    if event is not None and event.decode_tokens_per_s:
        parts.append(f"<span>{event.decode_tokens_per_s:.1f} tok/s</span>")
    works = prompt_works(generation)
    if event is not None and not shared_work(works):
        parts += [f"<span>{figure(name, value)}</span>" for name, value, _words in works[sample.index].figures()]
    if event is not None and taken_back_words(event):
        parts.append(f"<span>{html.escape(taken_back_words(event))}</span>")
    if sample.done:
        parts.append(f"<span>{html.escape(end_words(sample))}</span>")
    elif state == "error":
        parts.append("<span>the engine failed: the cell's error says why</span>")
    if sample.loop is not None:
        parts.append(f"<span>{html.escape(loop_words(sample))}</span>")
    label = f'<div class="exlnb-label">sample {sample.index}</div>' if len(generation.samples) > 1 else ""
    records, request = sample_token_records(sample), generation.request
    body = (
        tokens_html(
            records,
            special_ids(generation),
            request.show_whitespace,
            request.token_colour,
            branch_key(sample),
            generation.branch_refusal,
        )
        if records
        else f'<div class="exlnb-text">{html.escape(sample.text)}</div>'
    )
    return (
        f'<div class="exlnb-sample exlnb-{state}">{label}{body}'
        f'<div class="exlnb-bar"><span style="width:{share:.1%}"></span></div>'
        f'<div class="exlnb-status">{"".join(parts)}</div></div>'
    )


def warning_html(generation: Generation) -> str:
    warning = template_warning(generation)
    if warning is None:
        return ""
    lines = finding_lines(generation)
    items = "".join(f"<li>{html.escape(line)}</li>" for line in lines[:FINDINGS_SHOWN])
    if len(lines) > FINDINGS_SHOWN:
        items += f"<li>and {len(lines) - FINDINGS_SHOWN} more</li>"
    return f'<div class="exlnb-warning"><b>⚠ {html.escape(warning)}</b><ul>{items}</ul></div>'


def generation_html(generation: Generation, max_new_tokens: int, prompt: str = "") -> str:
    """A template warning first, then the prompt (`prompt_html`), the shared figures and the samples."""
    columns = f"repeat({min(len(generation.samples), 4)}, minmax(0, 1fr))"
    samples = "".join(sample_html(s, generation, max_new_tokens) for s in generation.samples)
    return (
        f'<div class="exlnb-generation">{warning_html(generation)}{prompt}{header_html(generation)}'
        f'<div class="exlnb-samples" style="grid-template-columns: {columns}">{samples}</div></div>'
    )


def prompt_pieces(ids: Sequence[int], tokenizer: Tokenizer) -> list[tuple[str, bool]]:
    """The prompt exactly as the model gets it: (text of each token, whether it is a special token)."""
    specials = set(tokenizer.special_tokens().values())
    return [(tokenizer.decode([i]), i in specials) for i in ids]


def prompt_html(pieces: list[tuple[str, bool]]) -> str:
    spans = "".join(
        f'<span class="exlnb-token{" exlnb-special" if special else ""}" title="token {i}">'
        f"{html.escape(text).replace(chr(10), '↵' + chr(10))}</span>"
        for i, (text, special) in enumerate(pieces)
    )
    specials = sum(special for _, special in pieces)
    return (
        f'<details class="exlnb-prompt" open><summary>prompt: {len(pieces)} tokens, {specials} special</summary>'
        f'<div class="exlnb-tokens">{spans}</div></details>'
    )


def prompt_text(pieces: list[tuple[str, bool]]) -> str:
    body = "".join(f"⟦{text}⟧" if special else text for text, special in pieces)
    specials = sum(special for _, special in pieces)
    return f"prompt: {len(pieces)} tokens, {specials} special (⟦marked⟧)\n{body}"
