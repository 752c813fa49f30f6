"""Showing a generation as it happens: a live widget in a notebook, plain text everywhere else.

The widget never consumes a stream itself: `exlnb.generation` does, on one background thread, and the widget
redraws from the samples' state at most 30 times a second, so text appears token by token without ever
waiting on the kernel's event loop. When every sample has ended the output becomes a static record of the
answers and their statistics (`exlnb.widgets.record`), which a saved, exported or reopened notebook keeps.
Where no widget front end exists (papermill, nbclient, terminal IPython) the same call prints the text and
the statistics.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from exlnb.engines.base import DEFAULT_MAX_NEW_TOKENS, StreamEvent, wall_clock
from exlnb.engines.checks import check_option_names
from exlnb.engines.declaration import declared, option, takes_options
from exlnb.engines.options import DISPLAY_HELP, DISPLAY_MODES, check_display
from exlnb.generation import (
    Generation,
    Sample,
    as_request,
    astart,
    astart_branch,
    branch_result,
    start,
    start_branch,
)
from exlnb.request import GenerationRequest, takes_request_options
from exlnb.session import Session
from exlnb.streaming import GenerationResult
from exlnb.widgets.branches import BranchChoices
from exlnb.widgets.figures import (
    finding_lines,
    generation_html,
    generation_text,
    prompt_html,
    prompt_pieces,
    prompt_text,
    sample_text,
    settings_words,
    status_line,
    template_warning,
    token_line,
)
from exlnb.widgets.frontend import wants_widget
from exlnb.widgets.record import RecordedView


@dataclass(frozen=True)
class ShowOptions:
    """How a generation is shown: `generate_live`'s own keywords, and `%%exl_generate`'s (and `--display` of every
    magic that shows something)."""

    display: str = option("auto", group="display", choices=DISPLAY_MODES, help=DISPLAY_HELP)
    background: bool = option(False, group="display", help="return at once; the widget keeps streaming")
    show_prompt: bool = option(False, group="display", help="show the exact tokens, special tokens highlighted")

    def __post_init__(self) -> None:
        check_display(self.display)


SHOW_OPTIONS = tuple(o.keyword for o in declared(ShowOptions))
FRAME_S = 1 / 30  # redraws per second at most: smooth to the eye, cheap on the comm channel
POLL_S = 0.02  # how often an awaiting cell looks whether its samples have ended
CANCEL_SETTLE_S = 5.0  # how long an interrupted cell waits for its cancelled samples' last events


class StreamView(RecordedView):
    """A generation's samples side by side, shared figures above them and a Stop button under them; when every
    sample has ended, a static record of the answers and their statistics."""

    def __init__(
        self,
        generation: Generation,
        *,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        prompt: list[tuple[str, bool]] | None = None,
    ) -> None:
        super().__init__()
        self.generation = generation
        self.max_new_tokens = max_new_tokens
        self._prompt_html = prompt_html(prompt) if prompt else ""
        self._rendered_at = 0.0
        self._render_lock = threading.Lock()
        self._final = False
        self.controls = [["stop", "Stop", "cancel every sample of this cell"]]
        generation.listen(self._on_event)
        self.render()
        if all(s.done for s in generation.samples):  # ended before it could listen
            self.finish()

    def _on_event(self, sample: Sample, event: StreamEvent) -> None:
        if all(s.done for s in self.generation.samples):
            self.finish()
        elif wall_clock() - self._rendered_at >= FRAME_S:
            self.render()

    def render(self, *, final: bool = False) -> None:
        with self._render_lock:
            if self._final:
                return
            self._final = final
            self._rendered_at = wall_clock()
            self.html = generation_html(self.generation, self.max_new_tokens, self._prompt_html)

    def finish(self) -> None:
        """Draw the last state, without the Stop button, and leave it as the output's record."""
        self.controls = []
        self.render(final=True)
        self.settle()

    def handle(self, message: dict) -> None:
        if message.get("type") == "stop":
            self.generation.cancel("stop button", wait=False)  # a button never waits for an engine step

    def text(self) -> str:
        return generation_text(self.generation)


# -- plain output ------------------------------------------------------------------------------------------


class PlainPrinter:
    """Prints one sample's text as it arrives, or each of several samples when it ends, then the stats.

    It reads the samples' state, not their events, so it may be called as often or as seldom as the caller
    likes: from a loop over `Generation.follow()`, or between the awaits of a kernel's cell.
    """

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self._printed = [0] * len(generation.samples)
        self._closed: set[int] = set()

    def update(self) -> None:
        """Print what has arrived since the last call: the one sample's new text, and every sample that has ended."""
        for sample in self.generation.samples:
            done = sample.done  # read before the text: a sample's text is complete once it is done
            if len(self.generation.samples) == 1:
                self._print_new_text(sample)
            if done:
                self._close(sample)

    def _print_new_text(self, sample: Sample) -> None:
        text = sample.text
        print(text[self._printed[sample.index] :], end="", flush=True)
        self._printed[sample.index] = len(text)

    def _close(self, sample: Sample) -> None:
        if sample.index in self._closed:
            return
        self._closed.add(sample.index)
        if len(self.generation.samples) == 1:
            self._print_new_text(sample)
            print(f"\n{token_line(sample, self.generation)}[{status_line(sample, self.generation)}]", flush=True)
        else:
            print(sample_text(sample, self.generation), flush=True)


# -- the calls behind %%exl_generate -----------------------------------------------------------------------


class Interrupted(asyncio.CancelledError):
    """A kernel interrupt cancelled a cell while it awaited its work (samples, a load test), and the work with it;
    `generation` holds a generation's samples as they ended, for `--out` (Stop stores them, and so does an
    interrupt).

    IPython shows an exception that has `_render_traceback_` as the lines it returns
    (InteractiveShell.showtraceback): one line, instead of 30 of CancelledError through exlnb and asyncio.
    """

    def __init__(self, words: str, generation: Generation | None = None) -> None:
        super().__init__(words)
        self.generation = generation

    def _render_traceback_(self) -> list[str]:
        return [str(self)]


def interrupted_words(generation: Generation) -> str:
    """'interrupted: job 12 cancelled after 18 tokens', or the jobs and tokens of every sample."""
    jobs = ", ".join(str(s.stream.job_id) for s in generation.samples)
    tokens = ", ".join(str(s.last.new_tokens if s.last else 0) for s in generation.samples)
    plural = "s" if len(generation.samples) > 1 else ""
    return f"interrupted: job{plural} {jobs} cancelled after {tokens} tokens"


@takes_options(ShowOptions)
@takes_request_options
def generate_live(
    request: GenerationRequest | str,
    *,
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
    request, show = _entrance(request, options)
    shown = _show(start(request, owner=owner, session=session), show, owner)
    if not show.background:
        with _cancel_on_exit(shown.generation, wait=True):
            shown.wait()
        _raise_failure(shown.generation)
    return shown.generation


@takes_options(ShowOptions)
@takes_request_options
async def agenerate_live(
    request: GenerationRequest | str,
    *,
    owner: Hashable | None = None,
    session: Session | None = None,
    **options,
) -> Generation:
    """`generate_live` for a notebook cell: awaits the samples, so the kernel handles the Stop button meanwhile
    and its event loop never waits for an engine step. Interrupting the kernel cancels the cell's task and
    with it the samples; the cell's error is one line, `Interrupted` ("interrupted: job 12 cancelled after
    18 tokens")."""
    request, show = _entrance(request, options)
    shown = _show(await astart(request, owner=owner, session=session), show, owner)
    if not show.background:
        await _await_shown(shown)
    return shown.generation


async def _await_shown(shown: _Shown) -> None:
    """Await every sample; an interrupt cancels them and ends the cell in one line; a sample's failure is raised."""
    try:
        with _cancel_on_exit(shown.generation, wait=False):
            await shown.wait_async()
    except asyncio.CancelledError as cancelled:
        await _settle_cancelled(shown)
        raise Interrupted(interrupted_words(shown.generation), shown.generation) from cancelled
    _raise_failure(shown.generation)


def branch_live(
    result: GenerationResult,
    *,
    at: int,
    token: int | str | None = None,
    display: str = "auto",
    owner: Hashable | None = None,
) -> GenerationResult:
    """`result.branch(at, token)` shown as it runs, as `generate_live` shows a generation; the branch's result."""
    show = ShowOptions(display=display)
    shown = _show(start_branch(result, at=at, token=token, owner=owner), show, owner)
    with _cancel_on_exit(shown.generation, wait=True):
        shown.wait()
    _raise_failure(shown.generation)
    return branch_result(shown.generation)


async def abranch_live(
    result: GenerationResult,
    *,
    at: int,
    token: int | str | None = None,
    display: str = "auto",
    owner: Hashable | None = None,
) -> GenerationResult:
    """`branch_live` for a notebook cell: awaits the branch, so the Stop button and an interrupt are heard."""
    show = ShowOptions(display=display)
    shown = _show(await astart_branch(result, at=at, token=token, owner=owner), show, owner)
    await _await_shown(shown)
    return branch_result(shown.generation)


async def _settle_cancelled(shown: _Shown) -> None:
    """Let the cancelled samples send their last events (the engine's next step), so that the interrupt line
    and the status above it give the same token counts; a second interrupt stops waiting for them."""
    try:
        await shown.wait_async(CANCEL_SETTLE_S)
    except asyncio.CancelledError:
        pass


class _Shown:
    """A started generation and how it is being shown: a widget, or a printer of plain text."""

    def __init__(self, generation: Generation, view: StreamView | None, printer: PlainPrinter | None) -> None:
        self.generation = generation
        self.view = view
        self.printer = printer

    def wait(self) -> None:
        if self.printer is None:
            self.generation.wait()
        else:
            for _ in self.generation.follow():
                self.printer.update()
        self._finish()

    async def wait_async(self, timeout_s: float = math.inf) -> None:
        """Await the samples (at most `timeout_s`), printing or redrawing as they come. The kernel's event loop
        runs between the awaits, so the Stop button and an interrupt are heard at once: ipykernel's interrupt
        handler is a callback on that loop, and a print loop that blocked it ran 400 tokens on for 13 s."""
        deadline = wall_clock() + timeout_s
        while not self.generation.done and wall_clock() < deadline:
            if self.printer is not None:
                self.printer.update()
            await asyncio.sleep(POLL_S)
        if self.generation.done:
            self._finish()

    def _finish(self) -> None:
        """The last state: the widget's record (also where a sample failed, and so never sent its last event),
        or the rest of the text and every sample's status."""
        if self.printer is None:
            self.view.finish()
        else:
            self.printer.update()


@contextmanager
def _cancel_on_exit(generation: Generation, *, wait: bool) -> Iterator[None]:
    """KeyboardInterrupt, task cancellation or any error while waiting cancels every sample, then propagates.
    On an event loop (`wait=False`) the cancels are queued, never waited for."""
    try:
        yield
    except BaseException:
        generation.cancel("interrupted", wait=wait)
        raise


def _entrance(request: GenerationRequest | str, options: dict) -> tuple[GenerationRequest, ShowOptions]:
    """The request and how to show it, checked where the user enters; a misspelt option names the valid ones,
    display's too."""
    check_option_names(options, valid=[*GenerationRequest.option_names(), *SHOW_OPTIONS, "owner", "session"])
    show = ShowOptions(**{name: options.pop(name) for name in SHOW_OPTIONS if name in options})
    return as_request(request, options), show


def _raise_failure(generation: Generation) -> None:
    if generation.errors:
        raise generation.errors[0]


def _show(generation: Generation, show: ShowOptions, owner: Hashable | None = None) -> _Shown:
    with _cancel_on_exit(generation, wait=False):
        pieces = prompt_pieces(generation.prompt_ids, generation.session.tokenizer) if show.show_prompt else None
        if wants_widget(show.display):
            choices = BranchChoices.offer(generation, owner)  # before the view can draw its end, which then can branch
            view = StreamView(generation, max_new_tokens=generation.request.max_new_tokens, prompt=pieces)
            view.show()
            if choices is not None:
                choices.show()  # the output under the view where the branches' tree will be drawn
            return _Shown(generation, view, None)
        warning = template_warning(generation)
        if warning:
            print(f"warning: {warning}")
            print("\n".join(finding_lines(generation)))
        if pieces:
            print(prompt_text(pieces))
        print(settings_words(generation))
        if show.background:
            jobs = ", ".join(str(s.stream.job_id) for s in generation.samples)
            print(
                f"{len(generation.samples)} sample(s) running in the background (jobs {jobs}); wait() for the results"
            )
        return _Shown(generation, None, PlainPrinter(generation))
