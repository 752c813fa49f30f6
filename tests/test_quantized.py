"""Quantized models on the GPU (`pytest -m gpu`): the bundled model quantized once per run to 4.0 bits in
EXL2 and EXL3, each loaded by `engine="auto"`, answering greedily, with a q4 cache too."""

from __future__ import annotations

import json
import time

import pytest

from exlnb import EosReason, SamplerSettings
from exlnb.models import BUNDLED_MODEL
from exlnb.quantize import quantize
from exlnb.session import Session
from exlnb.templates import chatml
from tests.helpers import skip_without_library

pytestmark = pytest.mark.gpu

ENGINE_OF = {"exl2": "exllamav2", "exl3": "exllamav3"}


@pytest.fixture(scope="session", params=["exl2", "exl3"])
def quantized(request):
    """(format, folder) of the bundled model at 4.0 bits."""
    skip_without_library(ENGINE_OF[request.param])
    if request.param == "exl2":
        skip_without_library("fastparquet")
    return request.param, quantize(BUNDLED_MODEL, format=request.param, bits=4.0, progress=False)


def test_the_converter_writes_the_format_into_config(quantized):
    fmt, folder = quantized
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == fmt
    assert config["quantization_config"]["bits"] == pytest.approx(4.0, abs=0.3)


def test_asking_again_returns_the_cached_folder_at_once(quantized):
    fmt, folder = quantized
    started = time.perf_counter()
    assert quantize(BUNDLED_MODEL, format=fmt, bits=4.0, progress=False) == folder
    assert time.perf_counter() - started < 5.0


def answer(folder, cache: str):
    """(status, greedy answer) of the quantized model over an fp16 or q4 cache, in a session of its own."""
    session = Session()
    try:
        status = session.load(str(folder), cache=cache, progress=False)
        return status, session.complete(
            chatml("What is the capital of France?"), max_new_tokens=40, sampler=SamplerSettings.greedy()
        )
    finally:
        session.unload()


def test_auto_loads_it_on_its_engine_and_it_answers(quantized):
    fmt, folder = quantized
    status, result = answer(folder, "fp16")
    assert status.engine == ENGINE_OF[fmt] and status.cache_dtype == "fp16"
    assert "Paris" in result.text
    # how it goes on after the answer is the quantization's, which differs from one conversion to the next: on
    # the H100 one EXL2 4.0-bit conversion stopped after "Paris.", another of the same commit went on to the limit
    assert result.eos_reason in (EosReason.STOP_TOKEN, EosReason.MAX_NEW_TOKENS)


def test_a_q4_cache_gives_the_same_answer(quantized):
    """The same answer up to and including "Paris". Not the same ending: on the H100 the EXL2 4.0-bit model over a
    q4 cache went on after it ("The capital of France is Paris, also known as the City of Light. ...") to its
    40-token limit, where over an fp16 cache it stopped."""
    fmt, folder = quantized
    _, fp16 = answer(folder, "fp16")
    status, q4 = answer(folder, "q4")
    assert status.engine == ENGINE_OF[fmt] and status.cache_dtype == "q4"
    assert "Paris" in fp16.text
    through_paris = fp16.text[: fp16.text.index("Paris") + len("Paris")]
    assert q4.text.startswith(through_paris)


def test_the_other_engine_refuses_the_folder(quantized):
    fmt, folder = quantized
    other = "exllamav2" if fmt == "exl3" else "exllamav3"
    with pytest.raises(ValueError, match=f"the {other} engine cannot load {fmt.upper()} weights"):
        Session().load(str(folder), engine=other, progress=False)


def test_an_exl3_model_decodes_from_cuda_graphs_with_the_tokens_of_eager_decode(quantized):
    """exllamav3's own per-layer graphs, launched inside the engine's capture, crashed the process, and their plain
    paths' pointer tables made every capture fail, so EXL3 models decoded eagerly (H100, 2026-11-28)."""
    fmt, folder = quantized
    if fmt != "exl3":
        pytest.skip("the ExLlamaV3 engine's graphs over exllamav3's EXL3 layers")
    answers = {}
    for graphs in ("auto", "off"):
        session = Session()
        try:
            status = session.load(str(folder), graphs=graphs, progress=False)
            answers[graphs] = session.complete(
                chatml("What is the capital of France?"), max_new_tokens=24, sampler=SamplerSettings.greedy()
            ).token_ids
        finally:
            session.unload()
        if graphs == "auto":
            assert status.decode.startswith("CUDA graphs") and "exllamav3's own graphs off" in status.decode, (
                status.notes
            )
    assert answers["auto"] == answers["off"]
