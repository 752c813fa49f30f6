"""What a sample tree looks like: its chains as nested rows (HTML, live and in the record) and as an outline of
text.

Each row is a chain of tokens every sample through it took, under a bar of its share of the samples: its count
(and the expanded or forced samples through it), the model's and the sampler's probability of its first token,
the reference's and the KL where a reference scored it, and after its last token the model's probability that no
sample took (or why its samples ended). Each token is shaded by the model's probability in the token view's
bands (widgets/tokens.py) and carries its figures in a title. The rows are `<details>`, so a record folds and
unfolds with no kernel and no script; while the kernel that drew it runs, view.js adds the keys and the action bar
(`initialize`, the tree's part), and the rows read as a tree to a screen reader.
"""

from __future__ import annotations

import html
from collections.abc import Iterator

from exlnb.sample_tree import SampleTree, TreeNode
from exlnb.widgets.tokens import BANDS, band

TITLED = 32  # tokens of a chain that carry their figures in a title: past these a chain is text to read
HELP = (
    "bar: share of the samples · ×count (+expanded or forced) · shade: the model's probability · hover a token for "
    "its figures · untaken: the model's probability after a row that no sample took"
)


def visible(text: str) -> str:
    """A token's text on one line: a newline as ↵, a tab as →; ∅ for none."""
    return (text.replace("\n", "↵").replace("\t", "→")) or "∅"


def figures(tree: SampleTree, node: TreeNode) -> list[str]:
    """A node's figures in words: the model's and the sampler's probability, the reference's and the KL."""
    words = []
    if node.model_probability is not None:
        words.append(f"p {node.model_probability:.3f}")
    if node.given:
        words.append("given, not drawn")
    elif node.sampled_probability is not None:
        words.append(f"sampled {node.sampled_probability:.3f}")
    if node.reference_probability is not None:
        words.append(f"ref {node.reference_probability:.3f}")
    if node.kl is not None:
        words.append(f"KL {node.kl:.3g}")
    return words


def after_words(node: TreeNode) -> list[str]:
    """What comes after a row's last token: the probability no sample took, and why samples ended there."""
    words = [] if node.untaken is None else [f"untaken {node.untaken:.2f}"]
    return words + [f"ended: {reason}" for reason in dict.fromkeys(node.ended)]


def token_title(tree: SampleTree, node: TreeNode) -> str:
    after = after_words(node)
    return " · ".join([f"#{node.index} {node.text!r}", *figures(tree, node), *after, node.provenance.words()])


def chip(tree: SampleTree, node: TreeNode, titled: bool) -> str:
    shade = "" if node.model_probability is None else f" exlnb-p{band(node.model_probability)}"
    given = " exlnb-given" if node.given else ""
    title = f' title="{html.escape(token_title(tree, node))}"' if titled else ""
    text = html.escape(visible(node.text))
    return f'<span class="exlnb-tok{shade}{given}" data-node="{node.index}"{title}>{text}</span>'


def chains_under(tree: SampleTree, node: TreeNode) -> Iterator[tuple[TreeNode, ...]]:
    """The chains that start at `node`'s children, as nodes."""
    for chain in tree.chains_after(node.index):
        yield tuple(tree.nodes[i] for i in chain)


def row_html(tree: SampleTree, chain: tuple[TreeNode, ...], level: int) -> str:
    first, last = chain[0], chain[-1]
    share = tree.share(first)
    explored = f" +{first.explored}" if first.explored else ""
    tokens = "".join(chip(tree, node, i < TITLED) for i, node in enumerate(chain))
    said = " · ".join([*figures(tree, first), *after_words(last)])
    children = "".join(row_html(tree, c, level + 1) for c in chains_under(tree, last))
    group = f'<ul role="group">{children}</ul>' if children else ""
    kind = " exlnb-leaf" if not children else ""
    label = html.escape(f"×{first.count}{explored}, {share:.0%}: {''.join(n.text for n in chain)[:80]} · {said}")
    return (
        f'<li role="none"><details open class="exlnb-tree-item{kind}">'
        f'<summary role="treeitem" aria-level="{level}" aria-label="{label}" data-node="{last.index}">'
        f'<span class="exlnb-share"><span style="width:{100 * share:.1f}%"></span></span>'
        f'<span class="exlnb-count">×{first.count}{explored}</span>'
        f'<span class="exlnb-chain">{tokens}</span>'
        f'<span class="exlnb-figs">{html.escape(said)}</span></summary>{group}</details></li>'
    )


def head_words(tree: SampleTree) -> str:
    root = tree.nodes[0]
    seeds = sorted({n.provenance.seed for n in tree.nodes[1:] if n.provenance.seed is not None})
    seed_words = f", seeds {seeds[0]}-{seeds[-1]}" if seeds else ""
    reference = f" · compared with {tree.reference}" if tree.reference else ""
    explored = f" (+{root.explored} expanded or forced)" if root.explored else ""
    return (
        f"{tree.samples} samples{explored} of {len(tree.prompt_ids)} prompt tokens · {len(tree.nodes) - 1} tokens "
        f"in {len(tree.chains())} rows · {root.provenance.about()}{seed_words}{reference}"
    )


def actions_html(mass: float) -> str:
    """The action bar: shown only while the kernel that drew the tree runs (view.js marks it .exlnb-tree-live)."""
    return (
        '<div class="exlnb-tree-actions">'
        '<span class="exlnb-tree-chosen">choose a token (click it, or a row with ↑ ↓ ← →) to grow the tree after it'
        "</span> "
        f'<label>mass <input class="exlnb-tree-mass" type="number" min="0.01" max="1" step="0.05" value="{mass:g}">'
        '</label> <button class="exlnb-tree-button" data-act="expand" title="e">Expand</button> '
        '<input class="exlnb-tree-text" type="text" placeholder="text to force after it" aria-label="text to force"> '
        '<button class="exlnb-tree-button" data-act="force" title="f, type, Enter">Force</button> '
        '<button class="exlnb-tree-button exlnb-tree-stop" data-act="stop">Stop</button></div>'
        '<div class="exlnb-tree-off exlnb-muted">growing this tree further needs the live kernel that drew it</div>'
    )


def tree_html(tree: SampleTree, *, key: str | None = None, mass: float = 0.9, status: str = "") -> str:
    """The tree as rows; with `key`, a tree view.js can grow (expand and force at `mass`) while its kernel runs."""
    notes = "".join(f'<div class="exlnb-warning">{html.escape(note)}</div>' for note in tree.notes)
    named = f' data-exlnb-tree="{key}"' if key else ""
    rows = "".join(row_html(tree, chain, 1) for chain in chains_under(tree, tree.nodes[0]))
    legend = "".join(f'<span class="exlnb-chip exlnb-p{i}">&lt;{limit}</span>' for i, limit in enumerate(BANDS))
    legend += f'<span class="exlnb-chip exlnb-p{len(BANDS)}">≥{BANDS[-1]}</span>'
    state = f'<div class="exlnb-tree-status">{html.escape(status)}</div>' if status else ""
    return (
        f'<div class="exlnb-tree"{named}><div class="exlnb-head">{html.escape(head_words(tree))}</div>{notes}{state}'
        f"{actions_html(mass) if key else ''}"
        f'<ul class="exlnb-tree-rows" role="tree" aria-label="sample tree">{rows}</ul>'
        f'<div class="exlnb-legend exlnb-muted">{legend} {html.escape(HELP)}</div></div>'
    )


def tree_text(tree: SampleTree) -> str:
    """The tree as an outline: a line per row, indented by depth."""
    lines = [head_words(tree), *tree.notes]

    def outline(node: TreeNode, level: int) -> None:
        for chain in chains_under(tree, node):
            first, last = chain[0], chain[-1]
            explored = f" +{first.explored}" if first.explored else ""
            said = " · ".join([*figures(tree, first), *after_words(last)])
            text = "".join(n.text for n in chain)
            lines.append(
                f"{'  ' * level}#{first.index} ×{first.count}{explored} {tree.share(first):.0%} {text!r} {said}"
            )
            outline(last, level + 1)

    outline(tree.nodes[0], 0)
    return "\n".join(lines)
