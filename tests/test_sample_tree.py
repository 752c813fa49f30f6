"""The sample tree on the real bundled model and CPU engine: samples merged into one prefix tree with counts and
both probabilities, chains collapsed, expansions that cover a mass with branches the engine scored, forced text,
a reference's columns, the magic, the view that grows where a node is chosen, and each bad input in one line."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from IPython.core.error import UsageError

from exlnb import SampleTree
from exlnb.divergence import Reference
from exlnb.engines.token_info import TokenInfo
from exlnb.models import resolve_model
from exlnb.sample_tree import Provenance, TreeBuilder
from exlnb.session.exploring import MAX_BRANCHES
from exlnb.tree_reference import compare
from exlnb.trees import grow
from tests.test_branching import drawings_until
from tests.test_divergence import perturbed_copy

PROMPT = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"
N, TOKENS, SEED = 12, 6, 1


@pytest.fixture(scope="module")
def tree(cpu_session) -> SampleTree:
    return cpu_session.tree(PROMPT, n=N, max_new_tokens=TOKENS, temperature=1.0, seed=SEED)


def paths_to_leaves(tree: SampleTree) -> Counter:
    """Each sample's tokens, as the tree holds them: a path to a node where samples ended, once per sample."""
    return Counter({tree.path(n.index): len(n.ended) for n in tree.nodes[1:] if n.ended})


def test_a_tree_holds_exactly_the_answers_its_seeds_give_one_by_one(cpu_session, tree):
    alone = Counter(
        cpu_session.complete(PROMPT, max_new_tokens=TOKENS, temperature=1.0, seed=SEED + i, top_tokens=5).token_ids
        for i in range(N)
    )
    assert paths_to_leaves(tree) == alone
    assert tree.samples == N and sum(len(n.ended) for n in tree.nodes) == N


def test_every_node_counts_the_samples_through_it_and_its_share(tree):
    for node in tree.nodes:
        below = sum(tree.nodes[c].count for c in node.children)
        assert node.count == below + len(node.ended), node
        assert tree.share(node) == pytest.approx(node.count / N)
    assert sorted(tree.path(n.index) for n in tree.nodes[1:]) == sorted(set(tree.path(n.index) for n in tree.nodes[1:]))


def test_a_node_shows_the_models_and_the_samplers_probability_and_the_mass_no_sample_took(cpu_session, tree):
    for node in tree.nodes[1:8]:
        ids = [*tree.prompt_ids, *tree.path(node.index)]
        logits = cpu_session.run_on_engine(lambda e, ids=ids: e.score(ids))
        assert node.model_probability == pytest.approx(float(logits[-2].softmax(-1)[node.token_id]), abs=1e-4)
        assert 0 < node.sampled_probability <= 1 and not node.given
    root = tree.nodes[0]
    taken = sum(tree.nodes[c].model_probability for c in root.children)
    assert root.untaken == pytest.approx(1 - taken)
    assert root.alternatives and root.alternatives[0][2] >= root.alternatives[-1][2]
    first = tree.nodes[root.children[0]].provenance
    assert (first.model, first.format, first.engine, first.how) == ("smollm2-135m-instruct", "hf", "cpu", "sampled")
    assert "temperature 1.0" in first.sampler and first.seed == SEED


def test_chains_collapse_runs_every_sample_took_and_number_at_most_2n_minus_1(tree):
    chains = tree.chains()
    assert sorted(i for chain in chains for i in chain) == list(range(1, len(tree.nodes)))
    assert len(chains) <= 2 * N - 1
    for chain in chains:
        for node, child in zip(chain, chain[1:]):
            assert tree.nodes[node].children == (child,) and tree.nodes[child].count == tree.nodes[node].count


def test_expanding_a_node_branches_untaken_tokens_until_they_cover_the_mass(cpu_session, tree):
    root = tree.nodes[0]
    grown = tree.expand(0, 0.5)
    children = [grown.nodes[c] for c in grown.nodes[0].children]
    branched = [c for c in children if c.given]
    assert branched and all(c.provenance.how == "expanded" and c.count == 0 and c.explored >= 1 for c in branched)
    assert {c.token_id for c in children} > {tree.nodes[c].token_id for c in root.children}
    assert sum(c.model_probability for c in children) >= 0.5 or any("short of mass" in n for n in grown.notes)
    assert grown.samples == N and grown.nodes[0].explored == len(branched)
    scored = cpu_session.run_on_engine(lambda e: e.score(list(tree.prompt_ids)))[-1].softmax(-1)
    for child in branched:
        assert child.model_probability == pytest.approx(float(scored[child.token_id]), abs=1e-6)
        assert grown.nodes[child.children[0]].sampled_probability is not None  # the sampler drew on from it


def test_one_expansion_runs_at_most_its_branches_and_says_what_it_covered(tree):
    grown = tree.expand(0, 0.999)
    assert len([c for c in grown.nodes[0].children if grown.nodes[c].given]) <= MAX_BRANCHES + len(
        tree.nodes[0].children
    )
    assert any(line.startswith("node 0: the tokens taken after it cover") for line in grown.notes)


def test_forcing_text_after_a_node_gives_its_tokens_and_samples_on(cpu_session, tree):
    node = tree.nodes[0].children[0]
    forced = tree.force(node, " Blue")
    tokens = cpu_session.tokenizer.encode(" Blue", special=True)
    path = (*tree.path(node), *tokens)
    given = next(n for n in forced.nodes if forced.path(n.index) == path)
    assert given.given and given.provenance.how == "forced" and given.model_probability is not None
    assert given.children or given.ended  # sampled on from it, up to the tree's budget


def test_a_tree_of_the_magic_is_stored_and_its_help_lists_the_tree_options(shell, capsys):
    shell.run_cell_magic("exl_tree", "--n 3 --max-new-tokens 4 --temperature 1 --seed 2 --display text --out t", "Hi")
    stored = shell.user_ns.pop("t")
    assert isinstance(stored, SampleTree) and stored.samples == 3
    assert "3 samples of" in capsys.readouterr().out
    shell.run_line_magic("exl_tree", "--help")
    helped = capsys.readouterr().out
    assert all(flag in helped for flag in ("--n", "--tokens", "--mass", "--reference", "--temperature", "--out"))


@pytest.mark.parametrize(
    "line, message",
    [
        ("--n 0", "n=0: a tree draws 1 to 1024 samples"),
        ("--n 10000", "n=10000: a tree draws 1 to 1024 samples"),
        ("--mass 2", "mass=2.0: give the share of the model's probability to cover, above 0 and at most 1"),
        ("--tokens 50", "tokens=50: a node records 0 to 20 alternatives"),
        ("--chat tutor", "unknown option --chat"),
    ],
)
def test_bad_tree_options_are_one_line(shell, line, message):
    with pytest.raises(UsageError, match=message) as raised:
        shell.run_cell_magic("exl_tree", line, "Hi")
    assert "\n" not in str(raised.value)


def test_bad_growth_is_refused_in_one_line(tree):
    last = next(n for n in tree.nodes if n.depth == TOKENS - 1)
    for grow_it, message in [
        (lambda: tree.expand(99999), "node 99999 is not in this tree: give 0"),
        (lambda: tree.expand(0, 2), "mass=2: give the share"),
        (lambda: tree.force(0, ""), "text='': give the text to force"),
        (lambda: tree.expand(last.index), f"node {last.index} leaves 0 of the answer's {TOKENS} tokens"),
        (lambda: tree.force(0, " and" * 40), "leaves 6 of the answer's 6 tokens"),
    ]:
        with pytest.raises(ValueError, match=message) as raised:
            grow_it()
        assert "\n" not in str(raised.value)


def test_a_reference_adds_its_probability_and_the_kl_at_every_node(cpu_session, tree, tmp_path):
    same = compare(cpu_session, tree, "smollm2-135m-instruct", engine="cpu", cache_dir=tmp_path)
    assert same.reference == "smollm2-135m-instruct" and not same.notes
    for node in same.nodes[1:]:
        assert node.reference_probability == pytest.approx(node.model_probability, abs=1e-4)
        assert node.kl == pytest.approx(0.0, abs=1e-6)
    other = perturbed_copy(resolve_model("smollm2-135m-instruct"), tmp_path / "noisy", 0.05)
    against = compare(cpu_session, tree, other, engine="cpu", cache_dir=tmp_path)
    assert all(n.kl > 0 for n in against.nodes[1:]) and against.frame().kl.notna().all()


def test_a_kept_comparison_loads_no_reference_model_again(cpu_session, tree, tmp_path, monkeypatch):
    compare(cpu_session, tree, "smollm2-135m-instruct", engine="cpu", cache_dir=tmp_path)
    [kept] = tmp_path.glob("tree-*.pt")

    def no_load(*args, **kwargs):
        raise AssertionError("the reference model was loaded again")

    monkeypatch.setattr("exlnb.tree_reference.Session.load", no_load)
    again = compare(cpu_session, tree, "smollm2-135m-instruct", engine="cpu", cache_dir=tmp_path)
    from_file = compare(cpu_session, tree, kept, cache_dir=tmp_path)
    assert [n.kl for n in again.nodes] == [n.kl for n in from_file.nodes]


def test_a_reference_with_another_vocabulary_is_refused_in_one_line(cpu_session, tree, tmp_path):
    other = Reference("llama-3-8b", "model", "tokenizer", tuple(range(16)), "float32", torch.zeros(16, 128256), None)
    torch.save(vars(other), tmp_path / "llama-3-8b.pt")
    with pytest.raises(ValueError, match=r"the reference \(llama-3-8b, 128256 tokens\) has another tokenizer") as e:
        compare(cpu_session, tree, tmp_path / "llama-3-8b.pt")
    assert "\n" not in str(e.value)


def test_a_divergence_reference_gives_the_nodes_on_its_path(cpu_session, tree, tmp_path):
    from exlnb.scoring import reference

    leaf = tree.leaves()[0]
    kept = reference("smollm2-135m-instruct", [*tree.prompt_ids, *tree.path(leaf.index)], cache_dir=tmp_path)
    compared = compare(cpu_session, tree, next(tmp_path.glob("*.pt")))
    on_path = {n.index for n in compared.nodes if n.reference_probability is not None}
    assert on_path == {
        i for i in range(1, len(tree.nodes)) if tree.path(leaf.index)[: len(tree.path(i))] == tree.path(i)
    }
    assert kept.model.endswith("smollm2-135m-instruct")
    assert any("have no figures in" in note for note in compared.notes)


def test_the_builder_merges_shared_prefixes_into_one_node():
    provenance = Provenance("m", "hf", None, "cpu", "greedy", None)
    builder = TreeBuilder((1, 2), 4, provenance)

    def info(token: int) -> TokenInfo:
        return TokenInfo(token, str(token), 0.5, ((token, str(token), 0.5), (99, "x", 0.25)), 0.6)

    for path in ((5, 6), (5, 7), (5, 6)):
        builder.enter(0, drawn=True)
        at = 0
        for token in path:
            at = builder.step(at, token, str(token), drawn=True, provenance=provenance, info=info(token))
        builder.end(at, "max new tokens reached")
    tree = builder.freeze()
    assert [(n.token_id, n.count) for n in tree.nodes] == [(None, 3), (5, 3), (6, 2), (7, 1)]
    assert tree.chains() == [(1,), (2,), (3,)] and math.isclose(tree.nodes[1].untaken, 0.0)


def test_the_view_draws_as_the_tree_grows_and_grows_it_where_a_node_is_chosen(cpu_session, monkeypatch):
    import IPython.display

    from exlnb.widgets.tree import TreeView

    drawn = []
    monkeypatch.setattr(IPython.display, "update_display", lambda data, **kwargs: drawn.append(data))
    growth = grow("Name a colour.", n=6, max_new_tokens=8, temperature=1.0, seed=4)
    view = TreeView(growth, mass=0.9)
    grown = growth.wait(120)
    view.settle()
    assert f'data-exlnb-tree="{view.key}"' in drawn[-1]["text/html"] and "exlnb-tree-actions" in drawn[-1]["text/html"]
    assert drawn[-1]["text/plain"].startswith("6 samples of")
    before = len(grown.nodes)

    view.handle({"type": "expand", "tree": view.key, "node": 0, "mass": 0.6})  # what view.js sends
    drawings_until(drawn, lambda d: len(view.tree.nodes) > before and view.status.startswith("node 0: "))
    assert "branches; the tokens taken after it cover" in drawn[-1]["text/html"]
    view.handle({"type": "expand", "tree": view.key, "node": 10**6, "mass": 0.6})
    [refused] = drawings_until(drawn, lambda d: "not grown" in d[-1]["text/html"])[-1:]
    assert "not grown: node 1000000 is not in this tree" in refused["text/html"]
    view.close()
