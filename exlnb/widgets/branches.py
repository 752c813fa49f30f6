"""The branch tree of an answer: each branch's parent, the position and token forced there, its text and end; and
the chooser that starts a branch where an alternative is chosen in a token view.

Built from results (`GenerationResult.branch`), every branch of one answer recorded in its lineage's family, and
shown as a static record (HTML with the stylesheet, and plain text) like the other views' records, so a saved or
exported notebook keeps it in either theme.

A token view is itself a static record once its answer has ended (`widgets/record.py`), so what hears a choice
is a widget that is never displayed, `BranchChoices`: its front end (view.js, `initialize`) listens for a click,
or Enter, on an alternative in the views of the answers it holds, and the kernel starts that branch and draws
the tree, live, in an output it put under the view, which stays a static record too.
"""

from __future__ import annotations

import html
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from uuid import uuid4

import anywidget
import traitlets

from exlnb.engines.base import wall_clock
from exlnb.generation import Generation, Sample, branch_result, start_branch
from exlnb.streaming import GenerationResult
from exlnb.widgets.record import ASSETS, record_html

DRAW_S = 0.25  # how often a running branch's text is drawn in the tree at most: each drawing is a whole record
KEPT_SHOWN = 60  # characters of a branch's kept text the tree shows before its forced token


@dataclass(frozen=True)
class BranchNode:
    """One answer of the tree: the first (index 0) or a branch of an earlier one."""

    index: int
    job_id: int
    parent: int | None  # index of the answer it branched from
    position: int | None  # in the parent's tokens, where the forced token replaced the parent's
    forced_token: int | None
    forced_text: str | None
    text: str  # its own text: for a branch, from the forced token on
    end: str  # why it ended, in words
    kept: str = ""  # the parent's text before the forced token, which the branch kept
    replaced: str | None = None  # the parent's token that the forced one replaced


@dataclass(frozen=True)
class BranchTree:
    """An answer and every branch run from it (or from its branches), in the order they ran."""

    nodes: tuple[BranchNode, ...]

    @classmethod
    def of(cls, result: GenerationResult, running: Sequence[GenerationResult] = ()) -> BranchTree:
        """The tree `result` belongs to, from its first answer; `running`: its branches still running, as far as
        they have got (a sample's `result()`), after those that have ended."""
        if result.origin is None:
            raise ValueError(
                f"job {result.job_id}'s result does not keep its request, so it has no branches: "
                "branch a result of a generation (exlnb.generate_live, %%exl_generate --out)"
            )
        root = result
        while root.origin.parent is not None:
            root = root.origin.parent
        members = [root, *root.origin.family, *running]
        return cls(tuple(_node(i, member, members) for i, member in enumerate(members)))

    def text(self) -> str:
        return "\n".join(
            f"#{n.index} job {n.job_id}{_branched_words(n)} [{n.end}]: {_text_words(n)}" for n in self.nodes
        )

    def html(self) -> str:
        rows = "".join(
            f"<tr><td>#{n.index}</td><td>{'' if n.parent is None else f'#{n.parent}'}</td>"
            f"<td>{'' if n.position is None else n.position}</td><td>{_forced_html(n)}</td>"
            f'<td class="exlnb-text">{_text_html(n)}</td><td class="exlnb-muted">{html.escape(n.end)}</td></tr>'
            for n in self.nodes
        )
        return (
            '<table class="exlnb-branches"><tr><th>branch</th><th>of</th><th>at</th><th>forced token</th>'
            f"<th>text</th><th>ended</th></tr>{rows}</table>"
        )

    def _repr_mimebundle_(self, **kwargs) -> dict[str, str]:
        return {"text/html": record_html(self.html()), "text/plain": self.text()}

    def __str__(self) -> str:
        return self.text()

    def show(self) -> None:
        """Display the tree as a static record: HTML and text in a notebook, its text in a terminal."""
        from IPython.display import display

        display(self)  # a notebook takes the bundle, a terminal its text/plain, plain Python prints str()


def shown_kept(kept: str) -> str:
    """The end of a branch's kept text, as the tree shows it before the forced token."""
    return kept if len(kept) <= KEPT_SHOWN else "…" + kept[-KEPT_SHOWN:]


def _branched_words(node: BranchNode) -> str:
    if node.parent is None:
        return ""
    return (
        f" ← #{node.parent} at {node.position}, forced {node.forced_text!r} ({node.forced_token})"
        f" in place of {node.replaced!r}"
    )


def _text_words(node: BranchNode) -> str:
    return f"{node.text!r}" if node.parent is None else f"{shown_kept(node.kept)!r} + {node.text!r}"


def _forced_html(node: BranchNode) -> str:
    if node.forced_token is None:
        return ""
    return (
        f"<code>{html.escape(repr(node.forced_text))}</code> ({node.forced_token})"
        f'<div class="exlnb-muted">in place of <code>{html.escape(repr(node.replaced))}</code></div>'
    )


def _text_html(node: BranchNode) -> str:
    """A branch's text after the end of what it kept of its parent's, its forced token marked."""
    if node.parent is None:
        return html.escape(node.text)
    rest = node.text[len(node.forced_text) :]
    return (
        f'<span class="exlnb-kept exlnb-muted">{html.escape(shown_kept(node.kept))}</span>'
        f'<span class="exlnb-forced">{html.escape(node.forced_text)}</span>{html.escape(rest)}'
    )


def _node(index: int, member: GenerationResult, members: list[GenerationResult]) -> BranchNode:
    lineage, parent = member.origin, None
    if lineage.parent is not None:  # the first answer may be a copy (each `Generation.results` makes new ones)
        parent = 0 if lineage.parent.origin.parent is None else members.index(lineage.parent)
    return BranchNode(
        index=index,
        job_id=member.job_id,
        parent=parent,
        position=lineage.at,
        forced_token=lineage.lead[0] if lineage.lead else None,
        forced_text=lineage.lead_text if lineage.lead else None,
        text=member.text,
        end=member.eos_reason.words if member.eos_reason else "running",
        kept=lineage.kept_text,
        replaced=lineage.replaced_text if lineage.lead else None,
    )


# -- choosing an alternative in a token view ---------------------------------------------------------------

_keys: dict[int, str] = {}  # id(sample) -> the key its token view carries, for each sample a chooser holds alive
_offered: dict[Hashable, BranchChoices] = {}  # each cell's chooser (by the cell's owner key), until it runs again
_offered_lock = threading.Lock()


def branch_key(sample: Sample) -> str | None:
    """The key an ended sample's token view carries (`data-exlnb-answer`) when a `BranchChoices` holds it, so
    that choosing an alternative there branches it; None otherwise. Random, so that no record drawn by another
    kernel names an answer held here."""
    return _keys.get(id(sample)) if sample.done else None


class BranchChoices(anywidget.AnyWidget):
    """The answers of one generation shown with their token view, branched where an alternative is chosen, and
    the output under the view where their branch trees are drawn."""

    _esm = ASSETS / "view.js"
    answers = traitlets.List().tag(sync=True)  # the keys of the token views whose alternatives branch here

    def __init__(self, generation: Generation) -> None:
        samples = {uuid4().hex: sample for sample in generation.samples}
        super().__init__(answers=list(samples))  # in the state the front end's model starts from (`initialize`)
        self.generation = generation
        self.display_id = uuid4().hex
        self._samples = samples
        _keys.update({id(sample): key for key, sample in samples.items()})
        self._running: list[tuple[Sample, Generation]] = []  # (the sample branched, its branch) until it ends
        self._refused = ""  # the last choice that could not branch, in one line
        self._drawn_at = 0.0
        self._lock = threading.Lock()  # one drawing at a time, each of one state: none lands after a later one
        self.on_msg(lambda _widget, content, _buffers: self.handle(content))

    @classmethod
    def offer(cls, generation: Generation, owner: Hashable | None = None) -> BranchChoices | None:
        """A chooser for a generation shown with its token view (`tokens=N`) on an engine that can branch, else
        None (on a chat server the view greys its alternatives out and says why). A cell run again (the same
        `owner`) closes the chooser of its last run, whose view the new output replaced: it would otherwise hold
        that generation, and a comm, for the kernel's life."""
        chooser = cls(generation) if generation.request.tokens and generation.branch_refusal is None else None
        if owner is not None:
            with _offered_lock:
                previous = _offered.pop(owner, None)
                if chooser is not None:
                    _offered[owner] = chooser
            if previous is not None:
                previous.close()
        return chooser

    def show(self) -> None:
        """Display the empty output the trees will be drawn in: under the view, now, from the cell (an output first
        displayed from a comm message would land in no cell)."""
        from IPython.display import display

        display({"text/html": "", "text/plain": ""}, raw=True, display_id=self.display_id)

    def handle(self, message: dict) -> None:
        """An alternative chosen (view.js): its answer branched at its position with it forced, on a thread of its
        own, since starting a job waits for the engine's current step, which the kernel's event loop, where
        messages arrive, must never do."""
        if message.get("type") == "branch" and message.get("answer") in self._samples:
            at, token = int(message["at"]), int(message["token"])
            threading.Thread(
                target=self._branch,
                args=(self._samples[message["answer"]], at, token),
                name="exlnb-branch",
                daemon=True,
            ).start()

    def _branch(self, sample: Sample, at: int, token: int) -> None:
        try:
            branch = start_branch(sample.result(), at=at, token=token)
        except (ValueError, RuntimeError) as error:
            # a refused choice, or no model: said under the view in a line, since no cell runs to raise it in
            with self._lock:
                self._refused = f"not branched: {error}"
                self._draw()
            return
        with self._lock:
            self._refused = ""
            self._running.append((sample, branch))
            self._draw()
        for _sample, _event in branch.follow():
            if wall_clock() - self._drawn_at >= DRAW_S:
                with self._lock:
                    self._draw()
        with self._lock:
            branch_result(branch)  # recorded in its tree's family, as `result.branch()` records it
            self._running.remove((sample, branch))
            self._draw()

    def trees(self) -> list[tuple[Sample, BranchTree]]:
        """Each sample that has branches, and its tree (the running branches last)."""
        trees = []
        for sample in self.generation.samples:
            running = [branch.samples[0].result() for parent, branch in self._running if parent is sample]
            tree = BranchTree.of(sample.result(), running)
            if len(tree.nodes) > 1:
                trees.append((sample, tree))
        return trees

    def _draw(self) -> None:
        """The trees, each named by its sample where there are several, and the last refusal, as the output's
        record (under the lock)."""
        from IPython.display import update_display

        self._drawn_at = wall_clock()
        several = len(self.generation.samples) > 1
        html_parts, text_parts = [], []
        for sample, tree in self.trees():
            label_html, label_text = (
                (f'<div class="exlnb-label">sample {sample.index}</div>', f"sample {sample.index}:\n")
                if several
                else ("", "")
            )
            html_parts.append(label_html + tree.html())
            text_parts.append(label_text + tree.text())
        if self._refused:
            html_parts.append(f'<div class="exlnb-warning">{html.escape(self._refused)}</div>')
            text_parts.append(self._refused)
        update_display(
            {"text/html": record_html("".join(html_parts)), "text/plain": "\n".join(text_parts)},
            raw=True,
            display_id=self.display_id,
        )

    def close(self) -> None:
        for sample in self._samples.values():
            _keys.pop(id(sample), None)
        super().close()
