"""Showing a generation as it happens: a live widget in a notebook, plain text everywhere else.

The widget never consumes a stream itself: `exlnb.generation` does, one thread per sample, and the widget
renders from the sample's state at most 30 times a second, so text appears token by token without ever
waiting on the kernel's event loop. Where no widget front end exists (papermill, nbclient, terminal
IPython) the same call prints the text and the statistics.
"""

from __future__ import annotations

import asyncio
import html
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager

from exlnb.engines.base import StreamEvent, Tokenizer, wall_clock
from exlnb.engines.checks import check_option_names
from exlnb.engines.options import check_display
from exlnb.generation import Generation, Sample, as_request, astart, start
from exlnb.request import GenerationRequest
from exlnb.session import Session
from exlnb.widgets.frontend import widget_frontend

FRAME_S = 1 / 30  # renders per sample per second at most: smooth to the eye, cheap on the comm channel
POLL_S = 0.02  # how often an awaiting cell looks whether its samples have ended


def status_line(sample: Sample) -> str:
    """stage, tokens, TTFT, prefill and decode speed, elapsed time, and why it ended."""
    event = sample.last
    if event is None:
        return "pending"
    parts = [event.stage.value, f"{event.new_tokens} tokens"]
    if event.time_to_first_token_s is not None:
        parts.append(f"TTFT {event.time_to_first_token_s * 1000:.0f} ms")
    if event.cached_tokens:
        parts.append(f"{event.cached_tokens}/{event.prompt_tokens} prompt tokens cached")
    if event.prefill_tokens_per_s:
        parts.append(f"prefill {event.prefill_tokens_per_s:.0f} tok/s")
    if event.decode_tokens_per_s:
        parts.append(f"decode {event.decode_tokens_per_s:.1f} tok/s")
    parts.append(f"{sample.elapsed_s():.1f} s")
    if event.eos:
        reason = event.eos_reason.value if event.eos_reason else "ended"
        parts.append(f"eos: {reason}" + (f" ({sample.stopped_by})" if sample.stopped_by else ""))
        if sample.loop is not None:
            period = f", period {sample.loop.period} tokens" if sample.loop.period else ""
            parts.append(f"loop: {sample.loop.repeated_fraction:.0%} of the last 32 tokens repeat{period}")
    return " · ".join(parts)


def prompt_pieces(ids: Sequence[int], tokenizer: Tokenizer) -> list[tuple[str, bool]]:
    """The prompt exactly as the model gets it: (text of each token, whether it is a special token)."""
    specials = set(tokenizer.special_tokens().values())
    return [(tokenizer.decode([i]), i in specials) for i in ids]


# -- the widget --------------------------------------------------------------------------------------------


class StreamView:
    """Text of each sample side by side, a status line under each, and a Stop button."""

    def __init__(self, generation: Generation, *, prompt_html: str | None = None) -> None:
        import ipywidgets as w

        self.generation = generation
        self._texts = [w.HTML(layout=w.Layout(flex="1 1 0", min_width="0")) for _ in generation.samples]
        self._statuses = [w.HTML() for _ in generation.samples]
        self._rendered_at = [0.0] * len(generation.samples)
        columns = [
            w.VBox([text, status], layout=w.Layout(flex="1 1 0", min_width="0", padding="0 6px"))
            for text, status in zip(self._texts, self._statuses)
        ]
        self.stop_button = w.Button(description="Stop", icon="stop", button_style="danger",
                                    tooltip="cancel every sample of this cell", layout=w.Layout(width="96px"))
        self.stop_button.on_click(lambda _: generation.cancel("stop button", wait=False))
        self.stop_button.add_class("exlnb-stop")
        head = [w.HTML(prompt_html)] if prompt_html else []
        self.widget = w.VBox(head + [w.HBox(columns), self.stop_button])
        self.widget.add_class("exlnb-stream")
        generation.listen(self._on_event)
        for sample in generation.samples:  # whatever arrived before listening
            self._render(sample)

    def _on_event(self, sample: Sample, event: StreamEvent) -> None:
        now = wall_clock()
        if event.eos or now - self._rendered_at[sample.index] >= FRAME_S:
            self._rendered_at[sample.index] = now
            self._render(sample)

    def _render(self, sample: Sample) -> None:
        label = f"<b>sample {sample.index}</b><br>" if len(self._texts) > 1 else ""
        self._texts[sample.index].value = (
            f'{label}<div class="exlnb-text" style="white-space: pre-wrap; line-height: 1.4">'
            f"{html.escape(sample.text)}</div>"
        )
        self._statuses[sample.index].value = (
            f'<div class="exlnb-status" style="font-family: monospace; font-size: 0.85em; color: #666">'
            f"{html.escape(status_line(sample))}</div>"
        )
        if all(s.done for s in self.generation.samples):
            self.stop_button.disabled = True

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


def prompt_html(pieces: list[tuple[str, bool]], findings: list[str]) -> str:
    spans = []
    for i, (text, special) in enumerate(pieces):
        shown = html.escape(text).replace("\n", "↵\n")
        style = ("background:#ffe08a; color:#8a4b00; font-weight:bold; border-radius:3px" if special
                 else f"background:{'#eef3fb' if i % 2 else '#f8f8f8'}")
        spans.append(f'<span title="token {i}" style="{style}">{shown}</span>')
    notes = "".join(f'<div style="color:#b00">{html.escape(f)}</div>' for f in findings)
    specials = sum(special for _, special in pieces)
    return (
        f'<details class="exlnb-prompt"><summary>prompt: {len(pieces)} tokens, {specials} special'
        f'{f", {len(findings)} template findings" if findings else ""}</summary>'
        f'<div style="white-space: pre-wrap; font-family: monospace">{"".join(spans)}</div>{notes}</details>'
    )


def prompt_text(pieces: list[tuple[str, bool]], findings: list[str]) -> str:
    body = "".join(f"⟦{text}⟧" if special else text for text, special in pieces)
    specials = sum(special for _, special in pieces)
    lines = [f"prompt: {len(pieces)} tokens, {specials} special (⟦marked⟧)", body, *findings]
    return "\n".join(lines)


# -- plain output ------------------------------------------------------------------------------------------


class PlainPrinter:
    """Prints one sample's text as it arrives, or each of several samples when it ends, then the stats."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self._printed = [0] * len(generation.samples)
        self._closed: set[int] = set()

    def on_event(self, sample: Sample, event: StreamEvent) -> None:
        if len(self.generation.samples) == 1:
            self._print_new_text(sample)
        if sample.done:
            self._close(sample)

    def _print_new_text(self, sample: Sample) -> None:
        text = sample.text
        print(text[self._printed[sample.index]:], end="", flush=True)
        self._printed[sample.index] = len(text)

    def _close(self, sample: Sample) -> None:
        if sample.index in self._closed:
            return
        self._closed.add(sample.index)
        if len(self.generation.samples) == 1:
            self._print_new_text(sample)
            print(f"\n[{status_line(sample)}]", flush=True)
        else:
            print(f"--- sample {sample.index} ---\n{sample.text}\n[{status_line(sample)}]", flush=True)

    def finish(self) -> None:
        for sample in self.generation.samples:
            if sample.done:
                self._close(sample)


# -- the calls behind %%exl_generate -----------------------------------------------------------------------


def generate_live(
    request: GenerationRequest | str,
    *,
    background: bool = False,
    show_prompt: bool = False,
    display: str = "auto",
    owner: Hashable | None = None,
    session: Session | None = None,
    **options,
) -> Generation:
    """Start a generation and show it as it runs: a `GenerationRequest`, or a prompt with its options
    (system, template, chat, amnesia, n, max_new_tokens, sampler settings, stop, seed, loop_guard).

    `display` is "auto" (a widget where a front end renders widgets, plain text otherwise), "widget" or
    "text". Without `background` the call returns when every sample has ended (and raises the error of a
    sample that failed); interrupting it cancels them. With `background` it returns at once and the widget
    keeps streaming.

    A cell blocked in this call cannot hear the Stop button (ipykernel handles widget messages only while
    a cell awaits): in a notebook, `await agenerate_live(...)`, which is what `%%exl_generate` does.
    """
    request, use_widget = _entrance(request, options), _wants_widget(display)
    shown = _show(start(request, owner=owner, session=session), background, show_prompt, use_widget)
    if not background:
        with _cancel_on_exit(shown.generation, wait=True):
            shown.wait()
        _raise_failure(shown.generation)
    return shown.generation


async def agenerate_live(
    request: GenerationRequest | str,
    *,
    background: bool = False,
    show_prompt: bool = False,
    display: str = "auto",
    owner: Hashable | None = None,
    session: Session | None = None,
    **options,
) -> Generation:
    """`generate_live` for a notebook cell: awaits the samples, so the kernel handles the Stop button meanwhile
    and its event loop never waits for an engine step; interrupting the kernel cancels the cell's task and
    with it the samples."""
    request, use_widget = _entrance(request, options), _wants_widget(display)
    shown = _show(await astart(request, owner=owner, session=session), background, show_prompt, use_widget)
    if not background:
        with _cancel_on_exit(shown.generation, wait=False):
            await shown.wait_async()
        _raise_failure(shown.generation)
    return shown.generation


class _Shown:
    """A started generation and how it is being shown."""

    def __init__(self, generation: Generation, printer: PlainPrinter | None) -> None:
        self.generation = generation
        self.printer = printer  # None: a widget shows it

    def wait(self) -> None:
        if self.printer is None:
            self.generation.wait()
            return
        self._print_until_done()

    async def wait_async(self) -> None:
        if self.printer is not None:  # plain output has no buttons to listen to: print as it comes
            self._print_until_done()
            return
        while not self.generation.done:  # the kernel's loop runs meanwhile: the Stop button is heard
            await asyncio.sleep(POLL_S)

    def _print_until_done(self) -> None:
        for sample, event in self.generation.follow():
            self.printer.on_event(sample, event)
        self.printer.finish()


@contextmanager
def _cancel_on_exit(generation: Generation, *, wait: bool) -> Iterator[None]:
    """KeyboardInterrupt, task cancellation or any error while waiting cancels every sample, then propagates.
    On an event loop (`wait=False`) the cancels are queued, never waited for."""
    try:
        yield
    except BaseException:
        generation.cancel("interrupted", wait=wait)
        raise


SHOW_OPTIONS = ("background", "show_prompt", "display", "owner", "session")


def _entrance(request: GenerationRequest | str, options: dict) -> GenerationRequest:
    """The request, checked where the user enters; a misspelt option names the valid ones, display's too."""
    check_option_names(options, valid=[*GenerationRequest.option_names(), *SHOW_OPTIONS])
    return as_request(request, options)


def _raise_failure(generation: Generation) -> None:
    if generation.errors:
        raise generation.errors[0]


def _wants_widget(display: str) -> bool:
    check_display(display)
    return display == "widget" or (display == "auto" and widget_frontend())


def _show(generation: Generation, background: bool, show_prompt: bool, use_widget: bool) -> _Shown:
    from IPython.display import display as show

    with _cancel_on_exit(generation, wait=False):
        tokenizer = generation.session.tokenizer
        pieces = prompt_pieces(generation.prompt_ids, tokenizer) if show_prompt else None
        findings = [str(f) for f in generation.prompt_findings] if show_prompt else []
        if use_widget:
            show(StreamView(generation, prompt_html=prompt_html(pieces, findings) if pieces else None))
            return _Shown(generation, None)
        if pieces:
            print(prompt_text(pieces, findings))
        if background:
            jobs = ", ".join(str(s.stream.job_id) for s in generation.samples)
            print(f"{len(generation.samples)} sample(s) running in the background (jobs {jobs}); wait() for the results")
        return _Shown(generation, PlainPrinter(generation))
