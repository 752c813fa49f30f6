"""Distributions against a reference (issue 32, part 2): the math on hand-made logits, the real model scored on
the CPU engine, the reference kept on disk, and each bad input refused in one line."""

from __future__ import annotations

import math
import random
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from safetensors.torch import load_file, save_file

from exlnb.divergence import (
    BF16_ROUNDING_EPS,
    compare,
    kl_per_position,
    load_reference,
    perplexity,
    reference_path,
    top1_agreement,
)
from exlnb.engines.cpu.engine import CpuEngine
from exlnb.engines.registry import register_engine, unregister_engine
from exlnb.models import resolve_model
from exlnb.scoring import divergence, divergence_from, reference, score, text_ids
from exlnb.session import Session
from tests.toy_engine import TOY_SPEC

BUNDLED = "smollm2-135m-instruct"
TOKENS = 48


@pytest.fixture(scope="module")
def ids(cpu_session) -> list[int]:
    return text_ids(cpu_session, TOKENS)


@pytest.fixture(scope="module")
def bundled_reference(tmp_path_factory, ids):
    return reference(BUNDLED, ids, engine="cpu", cache_dir=tmp_path_factory.mktemp("references"))


def perturbed_copy(folder, target, scale: float, seed: int = 0):
    """The model at `folder` with Gaussian noise of `scale` times each weight tensor's std added: a stand-in for a
    quantized copy whose error grows with `scale`. The tokenizer files are copied unchanged."""
    target.mkdir()
    for path in folder.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, target / path.name)
    generator = torch.Generator().manual_seed(seed)
    weights = {
        name: tensor + scale * tensor.std() * torch.randn(tensor.shape, generator=generator).to(tensor.dtype)
        if tensor.dim() == 2
        else tensor
        for name, tensor in load_file(folder / "model.safetensors").items()
    }
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


# -- the math, on a hand-made example --------------------------------------------------------------------------


def test_top1_agreement_perplexity_and_kl_on_a_hand_made_example():
    reference_logits = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.25, 0.25, 0.5]]))
    model_logits = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.2, 0.2, 0.6]]))
    token_ids = [0, 1, 2]  # row 0 predicts token 1, row 1 predicts token 2

    assert top1_agreement(reference_logits, model_logits) == pytest.approx(2 / 3)
    assert perplexity(model_logits, token_ids) == pytest.approx(math.exp(-(math.log(0.3) + math.log(0.1)) / 2))
    assert perplexity(reference_logits, token_ids) == pytest.approx(math.exp(-(math.log(0.2) + math.log(0.1)) / 2))
    first = 0.7 * math.log(0.7 / 0.6) + 0.2 * math.log(0.2 / 0.3) + 0.1 * math.log(0.1 / 0.1)
    assert kl_per_position(reference_logits, model_logits)[0].item() == pytest.approx(first, rel=1e-5)

    result = compare(reference_logits, model_logits, token_ids, bins=(0.0, 0.6, 1.0))
    assert [(b.positions, b.top1_agreement) for b in result.by_confidence] == [(1, 1.0), (2, 0.5)]
    assert result.kl_median == pytest.approx(sorted(kl_per_position(reference_logits, model_logits).tolist())[1])


# -- the real model on the CPU engine -------------------------------------------------------------------------


def test_the_reference_against_itself_has_zero_kl_and_a_small_positive_noise_floor(cpu_session, ids):
    logits = score(cpu_session, ids)
    noisy = score(cpu_session, ids, noise_eps=BF16_ROUNDING_EPS)

    result = compare(logits, logits, ids, noise_kl=kl_per_position(logits, noisy))

    assert logits.shape == (TOKENS, cpu_session.tokenizer.vocab_size) and logits.dtype == torch.float32
    assert result.kl_mean == 0.0 and result.kl_p90 == 0.0 and result.top1_agreement == 1.0
    assert result.perplexity == result.reference_perplexity
    assert 0.0 < result.noise_floor < 1e-3, result.noise_floor
    assert "noise floor (bf16)" in result.table()


def test_the_noisy_pass_is_seeded_and_leaves_the_model_as_it_was(cpu_session, ids):
    before = score(cpu_session, ids)

    first, second = (score(cpu_session, ids, noise_eps=BF16_ROUNDING_EPS) for _ in range(2))

    assert torch.equal(first, second) and not torch.equal(first, before)
    assert torch.equal(score(cpu_session, ids), before)


def test_the_loaded_model_scored_against_its_own_cached_reference_diverges_by_nothing(cpu_session, bundled_reference):
    result = divergence(cpu_session, bundled_reference)

    assert result.kl_mean == 0.0 and result.top1_agreement == 1.0
    assert result.noise_floor == pytest.approx(float(bundled_reference.noise_kl.mean())) and result.noise_floor > 0


def test_every_scoring_engine_gives_the_bundled_model_s_distributions(engine_name, engine_session, bundled_reference):
    result = divergence(engine_session, bundled_reference)

    if engine_name == "cpu":  # the reference's own engine and weights: the same logits, bit for bit
        assert result.kl_mean == 0.0 and result.top1_agreement == 1.0
    else:  # fp16 kernels against the fp32 reference: rounding, far from a different model
        assert result.kl_mean < 0.01 and result.top1_agreement > 0.9, result.table()


def test_kl_is_positive_against_a_perturbed_model_and_grows_with_the_perturbation(tmp_path, bundled_reference):
    folder = resolve_model(BUNDLED)
    results = []
    for scale in (0.02, 0.05, 0.15):
        session = Session()
        session.load(str(perturbed_copy(folder, tmp_path / f"noise-{scale}", scale)), engine="cpu", progress=False)
        try:
            results.append(divergence(session, bundled_reference))
        finally:
            session.unload()

    kl = [r.kl_mean for r in results]
    assert 0.0 < kl[0] < kl[1] < kl[2], kl
    assert results[0].noise_floor < kl[0]
    assert results[-1].top1_agreement < 1.0


def test_the_reference_is_computed_once_and_read_from_disk_afterwards(monkeypatch, tmp_path, ids):
    calls = []
    real_score = CpuEngine.score

    def counted(engine, token_ids, **options):
        calls.append(len(token_ids))
        return real_score(engine, token_ids, **options)

    monkeypatch.setattr(CpuEngine, "score", counted)

    first = reference(BUNDLED, ids, engine="cpu", cache_dir=tmp_path)
    second = reference(BUNDLED, ids, engine="cpu", cache_dir=tmp_path)

    assert calls == [TOKENS, TOKENS]  # the reference and its noisy rerun, once
    assert torch.equal(first.logits, second.logits) and second.token_ids == tuple(ids)
    path = reference_path(resolve_model(BUNDLED), ids, "float32", tmp_path)
    assert path.is_file() and torch.equal(load_reference(path).logits, first.logits)
    reference(BUNDLED, ids[:-1], engine="cpu", cache_dir=tmp_path)  # another text is another reference
    assert calls == [TOKENS, TOKENS, TOKENS - 1, TOKENS - 1]


# -- bad input, one line each -----------------------------------------------------------------------------------


def test_a_reference_from_another_tokenizer_is_refused(cpu_session, bundled_reference):
    other = replace(bundled_reference, tokenizer_id="another")

    with pytest.raises(ValueError, match=r"^the reference .* has another tokenizer than the loaded model's"):
        divergence(cpu_session, other)


def never_computed(*args, **kwargs):
    pytest.fail("made the text or scored the reference's model before refusing")


def test_a_reference_folder_with_another_tokenizer_is_refused_before_its_model_is_loaded(
    cpu_session, tmp_path, monkeypatch
):
    folder = resolve_model(BUNDLED)
    other = tmp_path / "other-tokenizer"
    other.mkdir()
    for path in folder.iterdir():
        (other / path.name).symlink_to(path)
    (other / "tokenizer.json").unlink()
    (other / "tokenizer.json").write_text((folder / "tokenizer.json").read_text().replace('"<|im_end|>"', '"<|x|>"'))
    monkeypatch.setattr("exlnb.scoring.reference", never_computed)

    with pytest.raises(ValueError) as raised:
        divergence_from(cpu_session, other, tokens=TOKENS, engine="cpu")
    assert str(raised.value) == (
        "the reference (other-tokenizer) has another tokenizer than the loaded model's (smollm2-135m-instruct): "
        "compare models that share the reference's tokenizer"
    )


TOO_LONG = "a sequence of {tokens} tokens is longer than the model's cache (8192 tokens): give fewer tokens, or load "
TOO_LONG += "the model with a larger cache_tokens"


@pytest.mark.parametrize(
    "tokens, message",
    [
        (10**9, TOO_LONG.format(tokens=10**9)),  # built a 5 GB string first, and hung
        (9000, TOO_LONG.format(tokens=9000)),  # loaded and scored the reference's model first
        (1, "a sequence of 1 token(s) is too short to score: give at least 2"),
    ],
)
def test_a_text_the_loaded_cache_cannot_hold_is_refused_before_it_is_made(
    shell, cpu_session, monkeypatch, tokens, message
):
    assert cpu_session.engine.max_seq_len == 8192
    monkeypatch.setattr("exlnb.scoring.filler_ids", never_computed)
    monkeypatch.setattr("exlnb.scoring.reference", never_computed)

    with pytest.raises(ValueError) as raised:
        divergence_from(cpu_session, BUNDLED, tokens=tokens, engine="cpu")
    assert str(raised.value) == message
    with pytest.raises(UsageError, match=f"^{re.escape(message)}$"):
        shell.run_line_magic("exl_divergence", f"{BUNDLED} --tokens {tokens} --engine cpu")


class Pickled:
    """What a malicious file would unpickle: any callable, here one that leaves a mark."""

    def __init__(self, mark):
        self.mark = mark

    def __reduce__(self):
        return (Path.touch, (self.mark,))


def kept_fields(reference) -> dict:
    return {**reference.__dict__}


def with_values(tensor: torch.Tensor, values: dict) -> torch.Tensor:
    """A copy of `tensor` with the given values at the given indices."""
    copy = tensor.clone()
    for index, value in values.items():
        copy[index] = value
    return copy


BAD_REFERENCES = {
    "random bytes": (
        lambda ref, tmp: random.Random(0).randbytes(4096),
        "it does not load as tensors and plain values (UnpicklingError)",
    ),
    "a malicious pickle": (
        lambda ref, tmp: {**kept_fields(ref), "model": Pickled(tmp / "ran")},
        "it does not load as tensors and plain values (UnpicklingError)",
    ),
    "a bare tensor": (
        lambda ref, tmp: ref.logits,
        "it holds a Tensor, not a reference's fields (model, model_id, tokenizer_id, token_ids, dtype, logits, "
        "noise_kl)",
    ),
    "an extra key": (lambda ref, tmp: {**kept_fields(ref), "extra": 1}, "it has fields no reference has: extra"),
    "a missing key": (
        lambda ref, tmp: {k: v for k, v in kept_fields(ref).items() if k != "noise_kl"},
        "it lacks noise_kl",
    ),
    "ids outside the vocabulary": (
        lambda ref, tmp: {**kept_fields(ref), "token_ids": (*ref.token_ids[:-2], -1, 60000)},
        "its token ids [-1, 60000] are outside its vocabulary (0..49151)",
    ),
    "NaN logits": (
        lambda ref, tmp: {**kept_fields(ref), "logits": ref.logits.index_fill(1, torch.tensor([7]), math.nan)},
        f"its logits hold NaN or infinite values at {TOKENS} of {TOKENS} positions",
    ),
    "a NaN and an infinity among the logits": (
        lambda ref, tmp: {**kept_fields(ref), "logits": with_values(ref.logits, {(3, 7): math.nan, (5, 0): -math.inf})},
        f"its logits hold NaN or infinite values at 2 of {TOKENS} positions",
    ),
    "integer logits": (
        lambda ref, tmp: {**kept_fields(ref), "logits": ref.logits.long()},
        "its logits are not a [positions, vocabulary] tensor of floats",
    ),
    "logits of one position": (
        lambda ref, tmp: {**kept_fields(ref), "logits": ref.logits[0]},
        "its logits are not a [positions, vocabulary] tensor of floats",
    ),
    "token ids that are numbers but not integers": (
        lambda ref, tmp: {**kept_fields(ref), "token_ids": tuple(float(i) for i in ref.token_ids)},
        "its token_ids are not a list of integers",
    ),
    "a noise floor with a NaN": (
        lambda ref, tmp: {**kept_fields(ref), "noise_kl": with_values(ref.noise_kl, {(4,): math.nan})},
        "its noise_kl is not one finite number per position, nor None",
    ),
    "a model that is no name": (
        lambda ref, tmp: {**kept_fields(ref), "model": None},
        "its model, model_id, tokenizer_id and dtype are not all strings",
    ),
    "a dtype no reference is kept in": (
        lambda ref, tmp: {**kept_fields(ref), "dtype": "int8"},
        "its dtype 'int8' is not one of float32, float16, bfloat16",
    ),
    "fewer logits than ids": (
        lambda ref, tmp: {**kept_fields(ref), "logits": ref.logits[1:]},
        f"it has {TOKENS} token ids but logits for {TOKENS - 1} positions",
    ),
    "a noise floor of another length": (
        lambda ref, tmp: {**kept_fields(ref), "noise_kl": ref.noise_kl[1:]},
        "its noise_kl is not one finite number per position, nor None",
    ),
}


@pytest.mark.parametrize("kind", BAD_REFERENCES)
def test_a_bad_reference_file_is_refused_saying_what_is_wrong_in_one_line(shell, bundled_reference, tmp_path, kind):
    make, problem = BAD_REFERENCES[kind]
    path = tmp_path / "bad.pt"
    content = make(bundled_reference, tmp_path)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)

    with pytest.raises(ValueError) as raised:
        load_reference(path)
    assert str(raised.value) == f"{path} cannot serve as a reference: {problem}; give a file that exlnb.divergence kept"
    assert "weights_only" not in str(raised.value) and not (tmp_path / "ran").exists()
    with pytest.raises(UsageError, match=f"^{re.escape(str(raised.value))}$"):
        shell.run_line_magic("exl_divergence", str(path))


def test_a_kept_reference_without_a_noise_floor_passes_the_checks(shell, bundled_reference, tmp_path):
    kept = tmp_path / "kept.pt"  # what an engine that cannot inject noise keeps
    torch.save({**kept_fields(bundled_reference), "noise_kl": None}, kept)

    with capture_output() as captured:
        shell.run_line_magic("exl_divergence", str(kept))

    assert "noise floor (bf16)   n/a" in captured.stdout and "top-1 agreement      100.00%" in captured.stdout


def test_kl_between_different_vocabularies_is_refused():
    with pytest.raises(ValueError, match=r"^the model's vocabulary has 5 tokens and the reference's 4: KL divergence"):
        kl_per_position(torch.zeros(3, 4), torch.zeros(3, 5))


def test_a_token_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match=r"^token id 7 is outside the vocabulary of 4 tokens: score token ids of"):
        perplexity(torch.zeros(3, 4), [0, 7, 1])


def test_a_sequence_too_short_or_longer_than_the_cache_is_refused(cpu_session):
    max_len = cpu_session.run_on_engine(lambda engine: engine.max_seq_len)

    with pytest.raises(ValueError, match=r"^a sequence of 1 token\(s\) is too short to score: give at least 2$"):
        score(cpu_session, [1])
    with pytest.raises(ValueError, match=rf"^a sequence of {max_len + 1} tokens is longer than the model's cache \("):
        score(cpu_session, [1] * (max_len + 1))


def test_an_engine_that_returns_no_logits_is_refused():
    register_engine(TOY_SPEC)
    session = Session()
    try:
        session.load(BUNDLED, engine="toy", cache_tokens=4096, progress=False)
        with pytest.raises(ValueError, match=r"^the toy engine returns no logits to score: load the model with .*cpu"):
            score(session, [1, 2, 3])
    finally:
        session.unload()
        unregister_engine("toy")


def test_an_unknown_reference_dtype_is_refused(ids):
    with pytest.raises(ValueError, match=r"^dtype='int8': choose one of float32, float16, bfloat16$"):
        reference(BUNDLED, ids, dtype="int8")


# -- the magic --------------------------------------------------------------------------------------------------


def test_the_magic_prints_the_table_against_a_kept_reference_and_stores_the_result(shell, bundled_reference, tmp_path):
    kept = tmp_path / "kept.pt"
    torch.save({**bundled_reference.__dict__}, kept)

    with capture_output() as captured:
        shell.run_line_magic("exl_divergence", f"{kept} --out scored")

    assert "KL mean / median / p90  0 / 0 / 0" in captured.stdout and "top-1 agreement      100.00%" in captured.stdout
    assert shell.user_ns["scored"].positions == TOKENS


def test_the_magic_scores_against_a_reference_folder_and_keeps_its_logits(shell, monkeypatch, tmp_path):
    monkeypatch.setattr("exlnb.divergence.cache_root", lambda: tmp_path)

    with capture_output() as captured:
        shell.run_line_magic("exl_divergence", f"{BUNDLED} --tokens 16 --engine cpu --dtype float16")

    assert "positions            16\n" in captured.stdout and "noise floor (bf16)   n/a" not in captured.stdout
    [kept] = (tmp_path / "references").iterdir()
    assert kept.suffix == ".pt"
    # it says what it is doing while it runs (8.5 s for 512 tokens), and where it kept the reference
    lines = captured.stdout.splitlines()
    assert lines[0].startswith(f"the reference's logits: scoring {BUNDLED} over 16 tokens in a session of its own")
    assert lines[1] == "the loaded model: scoring it over 16 tokens ..."
    assert f"reference file       {kept} ({kept.stat().st_size / 1e6:.1f} MB)" in lines
    with capture_output() as again:
        shell.run_line_magic("exl_divergence", f"{BUNDLED} --tokens 16 --engine cpu --dtype float16")
    assert "the reference's logits" not in again.stdout and f"reference file       {kept} (" in again.stdout


def test_the_magics_help_names_the_noise_floor_it_prints(shell, capsys):
    shell.run_line_magic("exl_divergence", "--help")
    shown = capsys.readouterr().out
    assert "bf16" in shown and "fp16 noise" not in shown


def test_the_magic_refuses_a_missing_reference_file_in_one_line(shell, tmp_path):
    with pytest.raises(UsageError, match=r"^no reference at .*missing\.pt: give a file that exlnb\.divergence kept"):
        shell.run_line_magic("exl_divergence", str(tmp_path / "missing.pt"))


@pytest.mark.parametrize("name", ["1abc", "class"])
def test_the_magic_stores_its_result_only_under_a_python_variable(shell, bundled_reference, tmp_path, name):
    kept = tmp_path / "kept.pt"
    torch.save({**bundled_reference.__dict__}, kept)

    with pytest.raises(UsageError, match=f"^--out {name}: name a Python variable"):
        shell.run_line_magic("exl_divergence", f"{kept} --out {name}")
    assert name not in shell.user_ns


def test_a_reference_longer_than_a_default_cache_is_scored_in_one_as_large_as_the_loaded_model_s(monkeypatch):
    import exlnb.scoring

    asked = {}

    def reference(model, token_ids, **options):
        asked.update(options, tokens=len(token_ids))
        raise RuntimeError("stopped before loading the reference model")

    monkeypatch.setattr(exlnb.scoring, "reference", reference)
    session = Session()
    session.load("smollm2-135m-instruct", engine="cpu", cache_tokens=12288, progress=False)
    try:
        with pytest.raises(RuntimeError, match="stopped before"):
            exlnb.scoring.divergence_from(session, "smollm2-135m-instruct", tokens=9000)
    finally:
        session.unload()
    assert asked["tokens"] == 9000 and asked["cache_tokens"] == 12288
