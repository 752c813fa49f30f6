"""The branch tree of an answer: each branch's parent, the position and token forced there, its text and end.

Built from results (`GenerationResult.branch`), every branch of one answer recorded in its lineage's family, and
shown as a static record (HTML with the stylesheet, and plain text) like the other views' records, so a saved or
exported notebook keeps it in either theme.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from exlnb.streaming import GenerationResult
from exlnb.widgets.record import record_html


@dataclass(frozen=True)
class BranchNode:
    """One answer of the tree: the first (index 0) or a branch of an earlier one."""

    index: int
    job_id: int
    parent: int | None  # index of the answer it branched from
    position: int | None  # in the parent's tokens, where the forced token replaced the parent's
    forced_token: int | None
    forced_text: str | None
    text: str
    end: str  # why it ended, in words


@dataclass(frozen=True)
class BranchTree:
    """An answer and every branch run from it (or from its branches), in the order they ran."""

    nodes: tuple[BranchNode, ...]

    @classmethod
    def of(cls, result: GenerationResult) -> BranchTree:
        """The tree `result` belongs to, from its first answer."""
        if result.origin is None:
            raise ValueError(f"job {result.job_id}'s result does not keep its request, so it has no branches: "
                             "branch a result of a generation (exlnb.generate_live, %%exl_generate --out)")
        root = result
        while root.origin.parent is not None:
            root = root.origin.parent
        members = [root, *root.origin.family]
        return cls(tuple(_node(i, member, members) for i, member in enumerate(members)))

    def text(self) -> str:
        return "\n".join(f"#{n.index} job {n.job_id}{_branched_words(n)} [{n.end}]: {n.text!r}" for n in self.nodes)

    def html(self) -> str:
        rows = "".join(
            f"<tr><td>#{n.index}</td><td>{'' if n.parent is None else f'#{n.parent}'}</td>"
            f"<td>{'' if n.position is None else n.position}</td><td>{_forced_html(n)}</td>"
            f'<td class="exlnb-text">{html.escape(n.text)}</td><td class="exlnb-muted">{html.escape(n.end)}</td></tr>'
            for n in self.nodes
        )
        return ('<table class="exlnb-branches"><tr><th>branch</th><th>of</th><th>at</th><th>forced token</th>'
                f"<th>text</th><th>ended</th></tr>{rows}</table>")

    def _repr_mimebundle_(self, **kwargs) -> dict[str, str]:
        return {"text/html": record_html(self.html()), "text/plain": self.text()}

    def show(self) -> None:
        """Display the tree as a static record (HTML and text)."""
        from IPython.display import display

        display(self._repr_mimebundle_(), raw=True)


def _branched_words(node: BranchNode) -> str:
    if node.parent is None:
        return ""
    return f" ← #{node.parent} at {node.position}, forced {node.forced_text!r} ({node.forced_token})"


def _forced_html(node: BranchNode) -> str:
    if node.forced_token is None:
        return ""
    return f"<code>{html.escape(repr(node.forced_text))}</code> ({node.forced_token})"


def _node(index: int, member: GenerationResult, members: list[GenerationResult]) -> BranchNode:
    lineage, parent = member.origin, None
    if lineage.parent is not None:  # the first answer may be a copy (each `Generation.results` makes new ones)
        parent = 0 if lineage.parent.origin.parent is None else members.index(lineage.parent)
    return BranchNode(
        index=index, job_id=member.job_id, parent=parent, position=lineage.at,
        forced_token=lineage.lead[0] if lineage.lead else None, forced_text=lineage.lead_text if lineage.lead else None,
        text=member.text, end=member.eos_reason.words if member.eos_reason else "ended",
    )
