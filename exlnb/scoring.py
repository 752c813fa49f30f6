"""A loaded model scored against a reference: the session's side of `exlnb.divergence`.

`score` asks the engine for the logits of every position of a token sequence (`Engine.score`, on the engine
thread); `reference` keeps a reference model's logits on disk, loading that model in a session of its own only
when the cache does not hold them; `divergence` compares the loaded model with a reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from exlnb.datasets import filler_ids
from exlnb.divergence import (
    BF16_ROUNDING_EPS,
    Divergence,
    Reference,
    another_tokenizer,
    cached_reference,
    check_sequence,
    check_sequence_length,
    compare,
    load_reference,
    reference_path,
    tokenizer_identity,
)
from exlnb.engines.options import DEFAULT_CACHE_TOKENS
from exlnb.engines.registry import engine_spec, engines_that
from exlnb.models import resolve_model
from exlnb.session import Session

DEFAULT_TOKENS = 512


def score(session: Session, token_ids: Sequence[int], *, noise_eps: float = 0.0) -> torch.Tensor:
    """The loaded model's logits at every position of `token_ids`: float32 [positions, vocab] on the CPU; with
    `noise_eps`, from a pass with that much noise after every layer (`Engine.score`)."""
    engine = session.options.engine if session.options else None
    if engine and not engine_spec(engine).can("scoring"):
        raise ValueError(
            f"the {engine} engine returns no logits to score: load the model with "
            f"{' or '.join(engines_that('scoring'))}"
        )

    def run(e) -> torch.Tensor:
        check_sequence(token_ids, e.max_seq_len)
        return e.score(token_ids, noise_eps=noise_eps)

    return session.run_on_engine(run)


def text_ids(session: Session, tokens: int = DEFAULT_TOKENS) -> list[int]:
    """A fixed sequence of `tokens` tokens of ordinary text from data/, the same on every call; refused before
    the text is made when the loaded model's cache cannot hold that many."""
    check_sequence_length(tokens, session.engine.max_seq_len)
    return filler_ids(session.tokenizer, tokens, label="divergence")


def reference(
    model: str | Path,
    token_ids: Sequence[int],
    *,
    engine: str = "auto",
    dtype: str = "float32",
    cache_dir: Path | None = None,
    cache_tokens: int | None = None,
) -> Reference:
    """`model`'s logits over `token_ids`, from the cache, else computed in a session of its own and kept, with
    its noise floor where the engine can inject noise (`Engine.scores_with_noise`: the cpu engine)."""
    folder = resolve_model(str(model))

    def compute() -> tuple[torch.Tensor, torch.Tensor | None]:
        session = Session()
        session.load(str(folder), engine=engine, cache_tokens=cache_tokens, progress=False)
        try:
            noisy = session.run_on_engine(lambda e: e.scores_with_noise)
            return score(session, token_ids), score(session, token_ids, noise_eps=BF16_ROUNDING_EPS) if noisy else None
        finally:
            session.unload()

    return cached_reference(folder, token_ids, compute, dtype=dtype, cache_dir=cache_dir)


def divergence(session: Session, against: Reference, *, noise_floor: bool = True) -> Divergence:
    """The loaded model against `against`, over the reference's own token ids."""
    vocab_size = session.tokenizer.vocab_size  # NoModelLoaded, in a line, when nothing is loaded
    against.check_tokenizer(tokenizer_identity(session.options.model_dir), vocab_size)
    logits = score(session, against.token_ids)
    return compare(
        against.logits.float(), logits, against.token_ids, noise_kl=against.noise_kl if noise_floor else None
    )


def divergence_from(
    session: Session,
    against: str | Path,
    *,
    tokens: int = DEFAULT_TOKENS,
    engine: str = "auto",
    dtype: str = "float32",
    noise_floor: bool = True,
    progress: bool = False,
) -> Divergence:
    """The loaded model against a reference model folder (over `text_ids(session, tokens)`, its logits cached) or
    a reference file kept by `exlnb.divergence` (over its own tokens): what `%exl_divergence` prints, the file
    the reference is kept in among it. With `progress`, a line as each step starts: computing a reference loads
    its model in a session of its own and scores it twice (the bundled model over 512 tokens: 8.5 s)."""

    def say(words: str) -> None:
        if progress:
            print(words, flush=True)

    path = Path(str(against)).expanduser()
    if path.suffix == ".pt":
        kept = load_reference(path)
    else:
        ids, folder, loaded = text_ids(session, tokens), resolve_model(str(against)), session.options.model_dir
        if tokenizer_identity(folder) != tokenizer_identity(loaded):  # before its model is loaded and scored
            raise another_tokenizer(folder.name, loaded.name)
        path = reference_path(folder, ids, dtype)
        if not path.is_file():
            say(
                f"the reference's logits: scoring {against} over {len(ids)} tokens in a session of its own, and again "
                "with noise for the floor where its engine can ..."
            )
        # a reference longer than a default cache is scored in one as large as the loaded model's, which holds it
        cache = session.options.cache_tokens if len(ids) > DEFAULT_CACHE_TOKENS else None
        kept = reference(against, ids, engine=engine, dtype=dtype, cache_tokens=cache)
    say(f"the loaded model: scoring it over {len(kept.token_ids)} tokens ...")
    return replace(divergence(session, kept, noise_floor=noise_floor), reference_file=str(path))
