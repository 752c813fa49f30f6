"""CUDA-graph decode on both GPU engines (exlnb/engines/cuda_graphs.py, and each engine's graph_decode.py).

The bucket arithmetic and the option's checks run everywhere; the rest needs CUDA (`pytest -m gpu`), on the
ExLlamaV2 and the ExLlamaV3 engine alike: graphs on by default where the load check passes, and greedy output
token-identical to eager decode at batch sizes 1 to 16 in paged mode, over the engine acceptance prompts and a
prompt several pages long.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from benchmarks.paged_acceptance import LONG_PROMPT, QUESTIONS, answers_together
from exlnb.engines.base import EngineStatus
from exlnb.engines.cuda_graphs import StepGraphs, bucket_for, buckets, by_card, cut_width
from exlnb.engines.job_options import JobOptions
from exlnb.engines.options import GRAPH_MODES, EngineOptions
from exlnb.engines.sampling import SamplerSettings
from exlnb.models import resolve_model
from exlnb.session import Session
from exlnb.templates import chatml
from tests.test_session import max_overlap


def test_buckets_pad_every_size_to_at_most_twice_itself():
    assert buckets(16) == (1, 2, 4, 8, 16)
    assert buckets(12) == (1, 2, 4, 8, 12)
    assert buckets(1) == (1,)
    for limit in (1, 5, 16, 32):
        sizes = buckets(limit)
        for size in range(1, limit + 1):
            chosen = bucket_for(size, sizes)
            assert size <= chosen <= min(2 * size, limit)
        assert bucket_for(limit + 1, sizes) is None


def test_a_padded_table_is_cut_to_the_bucket_of_the_pages_the_longest_row_needs():
    """exllamav3 pads a step's table to 16 pages: its graph reads the pages the longest row needs with this step's
    token (a row of `longest` cached tokens writes at position `longest`), bucketed, never past the table."""
    sizes = buckets(32)
    assert cut_width(16, 0, 256, sizes) == 1
    assert cut_width(16, 255, 256, sizes) == 1  # the token goes to position 255, the first page's last
    assert cut_width(16, 256, 256, sizes) == 2  # position 256 is on the second page
    assert cut_width(16, 3 * 256, 256, sizes) == 4
    assert cut_width(32, 16 * 256, 256, sizes) == 32  # 17 pages: the bucket past 16
    assert cut_width(48, 32 * 256, 256, buckets(64)) == 48  # 33 pages: bucket 64 is wider than the table
    assert cut_width(16, 40 * 256, 256, sizes) == 16  # past every bucket: the table as it is


def test_a_layer_split_is_grouped_into_each_card_s_run_of_modules_in_order():
    cards = by_card(["a0", "a1", "b0", "b1", "b2", "a2"], lambda name: torch.device("cuda", ord(name[0]) - ord("a")))
    assert cards == [
        (torch.device("cuda", 0), ["a0", "a1"]),
        (torch.device("cuda", 1), ["b0", "b1", "b2"]),
        (torch.device("cuda", 0), ["a2"]),
    ]  # a card met again later is a run of its own


def test_an_unknown_graphs_mode_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"graphs='sometimes': choose one of auto, off"):
        EngineOptions.resolve(
            engine="cpu",
            model_dir=resolve_model("smollm2-135m-instruct", progress=False),
            cache_tokens=None,
            cache_dtype="fp16",
            max_batch_size=None,
            gpu_split=None,
            paged="auto",
            graphs="sometimes",
        )
    assert GRAPH_MODES == ("auto", "off")


def test_the_status_line_says_how_decode_runs():
    status = EngineStatus(
        "exllamav2",
        "m",
        "GPU",
        True,
        "exlnb paged attention (PyTorch)",
        8192,
        "fp16",
        16,
        decode="CUDA graphs, 2 captured, 24 MiB",
    )
    assert status.line().endswith("| decode: CUDA graphs, 2 captured, 24 MiB")
    assert "decode:" not in EngineStatus("cpu", "m", "cpu", True, "sdpa", 8192, "fp16", 16).line()


# -- on the GPU ------------------------------------------------------------------------------------------------


GRAPH_ENGINES = ("exllamav2", "exllamav3")


def load(graphs: str, engine: str = "exllamav2", **options) -> Session:
    session = Session()
    session.load("smollm2-135m-instruct", engine=engine, graphs=graphs, progress=False, **options)
    return session


@pytest.fixture(scope="module", params=GRAPH_ENGINES)
def sessions(request):
    if not torch.cuda.is_available():
        pytest.skip("CUDA-graph decode needs CUDA")
    if importlib.util.find_spec(request.param) is None:
        pytest.skip(f"{request.param} is not installed")
    eager, graphed = load("off", request.param), load("auto", request.param)
    if not graphed.status().paged:
        pytest.skip("the engine is unpaged here (flash-attn without paged kernels)")
    yield eager, graphed
    eager.unload()
    graphed.unload()


@pytest.fixture(scope="module")
def drawing(sessions):
    """The graphed engine loaded again with sampling on the GPU (`EXLNB_DEVICE_SAMPLING=1`; off by default)."""
    eager, graphed = sessions
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EXLNB_DEVICE_SAMPLING", "1")
        drawn = load("auto", graphed.status().engine)
    yield eager, drawn
    drawn.unload()


def token_ids(session: Session, prompts: list[str], max_new_tokens: int) -> tuple[list[tuple[int, ...]], list]:
    streams = answers_together(session, prompts, max_new_tokens)
    return [s.result().token_ids for s in streams], streams


@pytest.mark.gpu
def test_graphs_are_on_by_default_and_off_on_request(sessions):
    eager, graphed = sessions
    assert graphed.status().decode.startswith("CUDA graphs"), graphed.status().notes
    assert eager.status().decode.split(", ")[0] == "eager"
    assert "decode: CUDA graphs" in graphed.status().line()


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8, 13, 16])
def test_greedy_output_from_graphs_equals_eager_at_batch_sizes_1_to_16(sessions, batch):
    eager, graphed = sessions
    prompts = [chatml(q) for q in QUESTIONS[:batch]]
    replays_before = graphed.run_on_engine(lambda e: e.graphs.replays)

    expected, _ = token_ids(eager, prompts, 48)
    got, streams = token_ids(graphed, prompts, 48)

    assert got == expected
    steps = max(len(ids) for ids in got) - 1  # decode steps after the prefill gave the first token
    assert graphed.run_on_engine(lambda e: e.graphs.replays) - replays_before >= steps > 0  # decode really replayed
    if batch >= 8:
        assert max_overlap(streams) >= batch // 2  # they ran batched


@pytest.mark.gpu
def test_a_prompt_several_pages_long_decodes_the_same_from_graphs(sessions):
    eager, graphed = sessions
    prompts = [LONG_PROMPT, chatml(QUESTIONS[0]), LONG_PROMPT + "Answer briefly."]

    expected, _ = token_ids(eager, prompts, 96)
    got, _ = token_ids(graphed, prompts, 96)

    assert got == expected
    assert graphed.cache_view().free_pages == graphed.cache_view().total_pages


@pytest.mark.gpu
def test_each_decode_step_is_queued_ahead_and_used_while_the_rows_go_on(sessions):
    eager, graphed = sessions
    prompt = chatml(QUESTIONS[3])
    used_before, queued_before = graphed.run_on_engine(lambda e: (e.graphs.used_ahead, e.graphs.queued_ahead))

    expected = eager.complete(prompt, max_new_tokens=40, sampler=SamplerSettings.greedy(), stop_at_eos=False)
    got = graphed.complete(prompt, max_new_tokens=40, sampler=SamplerSettings.greedy(), stop_at_eos=False)

    assert got.token_ids == expected.token_ids
    used, queued = graphed.run_on_engine(lambda e: (e.graphs.used_ahead - used_before, e.graphs.queued_ahead))
    assert used >= 40 - 3  # every step after the first replay, but the last (queued, then dropped)
    assert used <= queued - queued_before <= used + 1  # the last, queued after the last token, was dropped
    assert "steps queued ahead used" in graphed.status().decode


@pytest.mark.gpu
def test_rows_that_end_at_different_steps_drop_the_queued_step_and_decode_as_eager(sessions):
    eager, graphed = sessions

    def run(session: Session) -> list[tuple[int, ...]]:
        greedy = SamplerSettings.greedy()
        specs = [
            session.spec_for(chatml(q), JobOptions(max_new_tokens=n, sampler=greedy, stop_at_eos=False))
            for q, n in zip(QUESTIONS, (6, 40, 17, 29))
        ]
        return [stream.result().token_ids for stream in session.submit_together(specs)]

    used_before, queued_before = graphed.run_on_engine(lambda e: (e.graphs.used_ahead, e.graphs.queued_ahead))
    expected, got = run(eager), run(graphed)

    assert got == expected
    assert [len(ids) for ids in got] == [6, 40, 17, 29]
    used, queued = graphed.run_on_engine(lambda e: (e.graphs.used_ahead - used_before, e.graphs.queued_ahead))
    assert queued - queued_before - used >= 3  # a guess dropped where each of the first three rows ended
    assert graphed.cache_view().free_pages == graphed.cache_view().total_pages


@pytest.mark.gpu
@pytest.mark.parametrize("switch", ["default", "0"])
def test_exllamav3_queues_before_the_generator_waits_by_default_and_either_way_decodes_as_eager(
    sessions, monkeypatch, switch
):
    """By default the ExLlamaV3 decoder queues each step's successor at its forward, from its argmax on the card, on
    a stream of its own, while exllamav3's generator waits only for its own stream; `EXLNB_QUEUE_BEFORE_WAIT=0`
    queues it where the generator hands over the tokens, after its wait. One job alone uses every queued step but
    the last; rows that end at different steps drop theirs; either way the tokens are eager decode's, and no page
    is left behind."""
    eager, graphed = sessions
    if graphed.status().engine != "exllamav3":
        pytest.skip("the ExLlamaV2 decoder always queues at the forward: exllamav2's generator waits for no step")
    greedy = SamplerSettings.greedy()

    def run(session: Session, lengths: tuple[int, ...]) -> list[tuple[int, ...]]:
        specs = [
            session.spec_for(chatml(q), JobOptions(max_new_tokens=n, sampler=greedy, stop_at_eos=False))
            for q, n in zip(QUESTIONS, lengths)
        ]
        return [stream.result().token_ids for stream in session.submit_together(specs)]

    if switch == "default":
        monkeypatch.delenv("EXLNB_QUEUE_BEFORE_WAIT", raising=False)
    else:
        monkeypatch.setenv("EXLNB_QUEUE_BEFORE_WAIT", switch)
    session = load("auto", "exllamav3")
    try:
        assert ("before the generator's wait" in session.status().decode) == (switch == "default")
        alone, together = run(session, (40,)), run(session, (6, 40, 17, 29))
        used, queued = session.run_on_engine(lambda e: (e.graphs.used_ahead, e.graphs.queued_ahead))
        assert (alone, together) == (run(eager, (40,)), run(eager, (6, 40, 17, 29)))
        assert used >= 40 - 3 and queued - used >= 3  # the lone job's steps used; a guess dropped at each end
        assert session.cache_view().free_pages == session.cache_view().total_pages
        assert "queuing before the wait stopped" not in session.status().decode
    finally:
        session.unload()


@pytest.mark.gpu
def test_queuing_ahead_is_off_where_switched_off(sessions, monkeypatch):
    _, graphed = sessions
    monkeypatch.setenv("EXLNB_QUEUE_AHEAD", "0")
    session = load("auto", graphed.status().engine)
    try:
        session.complete(chatml(QUESTIONS[0]), max_new_tokens=8, sampler=SamplerSettings.greedy())
        assert session.run_on_engine(lambda e: e.graphs.queued_ahead) == 0
        assert "queued ahead" not in session.status().decode
    finally:
        session.unload()


@pytest.mark.gpu
def test_tokens_embedded_on_the_gpu_decode_as_the_host_path_s_and_eager(sessions, monkeypatch):
    """Both decoders embed a step's tokens on the card from a checked copy of the table (token_feed.py): the
    ExLlamaV2 decoder a queued step's argmax before it reaches the host, the ExLlamaV3 decoder every replayed
    step's tokens. With the feed switched off they embed on the host. Rows that end at different steps (each end
    drops a queued step) give the same tokens either way, and the same as eager decode."""
    eager, graphed = sessions
    engine = graphed.status().engine
    greedy = SamplerSettings.greedy()

    def run(session: Session) -> list[tuple[int, ...]]:
        specs = [
            session.spec_for(chatml(q), JobOptions(max_new_tokens=n, sampler=greedy, stop_at_eos=False))
            for q, n in zip(QUESTIONS, (9, 33, 21))
        ]
        return [stream.result().token_ids for stream in session.submit_together(specs)]

    monkeypatch.setenv("EXLNB_TOKEN_FEED", "0")
    host = load("auto", engine)
    try:
        assert "embedded on the GPU" not in host.status().decode
        used_before = graphed.run_on_engine(lambda e: e.graphs.used_ahead)
        fed, on_host, expected = run(graphed), run(host), run(eager)
    finally:
        host.unload()

    assert "tokens embedded on the GPU" in graphed.status().decode
    assert fed == on_host == expected
    if engine == "exllamav2":  # its feed is in the queued steps: they were used
        assert graphed.run_on_engine(lambda e: e.graphs.used_ahead) - used_before >= 9 - 3


@pytest.mark.gpu
def test_sampling_stays_with_the_library_unless_the_gpu_is_asked_for(sessions, drawing):
    assert "sampling on the GPU" not in sessions[1].status().decode
    assert sessions[1].run_on_engine(lambda e: e.draws) is None
    assert "sampling on the GPU" in drawing[1].status().decode


@pytest.mark.gpu
def test_graphed_decode_samples_on_the_gpu_and_a_seed_reproduces_its_answer(drawing):
    _, graphed = drawing
    sampled = SamplerSettings(temperature=1.0, top_k=40, top_p=0.9, token_frequency_penalty=0.1)
    prompt = chatml(QUESTIONS[1])
    drawn_before = graphed.run_on_engine(lambda e: e.draws.drawn_steps)

    answers = [graphed.complete(prompt, max_new_tokens=40, sampler=sampled, seed=seed).token_ids for seed in (5, 5, 6)]

    assert "sampling on the GPU" in graphed.status().decode
    assert answers[0] == answers[1] != answers[2]
    assert graphed.run_on_engine(lambda e: e.draws.drawn_steps) - drawn_before >= 3 * 30  # drawn in the graphs


@pytest.mark.gpu
def test_a_job_the_device_cannot_sample_takes_the_library_s_own_sampler(drawing):
    eager, graphed = drawing
    host_only = SamplerSettings(temperature=0.7, dry_multiplier=0.8)  # DRY stays on the host
    prompt = chatml(QUESTIONS[2])

    expected = eager.complete(prompt, max_new_tokens=24, sampler=host_only, seed=9).token_ids
    got = graphed.complete(prompt, max_new_tokens=24, sampler=host_only, seed=9).token_ids

    assert got == expected  # the library's sampler, the library's random stream: the same tokens as eager decode


@pytest.mark.gpu
def test_a_capture_that_fails_mid_generation_falls_back_to_eager_and_says_why(sessions, monkeypatch):
    eager, graphed = sessions
    session = load("auto", graphed.status().engine)  # its load check captured batches 1 and 3 for real
    try:

        def refuse(self, key, run, around_capture):
            raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

        monkeypatch.setattr(StepGraphs, "_capture", refuse)
        prompts = [chatml(q) for q in QUESTIONS[:6]]  # decode steps of batch sizes no graph exists for

        expected, _ = token_ids(eager, prompts, 32)
        got, _ = token_ids(session, prompts, 32)

        assert got == expected
        graphs = session.status().decode.split(", ")[0]  # what follows says which products are fused
        assert graphs.startswith("eager since capturing batch "), graphs
        assert graphs.endswith("failed: RuntimeError: operation not permitted when stream is capturing"), graphs
    finally:
        session.unload()


@pytest.mark.gpu
def test_a_quantized_cache_decodes_eagerly_and_says_why():
    if not torch.cuda.is_available():
        pytest.skip("CUDA-graph decode needs CUDA")
    session = load("auto", cache="q4")
    try:
        status = session.status()
        assert status.decode.split(", ")[0] == "eager"
        assert any("not from CUDA graphs" in note and "q4 cache" in note for note in status.notes), status.notes
        # greedy: under the default sampler (temperature 0.8) the answer held "Paris" in 46 of 120 tries on an H100
        answer = session.complete(chatml(QUESTIONS[0]), max_new_tokens=16, sampler=SamplerSettings.greedy())
        assert "Paris" in answer.text
    finally:
        session.unload()


@pytest.mark.gpu
def test_the_step_clock_accounts_for_each_replayed_step_on_both_engines(sessions):
    from benchmarks.speed_setups import CLOCKED_TOKENS, clocked_steps

    _, graphed = sessions
    got = clocked_steps(graphed)
    assert got["steps"] >= CLOCKED_TOKENS // 2, got  # a step is one asking of the decoder: one token at batch 1
    assert got["graph_ms"] > 0 and got["gpu_gap_ms"] >= 0
    assert sum(got["host_ms"].values()) == pytest.approx(got["wall_ms"], rel=1e-6)
    eight = clocked_steps(graphed, batch=8)
    assert eight["steps"] >= CLOCKED_TOKENS // 2 and eight["graph_ms"] > 0, eight  # a step of eight rows
    assert graphed.run_on_engine(lambda engine: engine.graphs.clock) is None  # stopped after
