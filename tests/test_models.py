"""Resolving and preparing model folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from exlnb.models import (
    SMOLLM2,
    BundledGguf,
    byte_level_repaired,
    fix_config_for_exllamav2,
    prepare_bundled,
    repair_tokenizer,
    resolve_model,
    verify_gguf,
)


def test_bundled_model_is_an_fp16_folder_that_exllamav2_reads_correctly(cpu_session):
    folder = resolve_model("smollm2-135m-instruct")
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_theta"] == 100000.0  # exllamav2 0.3.2 reads this key only
    assert config["dtype"] == "float16"
    assert config["model_type"] == "llama"
    assert (folder / "tokenizer.json").is_file()


def test_a_local_model_folder_is_accepted_as_is(cpu_session):
    folder = resolve_model("smollm2-135m-instruct")
    assert resolve_model(str(folder)) == folder


def test_rope_theta_is_lifted_from_rope_parameters(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}))
    fix_config_for_exllamav2(path)
    assert json.loads(path.read_text())["rope_theta"] == 500000.0


def test_an_existing_top_level_rope_theta_is_left_alone(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"rope_theta": 10000.0, "rope_parameters": {"rope_theta": 1.0}}))
    fix_config_for_exllamav2(path)
    assert json.loads(path.read_text())["rope_theta"] == 10000.0


def _spec_for(data: bytes) -> BundledGguf:
    import hashlib

    return BundledGguf("x==1", "m.gguf", len(data), hashlib.sha256(data).hexdigest(), "org/repo")


def test_a_truncated_gguf_is_refused(tmp_path):
    good = b"GGUF" + bytes(100)
    path = tmp_path / "m.gguf"
    path.write_bytes(good[:50])
    with pytest.raises(OSError, match="50 bytes, expected 104"):
        verify_gguf(path, _spec_for(good))


def test_an_altered_gguf_is_refused(tmp_path):
    good = b"GGUF" + bytes(100)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(99) + b"\x01")
    with pytest.raises(OSError, match="refusing to use it"):
        verify_gguf(path, _spec_for(good))


def test_the_bundled_gguf_spec_matches_the_published_file():
    assert SMOLLM2.size == 98_362_432
    assert SMOLLM2.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def test_a_file_instead_of_a_folder_is_a_clear_error(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"")
    with pytest.raises(NotADirectoryError, match="pass the model's folder"):
        resolve_model(str(path))


def test_the_cpu_engine_never_imports_exllamav2(cpu_session):
    # exllamav2 JIT-compiles CUDA code on import: the CPU path must not pay for it (or fail on it)
    code = (
        "import sys; from exlnb import get_session; "
        "get_session().load(engine='cpu', progress=False, cache_tokens=512); "
        "assert 'exllamav2' not in sys.modules, 'exllamav2 was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


def test_the_models_own_eos_wins_over_a_misread_tokenizer_eos(cpu_session, tmp_path):
    # transformers 5.17 read eos 1 (<|im_start|>) from the converted folder; jobs then never stopped
    import shutil

    from exlnb.engines.tokenizer import HfTokenizer

    source = resolve_model("smollm2-135m-instruct")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        shutil.copy(source / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|im_start|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))

    tokenizer = HfTokenizer(tmp_path)
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.decode([tokenizer.eos_token_id]) == "<|im_end|>"


# The decoder chain transformers 5.17 wrote for the bundled GGUF's byte-level vocabulary (seen on the GPU machine)
SENTENCEPIECE_CHAIN = {
    "type": "Sequence",
    "decoders": [
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    ],
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json")


def as_transformers_517_wrote_it(bundled: Path, folder: Path) -> Path:
    """The bundled model's tokenizer files, its tokenizer.json decoded as transformers 5.17 converted it."""
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(bundled / name, folder / name)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["decoder"] = SENTENCEPIECE_CHAIN
    spec["model"]["byte_fallback"] = True
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def _person_mask_after_its_key(folder: Path) -> set[int]:
    """The tokens llguidance allows after `{"name":` under a JSON schema, through exlnb's tokenizer."""
    from exlnb.engines.constraint import OutputConstraint
    from exlnb.engines.grammar import GrammarMatcher
    from exlnb.engines.tokenizer import HfTokenizer

    tokenizer = HfTokenizer(folder)
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    matcher = GrammarMatcher(OutputConstraint.from_json_schema(schema), tokenizer, tokenizer.vocab_size, [])
    for token in tokenizer.encode('{"name":'):
        assert token in matcher.allowed_ids()
        matcher.consume(token)
    return matcher.allowed_ids()


def test_llguidance_misreading_a_tokenizer_is_one_clear_error_not_wrong_masks(cpu_session, tmp_path):
    broken = as_transformers_517_wrote_it(resolve_model("smollm2-135m-instruct"), tmp_path / "broken")
    with pytest.raises(
        ValueError,
        match=r"^llguidance reads this tokenizer's tokens otherwise than it decodes them "
        r"\(' \{\"name\"' reads as 'Ġ\{\"name\"'\).*repair_tokenizer",
    ):
        _person_mask_after_its_key(broken)


def test_the_repaired_tokenizer_decodes_alike_and_its_masks_allow_the_space_the_grammar_forces(cpu_session, tmp_path):
    from exlnb.engines.tokenizer import HfTokenizer

    bundled = resolve_model("smollm2-135m-instruct")
    broken = as_transformers_517_wrote_it(bundled, tmp_path / "broken")
    assert repair_tokenizer(broken) and not repair_tokenizer(broken)  # the second call finds nothing to do
    allowed = _person_mask_after_its_key(broken)
    space_quote, colon = HfTokenizer(broken).encode(' "')[0], HfTokenizer(broken).encode(":")[0]
    assert space_quote in allowed and colon not in allowed
    assert allowed == _person_mask_after_its_key(bundled)
    text = (Path(__file__).parents[1] / "README.md").read_text()
    repaired, original = HfTokenizer(broken), HfTokenizer(bundled)
    assert repaired.encode(text) == original.encode(text) and repaired.decode(repaired.encode(text)) == text


def test_a_bundled_folder_converted_before_the_repair_is_repaired_when_it_is_next_used(
    cpu_session, tmp_path, monkeypatch
):
    import exlnb.models

    bundled = resolve_model("smollm2-135m-instruct")
    monkeypatch.setattr(exlnb.models, "cache_root", lambda: tmp_path)
    cached = as_transformers_517_wrote_it(bundled, tmp_path / "models" / "smollm2-135m-instruct")
    (cached / "model.safetensors").symlink_to(bundled / "model.safetensors")
    assert prepare_bundled(progress=False) == cached
    decoder = json.loads((cached / "tokenizer.json").read_text())["decoder"]
    assert decoder == SENTENCEPIECE_CHAIN["decoders"][-1]


def test_tokenizers_with_nothing_to_repair_are_left_alone(tmp_path):
    sentencepiece = {
        "model": {"type": "BPE", "byte_fallback": True},
        "pre_tokenizer": {"type": "Metaspace"},
        "decoder": SENTENCEPIECE_CHAIN,
    }  # a Llama-2 style vocabulary really uses its fallback
    llama3 = {
        "model": {"type": "BPE"},
        "decoder": {"type": "ByteLevel"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Split"}, {"type": "ByteLevel"}]},
    }
    assert byte_level_repaired(sentencepiece) is None and byte_level_repaired(llama3) is None
    (tmp_path / "tokenizer.json").write_text(json.dumps(sentencepiece))
    assert not repair_tokenizer(tmp_path) and not repair_tokenizer(tmp_path / "missing")


@pytest.mark.slow  # converts the bundled GGUF (30 s on two cores)
def test_preparing_the_bundled_model_shows_exlnbs_one_progress_line_and_no_library_bar(tmp_path):
    """A new user's first %exl_load showed transformers' bars ("Converting and de-quantizing GGUF tensors",
    "Writing model shards"), as widgets that read "Error displaying widget" once the notebook was reopened, and
    exlnb's own bar on red (stderr), left at 50% under them."""
    from exlnb.models import bundled_gguf

    env = {**os.environ, "EXLNB_HOME": str(tmp_path), "EXLNB_BUNDLED_GGUF": str(bundled_gguf())}
    code = "from exlnb.models import prepare_bundled; print(prepare_bundled())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=True)
    out, err = done.stdout.decode(), done.stderr.decode()  # as bytes: text mode would turn tqdm's \r into \n

    bar, folder = out.split("\r")[-1].splitlines()  # the line as tqdm last drew it over itself, then the print
    assert folder == str(tmp_path / "models" / "smollm2-135m-instruct")
    assert bar.startswith("exlnb: preparing SmolLM2-135M-Instruct: 100%") and "4/4" in bar
    assert "%|" not in err and "Converting" not in err + out and "Writing model shards" not in err + out


def test_silencing_the_libraries_bars_puts_them_back_afterwards():
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from exlnb.models import library_bars_silenced

    before = gguf_utils.tqdm
    with library_bars_silenced():
        assert not hf_logging.is_progress_bar_enabled() and gguf_utils.tqdm(range(3)).disable
    assert hf_logging.is_progress_bar_enabled() and gguf_utils.tqdm is before
