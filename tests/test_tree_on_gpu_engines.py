"""The sample tree, its reference columns and the near-tie map on the GPU engines (`pytest -m gpu`), with the
bundled model: what `test_sample_tree.py` and `test_near_ties.py` hold on the CPU engine, within fp16's reach (a
batched decode step and a whole-sequence pass round differently on a GPU, so probabilities agree to a few
hundredths, not to the CPU engine's 1e-4)."""

from __future__ import annotations

import pytest

from exlnb import NoiseFloor, SamplerSettings
from exlnb.generation import start
from exlnb.noise_floor import LAYOUT_NAMES, noise_floor
from exlnb.sample_tree import SampleTree
from exlnb.session import Session, get_session
from exlnb.tree_reference import compare
from tests.helpers import skip_without_library

PROMPT = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"
N, TOKENS, SEED = 8, 6, 1
PROBABILITY_ABS = 0.02  # fp16: a batched decode step against a whole-sequence pass
ON_ONE_CARD = ("an fp16 cache against a q8 cache", "CUDA graphs against eager decode")


@pytest.fixture(
    scope="module",
    params=[pytest.param("exllamav2", marks=pytest.mark.gpu), pytest.param("exllamav3", marks=pytest.mark.gpu)],
)
def gpu_session(request) -> Session:
    skip_without_library(request.param)
    session = get_session()
    session.load("smollm2-135m-instruct", engine=request.param, progress=False)
    return session


@pytest.fixture(scope="module")
def tree(gpu_session) -> SampleTree:
    return gpu_session.tree(PROMPT, n=N, max_new_tokens=TOKENS, temperature=1.0, seed=SEED)


def test_a_tree_counts_every_sample_and_shows_the_models_probability(gpu_session, tree):
    assert tree.samples == N and sum(len(n.ended) for n in tree.nodes) == N
    for node in tree.nodes:
        assert node.count == sum(tree.nodes[c].count for c in node.children) + len(node.ended), node
    assert all(n.provenance.engine == gpu_session.options.engine for n in tree.nodes[1:])
    for node in tree.nodes[1:8]:
        ids = [*tree.prompt_ids, *tree.path(node.index)]
        logits = gpu_session.run_on_engine(lambda e, ids=ids: e.score(ids))
        scored = float(logits[-2].float().softmax(-1)[node.token_id])
        assert node.model_probability == pytest.approx(scored, abs=PROBABILITY_ABS)


def test_the_same_model_as_reference_gives_its_probabilities_and_almost_no_kl(gpu_session, tree, tmp_path):
    engine = gpu_session.options.engine
    same = compare(gpu_session, tree, "smollm2-135m-instruct", engine=engine, cache_dir=tmp_path)
    assert same.reference == "smollm2-135m-instruct" and not same.notes
    for node in same.nodes[1:]:
        assert node.reference_probability == pytest.approx(node.model_probability, abs=PROBABILITY_ABS)
        assert 0 <= node.kl < 0.01


def test_margins_agree_with_a_whole_pass_and_the_floor_compares_what_one_card_can(gpu_session):
    answer = start("Why is the sky blue?", sampler=SamplerSettings.greedy(), max_new_tokens=16, tokens=5).wait()[0]
    prompt = answer.origin.prompt_ids
    logits = gpu_session.run_on_engine(lambda e: e.score([*prompt, *answer.token_ids]))[len(prompt) - 1 : -1]
    top = logits.float().topk(2, dim=-1)
    margins = answer.margins()
    assert list(margins.top_id) == list(answer.token_ids)  # greedy: each token its step's argmax
    assert margins.margin.tolist() == pytest.approx((top.values[:, 0] - top.values[:, 1]).tolist(), abs=0.15)
    floor = noise_floor(gpu_session, probes=2, max_new_tokens=8)
    names = [c.name for c in floor.comparisons]
    assert names[:6] == [f"alone against inside a batch of {b}" for b in (2, 8, 16)] + [
        "decode against a whole-sequence pass",
        *ON_ONE_CARD,
    ]
    assert all((name in names) != (name in floor.not_compared) for name in LAYOUT_NAMES)  # two GPUs or a reason
    assert isinstance(floor, NoiseFloor) and floor.value == max(c.max_shift for c in floor.comparisons) >= 0
    ties = answer.near_ties(floor)
    assert list(ties.position) == list(margins[margins.margin <= floor.value].position)
