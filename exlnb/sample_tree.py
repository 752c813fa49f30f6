"""A sample tree: many answers to one prompt merged into one prefix tree, each node a token with how many samples
took it, how likely the model and the sampler found it, and how much of the model's probability after it no
sample took.

The root is the prompt; a node's children are the tokens that came after it. `TreeBuilder` merges samples token
by token as they stream (`exlnb.session.exploring` grows one), and `freeze()` hands out the tree as it stands, a
frozen `SampleTree`. Counts are of drawn samples only: a branch a researcher expanded or forced is counted apart
(`explored`), so a node's share of the samples still estimates what the sampler does. Every node keeps the
provenance of the first sample that reached it (model, format and bits, engine, sampler settings, seed, and
whether it was drawn, expanded or forced); `reference_probability` and `kl` are filled where a reference model
scored the tree (`exlnb.trees.compare`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from exlnb.engines.token_info import TokenInfo

HOW = ("sampled", "expanded", "forced")
FRAME_COLUMNS = (
    "node",
    "parent",
    "depth",
    "token_id",
    "text",
    "count",
    "share",
    "explored",
    "model_probability",
    "sampled_probability",
    "untaken",
    "reference_probability",
    "kl",
    "how",
    "given",
    "seed",
    "ended",
)


@dataclass(frozen=True)
class Provenance:
    """Where a sample came from: the model (its format and bits), the engine, the sampler, the seed, and how."""

    model: str
    format: str  # "hf", "exl2", "exl3", or "url" for a server
    bits: float | None  # per weight, for EXL2 and EXL3
    engine: str
    sampler: str  # the settings, in words
    seed: int | None
    how: str = "sampled"  # one of HOW

    def about(self) -> str:
        """The model, its format and bits, the engine and the sampler: what every sample of one tree shares."""
        bits = f" {self.bits:g} bpw" if self.bits is not None else ""
        return f"{self.model} ({self.format}{bits}, {self.engine} engine), {self.sampler}"

    def words(self) -> str:
        seed = "" if self.seed is None else f", seed {self.seed}"
        return f"{self.about()}{seed}, {self.how}"


@dataclass(frozen=True)
class TreeNode:
    """One token of the tree, or (index 0) the prompt."""

    index: int
    parent: int | None
    token_id: int | None  # None for the prompt
    text: str
    depth: int  # its position in the answer: 0 for the first token, -1 for the prompt
    count: int  # drawn samples that took it
    explored: int  # expanded or forced samples through it
    model_probability: float | None  # the model's, softmax at temperature 1 (token_info.py)
    sampled_probability: float | None  # the sampler's; None where forced or not reported
    untaken: float | None  # the model's probability of the next tokens no sample took; None at a leaf
    children: tuple[int, ...]
    alternatives: tuple[tuple[int, str, float], ...]  # the model's likeliest next tokens, as a child recorded them
    provenance: Provenance
    given: bool = False  # forced text, or an alternative an expansion branched: not drawn
    ended: tuple[str, ...] = ()  # why samples ended here
    reference_probability: float | None = None
    kl: float | None = None  # KL(reference || model) of the distribution this token was drawn from, nats


class TreeGrower(Protocol):
    """What grows a tree further (the session's `TreeGrowth`): each call returns the whole tree so far."""

    def expand(self, node: int, mass: float) -> SampleTree: ...

    def force(self, node: int, text: str) -> SampleTree: ...


@dataclass(frozen=True)
class SampleTree:
    """A prompt's samples as one prefix tree (`nodes[0]` is the prompt)."""

    prompt_ids: tuple[int, ...]
    nodes: tuple[TreeNode, ...]
    max_new_tokens: int
    notes: tuple[str, ...] = ()  # what this tree cannot show here, one line each
    reference: str | None = None  # the model the reference columns come from
    grower: TreeGrower | None = field(default=None, repr=False, compare=False)

    @property
    def samples(self) -> int:
        """Drawn samples (expanded and forced ones apart)."""
        return self.nodes[0].count

    def node(self, index: int) -> TreeNode:
        """The node `index`, refused in one line where the tree has none."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.nodes):
            raise ValueError(
                f"node {index!r} is not in this tree: give 0 (the prompt) to {len(self.nodes) - 1} (tree.frame() "
                "lists them)"
            )
        return self.nodes[index]

    def path(self, index: int) -> tuple[int, ...]:
        """The token ids from the prompt to node `index`, its own last."""
        tokens = []
        node = self.node(index)
        while node.parent is not None:
            tokens.append(node.token_id)
            node = self.nodes[node.parent]
        return tuple(reversed(tokens))

    def down(self, index: int, steps: int) -> int:
        """The node `steps` tokens down the chain from node `index` (each step to a node's only child): how a view
        names a token by its row's first node and its place in the row."""
        at = self.node(index).index
        for _ in range(steps):
            if len(self.nodes[at].children) != 1:
                raise ValueError(
                    f"node {at} has {len(self.nodes[at].children)} children, so no row goes on from it: name a node "
                    f"of its row (tree.frame() lists them)"
                )
            at = self.nodes[at].children[0]
        return at

    def leaves(self) -> list[TreeNode]:
        return [n for n in self.nodes[1:] if not n.children]

    def chains_after(self, index: int) -> list[tuple[int, ...]]:
        """The chains that start at node `index`'s children: each runs on from a child while its last node has one
        child that every sample through it took."""
        chains = []
        for child in self.nodes[index].children:
            chain = [child]
            while _continues(self.nodes[chain[-1]], self.nodes):
                chain.append(self.nodes[chain[-1]].children[0])
            chains.append(tuple(chain))
        return chains

    def chains(self) -> list[tuple[int, ...]]:
        """The tree with its chains collapsed, in depth-first order: a tree of n samples has at most 2n - 1."""
        chains, stack = [], self.chains_after(0)[::-1]
        while stack:
            chains.append(stack.pop())
            stack += self.chains_after(chains[-1][-1])[::-1]
        return chains

    def share(self, node: TreeNode) -> float:
        return node.count / self.samples if self.samples else 0.0

    def frame(self):
        """One row per node but the prompt (FRAME_COLUMNS), as a pandas DataFrame."""
        import pandas as pd  # only here: the session layer stays free of pandas

        rows = [
            (
                n.index,
                n.parent,
                n.depth,
                n.token_id,
                n.text,
                n.count,
                self.share(n),
                n.explored,
                n.model_probability,
                n.sampled_probability,
                n.untaken,
                n.reference_probability,
                n.kl,
                n.provenance.how,
                n.given,
                n.provenance.seed,
                ", ".join(n.ended),
            )
            for n in self.nodes[1:]
        ]
        return pd.DataFrame(rows, columns=list(FRAME_COLUMNS))

    def expand(self, node: int, mass: float = 0.9) -> SampleTree:
        """Branch the model's likeliest tokens after `node` that no sample took, each continued by the tree's
        sampler, until the tokens taken there cover `mass` of the model's probability; the whole tree after it."""
        return self._grower().expand(node, mass)

    def force(self, node: int, text: str) -> SampleTree:
        """`text` (one token or several) after `node`, continued by the tree's sampler; the whole tree after it."""
        return self._grower().force(node, text)

    def with_reference(
        self, reference: str, figures: dict[int, tuple[float, float | None]], note: str = ""
    ) -> SampleTree:
        """This tree with the reference's probability and the KL at the nodes `figures` names."""
        nodes = tuple(
            replace(n, reference_probability=figures[n.index][0], kl=figures[n.index][1]) if n.index in figures else n
            for n in self.nodes
        )
        notes = (*self.notes, note) if note else self.notes
        return replace(self, nodes=nodes, reference=reference, notes=notes)

    def _grower(self) -> TreeGrower:
        if self.grower is None:
            raise ValueError("this tree keeps no session to grow it: grow one with session.tree(...) or %%exl_tree")
        return self.grower

    def __repr__(self) -> str:
        return (
            f"<SampleTree: {self.samples} samples, {len(self.nodes) - 1} nodes in {len(self.chains())} chains, "
            f"{len(self.prompt_ids)} prompt tokens; exlnb.show_tree(tree) draws it, tree.frame() lists it>"
        )


def _continues(node: TreeNode, nodes: Sequence[TreeNode]) -> bool:
    """Whether a chain goes on past `node`: one child, taken by every sample through it."""
    if len(node.children) != 1:
        return False
    child = nodes[node.children[0]]
    return (child.count, child.explored, child.provenance.how) == (node.count, node.explored, node.provenance.how)


class TreeBuilder:
    """A tree under construction: samples merged token by token (not thread-safe: its owner locks)."""

    def __init__(self, prompt_ids: Sequence[int], max_new_tokens: int, provenance: Provenance) -> None:
        self.prompt_ids = tuple(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self._nodes: list[dict] = [self._new(None, None, "", -1, None, provenance, None, False)]

    @staticmethod
    def _new(parent, token, text, depth, info: TokenInfo | None, provenance: Provenance, probability, given) -> dict:
        return dict(
            parent=parent,
            token=token,
            text=text,
            depth=depth,
            count=0,
            explored=0,
            model=info.probability if info else probability,
            sampled=info.sampled_probability if info else None,
            given=given,
            children={},
            alternatives=(),
            provenance=provenance,
            ended=[],
        )

    def __len__(self) -> int:
        return len(self._nodes)

    def enter(self, at: int, drawn: bool) -> None:
        """A sample starts at node `at` (the prompt, 0, for a drawn one): it counts at `at` and every node above."""
        while at is not None:
            self._nodes[at]["count" if drawn else "explored"] += 1
            at = self._nodes[at]["parent"]

    def path(self, at: int) -> list[int]:
        """The token ids from the prompt to node `at`."""
        tokens = []
        while at:
            tokens.append(self._nodes[at]["token"])
            at = self._nodes[at]["parent"]
        return tokens[::-1]

    def step(
        self,
        at: int,
        token: int,
        text: str,
        *,
        drawn: bool,
        provenance: Provenance,
        info: TokenInfo | None = None,
        probability: float | None = None,
        given: bool = False,
    ) -> int:
        """A sample at node `at` went on with `token` (drawn with its record `info`, or `given` with the model's
        `probability` where the engine scored it): the child it reached, new or counted once more."""
        parent = self._nodes[at]
        if info is not None and not parent["alternatives"]:
            parent["alternatives"] = info.alternatives
        index = parent["children"].get(token)
        if index is None:
            index = len(self._nodes)
            parent["children"][token] = index
            self._nodes.append(self._new(at, token, text, parent["depth"] + 1, info, provenance, probability, given))
        self._nodes[index]["count" if drawn else "explored"] += 1
        return index

    def end(self, at: int, reason: str) -> None:
        self._nodes[at]["ended"].append(reason)

    def children(self, at: int) -> dict[int, int]:
        return dict(self._nodes[at]["children"])

    def depth(self, at: int) -> int:
        return self._nodes[at]["depth"]

    def token(self, at: int) -> int | None:
        return self._nodes[at]["token"]

    def freeze(self, notes: Sequence[str] = (), grower: TreeGrower | None = None) -> SampleTree:
        nodes = tuple(self._frozen(i, raw) for i, raw in enumerate(self._nodes))
        return SampleTree(self.prompt_ids, nodes, self.max_new_tokens, tuple(notes), grower=grower)

    def _frozen(self, index: int, raw: dict) -> TreeNode:
        children = tuple(raw["children"].values())
        taken = [self._nodes[c]["model"] for c in children]
        untaken = None if not children or None in taken else max(0.0, 1.0 - sum(taken))
        return TreeNode(
            index=index,
            parent=raw["parent"],
            token_id=raw["token"],
            text=raw["text"],
            depth=raw["depth"],
            count=raw["count"],
            explored=raw["explored"],
            model_probability=raw["model"],
            sampled_probability=raw["sampled"],
            untaken=untaken,
            children=children,
            alternatives=raw["alternatives"],
            provenance=raw["provenance"],
            given=raw["given"],
            ended=tuple(raw["ended"]),
        )
