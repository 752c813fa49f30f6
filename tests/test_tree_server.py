"""The sample tree, the reference columns and the near-tie map against a real server that returns logprobs
(llama-cpp-python's, on the bundled model's GGUF): what a server gives works, and what it cannot (scoring, the
sampler's probability, logits for the KL) is said in one line."""

from __future__ import annotations

import pytest

from exlnb import generation
from exlnb.noise_floor import noise_floor
from exlnb.session import Session
from exlnb.tree_reference import compare
from exlnb.trees import grow

pytest_plugins = ["tests.servers"]
pytestmark = pytest.mark.slow  # starts a real server

PROMPT = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tree(llama_cpp_session):
    return llama_cpp_session.tree(PROMPT, n=3, max_new_tokens=5, temperature=1.0, seed=1, top_tokens=3)


def test_a_tree_grows_from_a_servers_logprobs_and_says_what_it_cannot_score(tree):
    assert tree.samples == 3 and sum(len(n.ended) for n in tree.nodes) == 3
    drawn = tree.nodes[1:]
    assert all(0 < n.model_probability <= 1 and n.sampled_probability is None for n in drawn)
    assert tree.nodes[1].provenance.format == "url" and tree.nodes[1].provenance.engine == "openai"
    [note] = tree.notes
    assert note == (
        "the openai engine returns no logits: an expansion reads the 3 alternatives its samples recorded, "
        "and forced tokens show no probability"
    )


def test_expanding_on_a_server_branches_the_alternatives_its_samples_recorded(tree):
    root = tree.nodes[0]
    grown = tree.expand(0, 0.99)
    recorded = {token for token, _text, _p in root.alternatives}
    branched = [grown.nodes[c] for c in grown.nodes[0].children if grown.nodes[c].given]
    assert {c.token_id for c in branched} <= recorded
    assert all(c.model_probability is not None for c in branched)  # the recorded alternatives' probabilities
    assert any("its samples recorded only 3 alternatives" in note for note in grown.notes)
    forced = grown.force(0, " Blue")
    given = [n for n in forced.nodes if n.provenance.how == "forced" and n.given]
    assert given and all(n.model_probability is None for n in given)


def test_a_reference_on_a_server_gives_its_probability_and_says_why_there_is_no_kl(llama_cpp_session, tree, tmp_path):
    compared = compare(llama_cpp_session, tree, "smollm2-135m-instruct", engine="cpu", cache_dir=tmp_path)
    assert all(n.reference_probability is not None and n.kl is None for n in compared.nodes[1:])
    assert compared.notes[-1] == (
        "no KL: it needs the loaded model's logits, which the openai engine does not return "
        "(the reference's probability is shown)"
    )


def test_near_ties_on_a_server_read_its_logprobs_and_its_floor_says_what_it_cannot_compare(llama_cpp_session):
    answer = generation.start("Name a colour.", session=llama_cpp_session, max_new_tokens=6, temperature=0, tokens=3)
    [result] = answer.wait(120)
    margins = result.margins()
    assert len(margins) == len(result.token_ids) and (margins.margin >= 0).all()
    floor = noise_floor(llama_cpp_session, probes=1, max_new_tokens=4, batch_sizes=(2,))
    assert [c.name for c in floor.comparisons] == ["alone against inside a batch of 2"]
    assert "decode against a whole-sequence pass (the openai engine returns no logits)" in floor.not_compared
    assert list(result.near_ties(floor).position) == list(margins[margins.margin <= floor.value].position)


def test_a_tree_drawn_through_a_chat_server_refuses_in_one_line_to_grow_after_a_node(llama_cpp_server):
    chat = Session()
    chat.load(url=llama_cpp_server, api="chat", progress=False)
    try:
        growth = grow("Name a colour.", n=1, session=chat, max_new_tokens=2, temperature=1.0, seed=1)
        assert growth.wait(120).samples == 1  # drawn: the server rendered the user's turn itself
        for grow_after in (lambda: growth.expand(0, 0.9), lambda: growth.force(0, " Blue")):
            with pytest.raises(ValueError, match=r"^branching on a server needs --api completions: with api='chat'"):
                grow_after()
    finally:
        chat.unload()
