"""The models a speed investigation can time: the one the notebook's session loaded (the bundled model) and
a Llama-2-7B-shaped model with random weights (`exlnb.random_model`), the field reports' model size, loaded in
a session of its own for the length of the timings. Random weights make meaningless text but real timings.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from exlnb.engines.options import PAGE_TOKENS
from exlnb.random_model import SEVEN_B_SHAPED, cannot_make_here, seven_b_shaped
from exlnb.session import Session

BUNDLED = "bundled"  # the model the notebook's session loaded
TIMED_MODELS = (BUNDLED, SEVEN_B_SHAPED)


def check_model_names(models: Sequence[str]) -> None:
    unknown = [m for m in models if m not in TIMED_MODELS]
    if unknown:
        raise ValueError(f"no model {', '.join(map(repr, unknown))} to time: choose from {', '.join(TIMED_MODELS)}")


def effect_prefix(model: str) -> str:
    """What goes in front of an effect's name: nothing for the session's model (so that its effects keep the
    names earlier runs gave them), the model's name for any other."""
    return "" if model == BUNDLED else f"{model} model, "


def finding_subject(model: str) -> str:
    """What goes in front of a finding about a model other than the session's."""
    return "" if model == BUNDLED else f"{model} model (random weights: its text is meaningless, its timings real): "


def cannot_time(model: str) -> str | None:
    """Why `model` cannot be timed on this machine, in a line; None where it can (the session's own always can)."""
    return None if model == BUNDLED else cannot_make_here()


@contextmanager
def session_for(model: str, session: Session, tokens: int) -> Iterator[Session]:
    """The session that times `model`: the notebook's own for the bundled model; for the 7B-shaped one, a session
    of its own on the same engine, its cache holding `tokens`, unloaded and removed afterwards."""
    if model == BUNDLED:
        yield session
        return
    with seven_b_session(session.status().engine, tokens) as seven_b:
        yield seven_b


@contextmanager
def seven_b_session(engine: str, tokens: int) -> Iterator[Session]:
    """The 7B-shaped model, written for this run, loaded on `engine` in a session of its own whose cache holds
    `tokens` (rounded up to whole pages); unloaded and removed afterwards."""
    with seven_b_shaped() as (folder, _):
        session = Session()
        session.load(str(folder), engine=engine, cache_tokens=-(-tokens // PAGE_TOKENS) * PAGE_TOKENS, progress=False)
        try:
            yield session
        finally:
            session.unload()
