"""The ExLlamaV3 engine's decode attention on exlnb's Triton kernel (engines/exllamav3/decode_attention.py).

On the CPU: the memo that offers exlnb's kernel first and the library's choice after it, and which calls the kernel
takes, over stand-ins. On a GPU (`pytest -m gpu`): the bundled model's attentions take it, it agrees with exllamav3's
own decode kernel on each of their shapes, and a kernel that disagrees is refused at load with a note. The rest of
the ExLlamaV3 suite (batched answers equal to each alone, graphs against eager) runs through it, as the engine
loads by default.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from exlnb.engines.exllamav2 import paged_attention
from exlnb.engines.exllamav3.decode_attention import MEMO_KEY, OursFirst, takes
from exlnb.session import Session
from tests.helpers import skip_without_library

# -- the memo and the calls it takes, over stand-ins -------------------------------------------------------------


def test_the_memo_offers_exlnb_first_then_the_library_s_choice_and_keeps_what_the_library_finds():
    calls = []

    def ours(args):
        calls.append("ours")
        return "ours" if args == "decode" else None

    def library(args):
        calls.append("library")
        return "library"

    memo = OursFirst(ours, {MEMO_KEY: library, "fn_qc": library})
    assert memo.get(MEMO_KEY)("decode") == "ours" and calls == ["ours"]
    assert memo.get(MEMO_KEY)("prefill") == "library" and calls == ["ours", "ours", "library"]
    assert memo.get("fn_qc") is library  # the quantized-cache memo stays the library's

    found = []
    memo[MEMO_KEY] = lambda args: found.append(args) or "found"  # what attn_dispatch memoises after its search
    assert memo.get(MEMO_KEY)("decode") == "ours" and memo.get(MEMO_KEY)("prefill") == "found" and found == ["prefill"]


def test_an_empty_memo_offers_exlnb_alone_so_a_declined_call_searches_the_library_s_list():
    def ours(args):
        return None

    assert OursFirst(ours, {}).get(MEMO_KEY) is ours


def decode_call(**changes) -> SimpleNamespace:
    """A stand-in of exllamav3 1.6.5's AttnArgs for one sequence's decode step on an fp16 paged cache."""
    window = changes.pop("window", (-1, -1))
    call = dict(
        bsz=1, q=SimpleNamespace(is_cuda=True), k=object(), k_cache=object(), cu_seqlens=None, q_cache=None, sinks=None,
        non_causal_spans=None, sink_key0=False, softcap=0.0,
    )  # fmt: skip
    return SimpleNamespace(**{**call, **changes}, get_window_size=lambda: window)


def test_one_sequence_s_decode_step_on_an_fp16_paged_cache_is_taken():
    assert takes(decode_call())


@pytest.mark.parametrize(
    "changes",
    [
        {"bsz": 8},  # a batch: exllamav3 sizes its splits to it
        {"k_cache": None},  # no cache
        {"k": None},  # nothing to append
        {"cu_seqlens": object()},  # variable-length prefill
        {"q_cache": object()},  # a quantized cache read directly
        {"sinks": object()},
        {"non_causal_spans": [(0, 4)]},
        {"sink_key0": True},
        {"softcap": 30.0},
        {"window": (4096, 0)},  # a sliding window
        {"q": SimpleNamespace(is_cuda=False)},
    ],
    ids=lambda c: next(iter(c)),
)
def test_calls_the_kernel_is_not_held_to_exllamav3_s_for_keep_the_library_s_path(changes):
    assert not takes(decode_call(**changes))


# -- on the GPU -------------------------------------------------------------------------------------------------


def load() -> Session:
    skip_without_library("exllamav3")
    session = Session()
    session.load("smollm2-135m-instruct", engine="exllamav3", progress=False)
    return session


@pytest.fixture(scope="module")
def exl3():
    session = load()
    yield session
    session.unload()


def _eight_tokens(session) -> int:
    """How many tokens eight decode steps give: greedy, past the end token (the bundled model may end " Paris." in
    three, and an unseeded draw at the default temperature did, 2026-11-29), so the count is the engine's alone."""
    return (
        session.generate("The capital of France is", max_new_tokens=8, temperature=0, stop_at_eos=False)
        .result()
        .new_tokens
    )


@pytest.mark.gpu
def test_the_bundled_model_decodes_through_exlnb_s_attention_which_agrees_with_exllamav3_s(exl3):
    from exlnb.engines.exllamav3.decode_attention import check_decode_attention

    def checks(engine):
        attentions = engine.decode_attention.attentions
        return len(attentions), [check_decode_attention(a, engine.page_size) for a in attentions]

    count, reasons = exl3.run_on_engine(checks)
    assert count == 30 and reasons == [None] * count  # each of SmolLM2-135M's 30 layers
    assert (
        exl3.status().attention
        == "exlnb paged attention (Triton decode, one sequence), exllamav3's for batches and prefill"
    )
    assert _eight_tokens(exl3) == 8


@pytest.mark.gpu
def test_a_kernel_that_disagrees_with_exllamav3_s_is_refused_at_load_in_one_line(monkeypatch):
    from exlnb.engines import triton_decode

    monkeypatch.setattr(triton_decode, "paged_decode_attention", lambda q, *args, **kwargs: torch.zeros_like(q))
    session = load()
    try:
        status = session.status()
        assert status.attention == "exllamav3 paged attention"
        [note] = [note for note in status.notes if note.startswith("decode attention")]
        assert note.startswith("decode attention on exllamav3's kernels: exlnb's decode attention differs from")
        assert _eight_tokens(session) == 8
    finally:
        session.unload()


@pytest.mark.gpu
def test_the_switch_keeps_exllamav3_s_attention(monkeypatch):
    monkeypatch.setattr(paged_attention, "TRITON_DECODE", False)  # what EXLNB_TRITON_DECODE=0 sets at import
    session = load()
    try:
        assert session.status().attention == "exllamav3 paged attention"
        assert not any(note.startswith("decode attention") for note in session.status().notes)
    finally:
        session.unload()
