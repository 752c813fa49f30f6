"""What a sample tree looks like: its chains as nested rows (HTML, live and in the record) and as an outline of
text.

Each row is a chain of tokens every sample through it took, under a bar of its share of the samples: its count
(and the expanded or forced samples through it), the model's and the sampler's probability of its first token,
the reference's and the KL where a reference scored it, and after its last token the model's probability that no
sample took (or why its samples ended). A row's first tokens are shaded by the model's probability in the token
view's bands (widgets/tokens.py) and carry their figures in a title; the rest of a long row is plain text. The
rows are `<details>`, so a record folds and unfolds with no kernel and no script; while the kernel that drew it
runs, view.js adds the keys and the action bar (`initialize`, the tree's part), and the rows read as a tree to a
screen reader.
"""

from __future__ import annotations

import html
from collections.abc import Iterator

from exlnb.sample_tree import SampleTree, TreeNode
from exlnb.widgets.tokens import BANDS, band

# A tree of 256 samples of 256 tokens was 5.7 MB of HTML with every token a span named by its node and 32 a row
# titled (3.5 s from display to drawn in the browser test), 2.8 MB with tokens named by their place in the row and 8
# titled (3.0 s), and 1.3 MB with a long row's tokens past the first 32 one run of text (1.1 to 1.3 s; two CPU
# cores, 2026-11-28). So the first `TITLED` tokens of a row carry their figures in a title, the first `SHADED` are
# spans shaded by probability, and the rest of a long row is one run of text whose tokens' lengths say where each is
TITLED = 8
SHADED = 32
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
    """A token's figures for its title: what the row says of its first token, for each of the others too."""
    seed = "" if node.provenance.seed is None else f"seed {node.provenance.seed}, "
    words = [f"#{node.index} {node.text!r}", *figures(tree, node), *after_words(node)]
    return " · ".join([*words, f"{seed}{node.provenance.how}"])


def chip(tree: SampleTree, node: TreeNode, titled: bool) -> str:
    """A token as a span of its chain (view.js counts its place there): shaded unless the model was near sure."""
    shade = band(node.model_probability) if node.model_probability is not None else len(BANDS)
    classes = [f"exlnb-p{shade}"] * (shade < len(BANDS)) + ["exlnb-given"] * node.given
    named = f' class="{" ".join(classes)}"' if classes else ""
    title = f' title="{html.escape(token_title(tree, node))}"' if titled else ""
    return f"<span{named}{title}>{html.escape(visible(node.text))}</span>"


def tail(nodes: tuple[TreeNode, ...]) -> str:
    """A long row's last tokens as one run of text, with each token's length in UTF-16 units (what a browser's text
    offsets count), so that view.js can tell which token a click landed on."""
    if not nodes:
        return ""
    texts = [visible(node.text) for node in nodes]
    lengths = ",".join(str(len(text.encode("utf-16-le")) // 2) for text in texts)
    return f'<span class="exlnb-tail" data-lengths="{lengths}">{html.escape("".join(texts))}</span>'


def chains_under(tree: SampleTree, node: TreeNode) -> Iterator[tuple[TreeNode, ...]]:
    """The chains that start at `node`'s children, as nodes."""
    for chain in tree.chains_after(node.index):
        yield tuple(tree.nodes[i] for i in chain)


def row_html(tree: SampleTree, chain: tuple[TreeNode, ...], level: int) -> str:
    first, last = chain[0], chain[-1]
    share = tree.share(first)
    explored = f" +{first.explored}" if first.explored else ""
    tokens = "".join(chip(tree, node, i < TITLED) for i, node in enumerate(chain[:SHADED])) + tail(chain[SHADED:])
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
        f'<span class="exlnb-chain" data-first="{first.index}" data-count="{len(chain)}">{tokens}</span>'
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
