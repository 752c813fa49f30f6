"""The sample tree in a notebook: drawn as it grows, then grown further by choosing in it.

The tree is always a static record (HTML with the stylesheet, and its text outline), redrawn in place under a
display id as samples merge (at most every `DRAW_S`), so a saved, reopened or exported notebook keeps it as it
last stood. What hears a choice is `TreeChoices`, a widget never displayed, as `BranchChoices` hears a token
view's: while its kernel runs, view.js marks the tree live and sends what is chosen there (a node expanded to a
mass, text forced after a node, Stop), and the kernel grows the tree on a thread of its own and draws it again.
With a reference, every node also shows the reference's probability and the KL (exlnb.tree_reference), computed
once the samples have ended and again after each expansion.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Hashable
from pathlib import Path
from uuid import uuid4

import anywidget
import traitlets

from exlnb.engines.base import wall_clock
from exlnb.engines.declaration import takes_options
from exlnb.engines.options import check_display
from exlnb.request import GenerationRequest
from exlnb.sample_tree import SampleTree
from exlnb.session import Session, TreeGrowth, get_session
from exlnb.tree_reference import check, compare
from exlnb.trees import TREE_OPTIONS, TreeOptions, grow
from exlnb.widgets.frontend import wants_widget
from exlnb.widgets.record import ASSETS, record_html
from exlnb.widgets.stream import Interrupted
from exlnb.widgets.tree_figure import tree_html, tree_text

DRAW_S = 0.5  # how often a growing tree is drawn at most, per MB of its record: each drawing is a whole record
POLL_S = 0.05  # how often an awaiting cell looks whether the tree has stopped growing

_shown: dict[Hashable, TreeView] = {}  # each cell's tree view (by the cell's owner key), until the cell runs again
_shown_lock = threading.Lock()


class TreeChoices(anywidget.AnyWidget):
    """Never displayed: its front end (view.js) hears what is chosen in the tree views it names, while its kernel
    runs, and the view grows the tree."""

    _esm = ASSETS / "view.js"
    trees = traitlets.List().tag(sync=True)  # the keys of the tree views it hears

    def __init__(self, view: TreeView) -> None:
        super().__init__(trees=[view.key])
        self.view = view
        self.on_msg(lambda _widget, content, _buffers: view.handle(content))


class TreeView:
    """One tree, as a record redrawn in place; grown further where a `TreeChoices` hears it."""

    def __init__(
        self,
        source: SampleTree | TreeGrowth,
        *,
        reference: str | Path | None = None,
        mass: float = 0.9,
        live: bool = True,
        on_change: Callable[[SampleTree], None] | None = None,
    ) -> None:
        self.growth = source if isinstance(source, TreeGrowth) else source.grower
        self.tree = source.tree() if isinstance(source, TreeGrowth) else source
        self.reference = reference
        self.mass = mass
        self.on_change = on_change
        self.status = "growing" if isinstance(source, TreeGrowth) and not source.done else ""
        self.display_id = uuid4().hex
        grows = isinstance(self.growth, TreeGrowth)
        self.key = uuid4().hex if live and grows else None
        self.chooser = TreeChoices(self) if self.key else None
        self._drawn_at = 0.0
        self._drawn_bytes = 0
        self._lock = threading.Lock()  # one drawing at a time, each of one state: none lands after a later one
        if grows:
            self.growth.listen(self._merged)

    def record(self) -> dict[str, str]:
        body = tree_html(self.tree, key=self.key, mass=self.mass, status=self.status)
        return {"text/html": record_html(body), "text/plain": tree_text(self.tree)}

    def show(self) -> None:
        from IPython.display import display

        display(self.record(), raw=True, display_id=self.display_id)

    def draw(self) -> None:
        """The tree as it stands, over its last drawing."""
        from IPython.display import update_display

        with self._lock:
            if self.growth is not None:
                self.tree = self._keep_reference(self.growth.tree())
            self._drawn_at = wall_clock()
            record = self.record()
            self._drawn_bytes = len(record["text/html"])
            update_display(record, raw=True, display_id=self.display_id)

    def _keep_reference(self, tree: SampleTree) -> SampleTree:
        """A new drawing keeps the reference figures the last one had (its nodes keep their indices)."""
        if self.tree.reference is None:
            return tree
        figures = {n.index: (n.reference_probability, n.kl) for n in self.tree.nodes if n.reference_probability}
        return tree.with_reference(self.tree.reference, figures)

    def _merged(self) -> None:
        # a big tree's record takes the browser seconds to draw (docs/tree.md): it is drawn less often
        if wall_clock() - self._drawn_at >= DRAW_S * max(1.0, self._drawn_bytes / 1e6):
            self.draw()

    def settle(self, words: str = "") -> SampleTree:
        """The tree once it has stopped growing: compared with the reference where one is given, drawn, handed to
        `on_change`."""
        self.status = words
        if self.growth is not None:
            self.tree = self.growth.tree()
        if self.reference is not None:
            self.status = f"comparing with {self.reference} ..."
            self.draw()
            self.tree = compare(self.growth.session if self.growth else get_session(), self.tree, self.reference)
            self.status = words
        self.draw()
        if self.on_change is not None:
            self.on_change(self.tree)
        return self.tree

    def handle(self, message: dict) -> None:
        """A choice in the view (view.js): grown on a thread of its own, since growing waits for engine steps,
        which the kernel's event loop, where messages arrive, must never do."""
        kind = message.get("type")
        if message.get("tree") != self.key or self.growth is None:
            return
        if kind == "stop":
            self.growth.cancel()
            return
        try:
            node = self.tree.down(int(message.get("node", -1)), int(message.get("offset", 0)))
        except (TypeError, ValueError) as error:  # a message names a node as view.js does, or is refused
            self.status = f"not grown: {error}"
            self.draw()
            return
        if kind == "expand":
            mass = message.get("mass", self.mass)
            act, words = (lambda: self.growth.expand(node, float(mass))), f"expanding node {node} to {mass}"
        elif kind == "force":
            text = str(message.get("text", ""))
            act, words = (lambda: self.growth.force(node, text)), f"forcing {text!r} after node {node}"
        else:
            return
        threading.Thread(target=self._grow, args=(act, words), name="exlnb-tree-choice", daemon=True).start()

    def _grow(self, act: Callable[[], SampleTree], words: str) -> None:
        self.status = words + " ..."
        self.draw()
        try:
            act()
        except (ValueError, RuntimeError) as error:  # a refused choice: said in the view, no cell runs to raise it
            self.status = f"not grown: {error}"
            self.draw()
            return
        self.settle(self.growth.last_words)

    def close(self) -> None:
        """Hear no more choices, draw no more merges: the cell that showed it ran again."""
        if self.chooser is not None:
            self.chooser.close()
        if isinstance(self.growth, TreeGrowth):
            self.growth.forget(self._merged)


def show_tree(
    tree: SampleTree | TreeGrowth,
    *,
    reference: str | Path | None = None,
    mass: float = TreeOptions.mass,
    display: str = "auto",
    owner: Hashable | None = None,
    on_change: Callable[[SampleTree], None] | None = None,
) -> TreeView | None:
    """Show a tree (or a growing one, redrawn as it grows): a record that, in a notebook whose kernel runs, grows
    further where a node is chosen; as its text outline where no widget front end exists (None then)."""
    check_display(display)
    if not wants_widget(display):
        return None
    view = TreeView(tree, reference=reference, mass=mass, on_change=on_change)
    if owner is not None:
        with _shown_lock:
            previous, _shown[owner] = _shown.get(owner), view
        if previous is not None:
            previous.close()
    view.show()
    return view


def _start(request: GenerationRequest | str, options: dict) -> tuple:
    """The options checked (`tree_live`'s), the tree's growth started and its view shown (None for text)."""
    display, owner = options.pop("display", "auto"), options.pop("owner", None)
    on_change, session = options.pop("on_change", None), options.pop("session", None)
    tree = TreeOptions(**{name: options.pop(name) for name in TREE_OPTIONS if name in options})
    check_display(display)
    if tree.reference is not None:
        check(session or get_session(), tree.reference)
    growth = grow(request, n=tree.n, tokens=tree.tokens, session=session, **options)
    shown = dict(reference=tree.reference, mass=tree.mass, display=display, owner=owner, on_change=on_change)
    return growth, show_tree(growth, **shown), tree.reference, on_change


def _finish(growth: TreeGrowth, view: TreeView | None, reference: str | None, on_change) -> SampleTree:
    """The grown tree, compared with `reference` where given: the view settled, or the outline printed."""
    if view is not None:
        view.settle()
    tree = growth.wait()  # the error of a sample that failed
    if view is not None:
        return view.tree
    if reference is not None:
        tree = compare(growth.session, tree, reference)
    print(tree_text(tree))
    if on_change is not None:
        on_change(tree)
    return tree


@takes_options(TreeOptions)
def tree_live(
    request: GenerationRequest | str,
    *,
    display: str = "auto",
    owner: Hashable | None = None,
    on_change: Callable[[SampleTree], None] | None = None,
    session: Session | None = None,
    **options,
) -> SampleTree:
    """Grow a tree of the request's prompt and show it as it grows; the tree, compared with its `reference` where
    given. `options` are `TreeOptions`' and `exlnb.trees.grow`'s (the prompt's and the sampler's); `on_change`
    hears every tree the view shows from its end on. An interrupt cancels its jobs. In a notebook,
    `await atree_live(...)`, so that Stop is heard (`%%exl_tree` does)."""
    options.update(display=display, owner=owner, on_change=on_change, session=session)
    growth, view, reference, on_change = _start(request, options)
    try:
        growth.wait()
    except KeyboardInterrupt:
        growth.cancel()
        raise
    return _finish(growth, view, reference, on_change)


async def atree_live(request: GenerationRequest | str, **options) -> SampleTree:
    """`tree_live` for a notebook cell, with its keywords: awaits the tree, so the kernel hears Stop and an interrupt
    meanwhile and its event loop never waits for an engine step; an interrupt ends the cell in one line."""
    growth, view, reference, on_change = _start(request, options)
    try:
        while not growth.done:
            await asyncio.sleep(POLL_S)
    except asyncio.CancelledError as cancelled:
        growth.cancel()
        raise Interrupted("interrupted: every job of the tree cancelled") from cancelled
    return await asyncio.to_thread(_finish, growth, view, reference, on_change)


atree_live.__signature__ = inspect.signature(tree_live)
