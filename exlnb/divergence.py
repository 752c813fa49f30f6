"""How far a model's next-token distributions stray from a reference's, position by position.

The measures ExLlamaV3's `eval/qbench.py` reports for a quantized model against its unquantized reference, over
one fixed token sequence: the KL divergence KL(reference || model) at every position (mean, median, p90, and
split by how confident the reference was), top-1 agreement, the perplexity of both, and a noise floor: the
reference run again with bf16-rounding-scale noise after every decoder layer (qbench's `BF16_ROUNDING_EPS`),
the KL any lossy scheme shows even if it adds no more error than another kernel would. Reference logits (and
the floor's per-position KL) are computed once and kept on disk, keyed by the model folder's weights, the token
ids and the dtype they are kept in. No session here: `exlnb.scoring` gets the logits from a loaded model.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from exlnb.engines.checks import is_number
from exlnb.models import cache_root

# bins of the reference's top-1 probability, qbench's CONF_BUCKETS: the mean KL is dominated by positions where
# the reference is undecided; the confident bins isolate the damage from the floor (eval/qbench.py's docstring)
CONFIDENCE_BINS = (0.0, 0.25, 0.5, 0.75, 0.95, 1.0)
# one bf16 unit roundoff of multiplicative noise per element per layer (exllamav3's eval/qbench/measure.py)
BF16_ROUNDING_EPS = 2**-9
REFERENCE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")


@dataclass(frozen=True)
class ConfidenceBin:
    """The positions where the reference's top-1 probability lay in [low, high)."""

    low: float
    high: float
    positions: int
    kl_mean: float
    top1_agreement: float


@dataclass(frozen=True)
class Divergence:
    """One model against one reference over one token sequence."""

    positions: int
    kl_mean: float
    kl_median: float
    kl_p90: float
    top1_agreement: float
    perplexity: float
    reference_perplexity: float
    by_confidence: tuple[ConfidenceBin, ...]
    noise_floor: float | None = None
    reference_file: str | None = None  # where the reference's logits are kept, where known

    def table(self) -> str:
        """A compact text table: the summary, then a row per confidence bin that holds positions."""
        floor = "n/a" if self.noise_floor is None else f"{self.noise_floor:.4g}"
        kept = [f"reference file       {file_words(Path(self.reference_file))}"] if self.reference_file else []
        lines = [
            *kept,
            f"positions            {self.positions}",
            f"KL mean / median / p90  {self.kl_mean:.4g} / {self.kl_median:.4g} / {self.kl_p90:.4g}",
            f"noise floor (bf16)   {floor} (mean KL of the reference with noise after every layer)",
            f"top-1 agreement      {self.top1_agreement:.2%}",
            f"perplexity           {self.perplexity:.4g} (reference {self.reference_perplexity:.4g})",
            "reference top-1 p    positions  KL mean   top-1 agreement",
        ]
        lines += [
            f"{b.low:.2f}-{b.high:.2f}{'':10}{b.positions:>9}  {b.kl_mean:<10.4g}{b.top1_agreement:.2%}"
            for b in self.by_confidence
            if b.positions
        ]
        return "\n".join(lines)


def file_words(path: Path) -> str:
    """'/root/.cache/exlnb/references/x.pt (50.3 MB)': a kept file and its size, as the magic says where it is."""
    return f"{path} ({path.stat().st_size / 1e6:.1f} MB)" if path.is_file() else str(path)


def check_vocabularies(reference_logits: torch.Tensor, logits: torch.Tensor) -> None:
    if reference_logits.shape[-1] != logits.shape[-1]:
        raise ValueError(
            f"the model's vocabulary has {logits.shape[-1]} tokens and the reference's {reference_logits.shape[-1]}: "
            "KL divergence compares distributions over one vocabulary; score a model with the reference's tokenizer"
        )
    if reference_logits.shape[0] != logits.shape[0]:
        raise ValueError(
            f"the model gave {logits.shape[0]} positions and the reference {reference_logits.shape[0]}: "
            "score both on the same token ids"
        )


def kl_per_position(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || model) in nats at each position: [positions] from two [positions, vocab] logit tensors."""
    check_vocabularies(reference_logits, logits)
    log_p = F.log_softmax(reference_logits.float(), dim=-1)
    log_q = F.log_softmax(logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def top1_agreement(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """The share of positions where the model's most likely token is the reference's."""
    check_vocabularies(reference_logits, logits)
    return float((reference_logits.argmax(-1) == logits.argmax(-1)).float().mean())


def perplexity(logits: torch.Tensor, token_ids: Sequence[int]) -> float:
    """exp(mean negative log-likelihood) of token_ids[1:], each predicted by the row before it."""
    check_sequence(token_ids)
    targets = torch.tensor(list(token_ids[1:]))
    if int(targets.max()) >= logits.shape[-1]:
        raise ValueError(
            f"token id {int(targets.max())} is outside the vocabulary of {logits.shape[-1]} tokens: "
            "score token ids of the model's own tokenizer"
        )
    return math.exp(float(F.cross_entropy(logits[: len(targets)].float(), targets)))


def compare(
    reference_logits: torch.Tensor,
    logits: torch.Tensor,
    token_ids: Sequence[int],
    *,
    bins: Sequence[float] = CONFIDENCE_BINS,
    noise_kl: torch.Tensor | None = None,
) -> Divergence:
    """Every measure of `logits` against `reference_logits`, both scored on `token_ids`; `noise_kl`, the
    reference's noisy rerun's KL per position, gives the noise floor."""
    kl = kl_per_position(reference_logits, logits)
    agree = reference_logits.argmax(-1) == logits.argmax(-1)
    confidence = F.softmax(reference_logits.float(), dim=-1).max(dim=-1).values
    by_confidence = []
    for low, high in zip(bins, bins[1:]):
        inside = (confidence >= low) & ((confidence < high) if high < bins[-1] else (confidence <= high))
        count = int(inside.sum())
        by_confidence.append(
            ConfidenceBin(
                low,
                high,
                count,
                float(kl[inside].mean()) if count else math.nan,
                float(agree[inside].float().mean()) if count else math.nan,
            )
        )
    return Divergence(
        positions=len(kl),
        kl_mean=float(kl.mean()),
        kl_median=float(kl.median()),
        kl_p90=float(torch.quantile(kl, 0.9)),
        top1_agreement=float(agree.float().mean()),
        perplexity=perplexity(logits, token_ids),
        reference_perplexity=perplexity(reference_logits, token_ids),
        by_confidence=tuple(by_confidence),
        noise_floor=None if noise_kl is None else float(noise_kl.mean()),
    )


def check_sequence(token_ids: Sequence[int], max_len: int | None = None) -> None:
    check_sequence_length(len(token_ids), max_len)


def check_sequence_length(count: int, max_len: int | None = None) -> None:
    """A sequence of `count` tokens can be scored by a model whose cache holds `max_len`: checked before a text of
    that many tokens is made (`--tokens 1000000000` built a 5 GB string first)."""
    if count < 2:
        raise ValueError(f"a sequence of {count} token(s) is too short to score: give at least 2")
    if max_len is not None and count > max_len:
        raise ValueError(
            f"a sequence of {count} tokens is longer than the model's cache ({max_len} tokens): "
            "give fewer tokens, or load the model with a larger cache_tokens"
        )


# -- the reference, kept on disk ---------------------------------------------------------------------------------


def _digest(parts: Sequence[object]) -> str:
    return hashlib.sha256("\x00".join(map(str, parts)).encode()).hexdigest()[:16]


def model_identity(folder: Path) -> str:
    """Its config.json and its weight files' names, sizes and modification times: new weights, a new identity."""
    weights = sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    return _digest(
        [(folder / "config.json").read_text(), *((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in weights)]
    )


def tokenizer_identity(folder: Path) -> str:
    """The tokenizer files' contents: two folders with one identity encode every text the same."""
    return _digest(
        [
            hashlib.sha256((folder / name).read_bytes()).hexdigest() if (folder / name).is_file() else ""
            for name in TOKENIZER_FILES
        ]
    )


@dataclass(frozen=True, eq=False)
class Reference:
    """A reference model's logits over one token sequence, and what they were computed from."""

    model: str  # the folder
    model_id: str
    tokenizer_id: str
    token_ids: tuple[int, ...]
    dtype: str
    logits: torch.Tensor
    noise_kl: torch.Tensor | None  # KL per position of the reference's noisy rerun; None where not computed

    @property
    def vocab_size(self) -> int:
        return self.logits.shape[-1]

    def check_tokenizer(self, tokenizer_id: str, vocab_size: int) -> None:
        """A reference scored with another tokenizer compares different tokens: refused in one line."""
        check_same_tokenizer(self.model, self.tokenizer_id, self.vocab_size, tokenizer_id, vocab_size)


def check_same_tokenizer(
    reference: str, reference_tokenizer: str, reference_vocab: int | None, tokenizer_id: str, vocab_size: int
) -> None:
    """Refuse, in one line, a reference whose tokenizer (its files, or its vocabulary's size where known) is not the
    loaded model's: its distributions are over other tokens."""
    if reference_tokenizer != tokenizer_id or reference_vocab not in (None, vocab_size):
        size = "" if reference_vocab is None else f", {reference_vocab} tokens"
        raise another_tokenizer(f"{reference}{size}", f"{vocab_size} tokens")


def another_tokenizer(reference: str, loaded: str) -> ValueError:
    """The refusal of a reference whose tokenizer is not the loaded model's, kept or about to be computed."""
    return ValueError(
        f"the reference ({reference}) has another tokenizer than the loaded model's ({loaded}): compare models "
        "that share the reference's tokenizer"
    )


def reference_path(folder: Path, token_ids: Sequence[int], dtype: str, cache_dir: Path | None = None) -> Path:
    """Where the reference logits of `folder` over `token_ids`, kept as `dtype`, live in the cache."""
    if dtype not in REFERENCE_DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {', '.join(REFERENCE_DTYPES)}")
    key = _digest([model_identity(folder), _digest(token_ids), dtype])
    return (cache_dir or cache_root() / "references") / f"{folder.name}-{key}.pt"


def cached_reference(
    folder: Path,
    token_ids: Sequence[int],
    compute: Callable[[], tuple[torch.Tensor, torch.Tensor | None]],
    *,
    dtype: str = "float32",
    cache_dir: Path | None = None,
) -> Reference:
    """The reference from the cache, else `compute()`d and kept there: its logits [positions, vocab] and those of
    its run with noise (for the floor), or None where the engine cannot inject noise."""
    path = reference_path(folder, token_ids, dtype, cache_dir)
    if path.is_file():
        return load_reference(path)
    check_sequence(token_ids)
    logits, noisy = compute()
    noise_kl = None if noisy is None else kl_per_position(logits, noisy)
    reference = Reference(
        str(folder),
        model_identity(folder),
        tokenizer_identity(folder),
        tuple(token_ids),
        dtype,
        logits.to(REFERENCE_DTYPES[dtype]),
        noise_kl,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    torch.save({**reference.__dict__}, partial)
    partial.replace(path)  # a run cut off mid-write leaves no reference that loads
    return reference


def load_reference(path: Path) -> Reference:
    """A reference kept by `cached_reference`, from its file, checked whole: a file that is not one fails here in a
    line, not later as an IndexError, a KL of nan or Python's words about keyword arguments."""
    if not path.is_file():
        raise FileNotFoundError(f"no reference at {path}: give a file that exlnb.divergence kept, or a model folder")
    try:
        with warnings.catch_warnings():  # torch warns, over lines, of a pickle protocol it did not write
            warnings.simplefilter("ignore")
            kept = torch.load(path, weights_only=True)
    # whatever the unpickler met (UnpicklingError, EOFError, KeyError, ...), said without torch's own words,
    # which advise weights_only=False: that would run any code a malicious file holds
    except Exception as error:
        raise _no_reference(path, f"it does not load as tensors and plain values ({type(error).__name__})") from None
    if problem := _reference_problem(kept):
        raise _no_reference(path, problem)
    return Reference(**{**kept, "token_ids": tuple(kept["token_ids"])})


def _no_reference(path: Path, problem: str) -> ValueError:
    return ValueError(f"{path} cannot serve as a reference: {problem}; give a file that exlnb.divergence kept")


def _reference_problem(kept: object) -> str | None:
    """What makes a loaded file no reference, in words (None when it is one): its fields, their shapes, token ids
    of its vocabulary, finite values."""
    names = [f.name for f in fields(Reference)]
    if not isinstance(kept, dict):
        return f"it holds a {type(kept).__name__}, not a reference's fields ({', '.join(names)})"
    if missing := [name for name in names if name not in kept]:
        return f"it lacks {', '.join(missing)}"
    if extra := sorted(str(name) for name in kept if name not in names):
        return f"it has fields no reference has: {', '.join(extra)}"
    logits, ids, noise = kept["logits"], kept["token_ids"], kept["noise_kl"]
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        return "its logits are not a [positions, vocabulary] tensor of floats"
    if not isinstance(ids, (tuple, list)) or not all(is_number(i, int) for i in ids):
        return "its token_ids are not a list of integers"
    positions, vocab = logits.shape
    if len(ids) != positions:
        return f"it has {len(ids)} token ids but logits for {positions} positions"
    if outside := [i for i in ids if not 0 <= i < vocab]:
        return f"its token ids {outside[:5]} are outside its vocabulary (0..{vocab - 1})"
    if bad := int((~torch.isfinite(logits)).any(dim=-1).sum()):
        return f"its logits hold NaN or infinite values at {bad} of {positions} positions"
    if noise is not None and not (
        isinstance(noise, torch.Tensor) and noise.shape == (positions,) and bool(torch.isfinite(noise).all())
    ):
        return "its noise_kl is not one finite number per position, nor None"
    if not all(isinstance(kept[name], str) for name in ("model", "model_id", "tokenizer_id", "dtype")):
        return "its model, model_id, tokenizer_id and dtype are not all strings"
    if kept["dtype"] not in REFERENCE_DTYPES:
        return f"its dtype {kept['dtype']!r} is not one of {', '.join(REFERENCE_DTYPES)}"
    return None
