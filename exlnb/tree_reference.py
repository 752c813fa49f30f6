"""A sample tree against a reference: at every node, the reference model's probability of its token and the KL
from the reference's next-token distribution to the loaded model's, so one tree compares two models (an EXL3
width against fp16, a fine-tune against its base) where their paths run.

The reference is a model folder (or the bundled name), which scores every path of the tree in a session of its
own while the loaded model scores the same paths (`Engine.score`); the figures, a few numbers a node, are kept
on disk by both models and the prompt, so showing the tree again, or a tree grown further, loads no reference
model for the nodes already compared. Or it is a `.pt` file: one this kept, or a reference `exlnb.divergence`
kept (its token ids give the nodes on their path). A reference with another tokenizer is refused in one line;
where the loaded model returns no logits (a server), the reference's probability is shown without the KL.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from exlnb.divergence import (
    Reference,
    check_same_tokenizer,
    kl_per_position,
    model_identity,
    tokenizer_identity,
)
from exlnb.engines.registry import engine_spec
from exlnb.models import cache_root, resolve_model
from exlnb.sample_tree import SampleTree
from exlnb.scoring import score
from exlnb.session import Session

Figures = dict[str, tuple[float, float | None]]  # a node's path key -> (reference probability, KL or None)


def path_keys(tree: SampleTree) -> list[str]:
    """A key per node, from the prompt's ids and the path's: the same path has the same key in any tree."""
    keys = [hashlib.blake2b(repr(tree.prompt_ids).encode(), digest_size=12).hexdigest()]
    for node in tree.nodes[1:]:
        keys.append(hashlib.blake2b(f"{keys[node.parent]}:{node.token_id}".encode(), digest_size=12).hexdigest())
    return keys


@dataclass(frozen=True)
class KeptFigures:
    """A reference's figures over one prompt's tree paths against one model, as kept on disk."""

    reference: str
    tokenizer_id: str
    compared_model_id: str
    figures: Figures

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        torch.save(vars(self), partial)
        partial.replace(path)  # a run cut off mid-write leaves no file that loads


def check(session: Session, reference: str | Path) -> None:
    """Refuse, in one line and before any sample is drawn, a reference that cannot be compared with the loaded model:
    a file that is missing or another tokenizer's, a folder of another tokenizer."""
    vocab_size = session.tokenizer.vocab_size
    tokenizer_id = tokenizer_identity(session.options.model_dir)
    path = Path(str(reference)).expanduser()
    if path.suffix != ".pt":
        folder = resolve_model(str(reference))
        check_same_tokenizer(folder.name, tokenizer_identity(folder), None, tokenizer_id, vocab_size)
        return
    if not path.is_file():
        raise FileNotFoundError(f"no reference at {path}: give a model folder, or a .pt file exlnb kept")
    data = torch.load(path, weights_only=True)
    if "figures" in data:
        check_same_tokenizer(data["reference"], data["tokenizer_id"], None, tokenizer_id, vocab_size)
    else:
        Reference(**data).check_tokenizer(tokenizer_id, vocab_size)


def compare(
    session: Session, tree: SampleTree, reference: str | Path, *, engine: str = "auto", cache_dir: Path | None = None
) -> SampleTree:
    """`tree` with each node's reference probability and KL from `reference` (a model folder or name, or a kept
    .pt file), the reference computed where the figures kept (under `cache_dir`, default the user cache's
    references/) lack a node."""
    check(session, reference)  # NoModelLoaded, in a line, when nothing is loaded
    keys = path_keys(tree)
    path = Path(str(reference)).expanduser()
    if path.suffix == ".pt":
        name, figures = path.name, from_file(session, tree, path, keys)
    else:
        folder = resolve_model(str(reference))
        name, figures = (
            folder.name,
            computed(session, tree, folder, keys, engine, cache_dir or cache_root() / "references"),
        )
    by_node = {i: figures[key] for i, key in enumerate(keys) if i and key in figures}
    return tree.with_reference(name, by_node, missing_note(session, tree, by_node, name))


def missing_note(session: Session, tree: SampleTree, by_node: dict, name: str) -> str:
    """What the reference columns lack, in one line; empty where nothing is."""
    if len(by_node) < len(tree.nodes) - 1:
        return (
            f"{len(tree.nodes) - 1 - len(by_node)} of {len(tree.nodes) - 1} nodes have no figures in {name}: "
            "give the reference model's folder to compute them"
        )
    if not engine_spec(session.options.engine).can("scoring"):
        return (
            f"no KL: it needs the loaded model's logits, which the {session.options.engine} engine does not return "
            f"(the reference's probability is shown)"
        )
    return ""


def computed(
    session: Session, tree: SampleTree, folder: Path, keys: list[str], engine: str, cache_dir: Path
) -> Figures:
    """The figures kept for this reference, this model and this prompt, with the nodes they lack computed now by
    loading the reference in a session of its own, and kept again."""
    loaded = session.options
    key = hashlib.blake2b(
        f"{model_identity(folder)}:{model_identity(loaded.model_dir)}:{keys[0]}".encode(), digest_size=12
    ).hexdigest()
    path = cache_dir / f"tree-{folder.name}-{key}.pt"
    kept = read_kept(path) if path.is_file() else None
    figures = dict(kept.figures) if kept else {}
    lacking = {i for i, k in enumerate(keys) if i and k not in figures}
    if lacking:
        other = Session()
        other.load(str(folder), engine=engine, progress=False)
        try:
            for steps in leaf_paths(tree, lacking):
                ids = [*tree.prompt_ids, *(tree.nodes[i].token_id for i in steps)]
                figures.update(path_figures(session, other, ids, len(tree.prompt_ids), [keys[i] for i in steps]))
        finally:
            other.unload()
        KeptFigures(folder.name, tokenizer_identity(folder), model_identity(loaded.model_dir), figures).save(path)
    return figures


def leaf_paths(tree: SampleTree, lacking: set[int]) -> list[list[int]]:
    """The nodes (the prompt left out) of each path from the prompt to a leaf that holds a node in `lacking`."""
    found = []
    for leaf in tree.leaves():
        steps, node = [], leaf
        while node.parent is not None:
            steps.append(node.index)
            node = tree.nodes[node.parent]
        if lacking & set(steps):
            found.append(steps[::-1])
    return found


def path_figures(session: Session, reference: Session, ids: Sequence[int], prompt: int, keys: list[str]) -> Figures:
    """The figures along one path, the reference scoring it now."""
    return figures_over(session, score(reference, ids)[prompt - 1 : len(ids) - 1], ids, prompt, keys)


def figures_over(session: Session, reference_rows: torch.Tensor, ids: Sequence[int], prompt: int, keys: list[str]):
    """The reference's probability of each token of `ids` after the prompt (from its logits at the row before
    each), and the KL from its distribution there to the loaded model's (None where the engine returns none)."""
    probabilities = reference_rows.float().softmax(-1)[torch.arange(len(keys)), torch.tensor(list(ids[prompt:]))]
    kl: list[float | None] = [None] * len(keys)
    if engine_spec(session.options.engine).can("scoring"):
        kl = kl_per_position(reference_rows, score(session, ids)[prompt - 1 : len(ids) - 1]).tolist()
    return {key: (float(p), k) for key, p, k in zip(keys, probabilities, kl)}


def read_kept(path: Path) -> KeptFigures:
    return KeptFigures(**torch.load(path, weights_only=True))


def from_file(session: Session, tree: SampleTree, path: Path, keys: list[str]) -> Figures:
    """The figures a kept file gives (its tokenizer checked): one this module kept (against the loaded model), or a
    reference of `exlnb.divergence` over token ids, for the nodes on their path."""
    data = torch.load(path, weights_only=True)
    if "figures" not in data:
        return along_reference(session, tree, Reference(**data), keys)
    kept = KeptFigures(**data)
    if kept.compared_model_id != model_identity(session.options.model_dir):
        raise ValueError(
            f"the KL in {path.name} is against another model than the loaded one: give the reference model's "
            "folder to compare this one"
        )
    return kept.figures


def along_reference(session: Session, tree: SampleTree, reference: Reference, keys: list[str]) -> Figures:
    """The figures of the nodes whose path follows `reference`'s token ids."""
    ids, prompt = reference.token_ids, len(tree.prompt_ids)
    if ids[:prompt] != tree.prompt_ids:
        return {}
    steps, node = [], tree.nodes[0]
    while len(ids) > prompt + len(steps):
        child = next((c for c in node.children if tree.nodes[c].token_id == ids[prompt + len(steps)]), None)
        if child is None:
            break
        steps.append(child)
        node = tree.nodes[child]
    if not steps:
        return {}
    covered = list(ids[: prompt + len(steps)])
    rows = reference.logits[prompt - 1 : len(covered) - 1]
    return figures_over(session, rows, covered, prompt, [keys[i] for i in steps])
