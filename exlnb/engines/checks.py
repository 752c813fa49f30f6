"""Checking values where they enter: types of dataclass fields, option names, text a tokenizer can take, the limits
of what a job asks and a prompt the cache can hold.

A wrong value fails where the user passed it, in one line that names what was expected, instead of inside an
engine step where it would take every running job down.
"""

from __future__ import annotations

import difflib
import math
import numbers
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import fields

from exlnb.engines.token_info import MAX_TOP_TOKENS


def check_field_types(instance) -> None:
    """Refuse a dataclass field whose value has the wrong type, in one line: `max_new_tokens=1.5` must fail
    where the user passed it, not inside an engine step where it would take every running job down."""
    hints = typing.get_type_hints(type(instance))
    for f in fields(instance):
        if not f.init:  # derived from the others, not given
            continue
        value = getattr(instance, f.name)
        if not _has_type(value, hints[f.name]):
            raise TypeError(f"{f.name}={value!r} has the wrong type: it must be {_type_name(hints[f.name])}")


def _has_type(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, arm) for arm in args)
    if hint is type(None):
        return value is None
    if hint in (bool, int, float):
        return is_number(value, hint)
    if hint is str:
        return isinstance(value, str)
    if origin is tuple and Ellipsis not in args:  # a fixed length: (window, min_reps)
        return isinstance(value, tuple) and len(value) == len(args) and all(map(_has_type, value, args))
    if origin in (tuple, frozenset):
        return isinstance(value, origin) and all(_has_type(v, args[0]) for v in value)
    return True  # richer types (settings objects, identifiers) are checked where they are used


# exllamav2's C++ sampler functions take these counts as C ints
INT_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed


def check_finite(instance) -> None:
    """Refuse a float field that is not finite and an int field beyond a C int: `top_a=inf` or
    `rep_decay=10**20` pass every range check and fail only inside an engine step (or, NaN penalties, never
    fail and give garbage)."""
    hints = typing.get_type_hints(type(instance))
    for f in fields(instance):
        value, hint = getattr(instance, f.name), hints[f.name]
        if hint is float and not math.isfinite(value):
            raise ValueError(f"{f.name}={value!r} is out of range: it must be a finite number")
        if hint is int and abs(value) > INT_MAX:
            raise ValueError(f"{f.name}={value!r} is out of range: it must be at most {INT_MAX:,} in size")


def one_or_many(items: object) -> object:
    """A list option's items, where one string (or token id) is one item: `stop="Paris"` is ("Paris",), not
    its five letters. Anything else that is not a collection (None, 1.5, bytes) is left for `check_field_types` to
    refuse: bytes would otherwise be read as token ids."""
    if isinstance(items, (str, int)):
        return (items,)
    if isinstance(items, Iterable) and not isinstance(items, (bytes, bytearray)):
        return tuple(items)
    return items


_NAMES = {int: "an integer", float: "a number", bool: "True or False", str: "a string", type(None): "None"}
_PLURALS = {int: "integers", float: "numbers", bool: "True or False values", str: "strings"}


def _type_name(hint, plural: bool = False) -> str:
    """A type as a refusal says it: "an integer or None", "a list of strings or integers", "a tuple of 2 integers"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arm, plural) for arm in args)
    if origin is tuple and Ellipsis not in args:
        return f"a tuple of {len(args)} {' and '.join(dict.fromkeys(_type_name(a, True) for a in args))}"
    if origin in (tuple, frozenset):
        return f"a {'set' if origin is frozenset else 'list'} of {_type_name(args[0], True)}"
    return (_PLURALS if plural else _NAMES).get(hint, str(hint).replace("typing.", ""))


def check_text(name: str, text: str) -> None:
    """Text a tokenizer can take: a string of real characters (a lone surrogate such as '\\ud800' has no UTF-8)."""
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a string, not {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{name} has {text[error.start]!r} at position {error.start}, a lone surrogate that is not a "
            "character and cannot be tokenised: remove it, or decode the text it came from properly"
        ) from None


def check_option_names(options: Mapping[str, object], *, valid: Iterable[str]) -> None:
    """Refuse an unknown keyword with the closest valid name and the whole list (`TypeError`, as Python does)."""
    valid = sorted(set(valid))
    for name in options:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"unknown option {name!r}{hint}; the options are: {', '.join(valid)}")


def is_number(value: object, kind: type) -> bool:
    """An integer (numpy's too), or for `float` any real number; never a bool, which Python counts as an int."""
    if kind is bool:
        return isinstance(value, bool)
    return isinstance(value, numbers.Integral if kind is int else numbers.Real) and not isinstance(value, bool)


def check_seed(seed: int | None, highest: int = SEED_MAX, why: str = "") -> None:
    """A seed every engine can take (and a load test's numpy generator: no negative seed), or None."""
    if seed is not None and not 0 <= seed <= highest:
        raise ValueError(f"seed={seed} is out of range: use 0 to {highest}{why}")


def check_job_limits(job) -> None:
    """The limits of what one job asks, checked alike where a user gives them (`job` a `JobOptions`) and where a
    job is made (a `JobSpec`), with one message each."""
    if job.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={job.max_new_tokens} must be >= 1")
    check_seed(job.seed)
    if not 0 <= job.min_new_tokens <= job.max_new_tokens:
        raise ValueError(
            f"min_new_tokens={job.min_new_tokens} must be between 0 and max_new_tokens ({job.max_new_tokens})"
        )
    if isinstance(job.banned_strings, str) or not all(job.banned_strings):
        raise ValueError(f"banned_strings={job.banned_strings!r} must be a list of non-empty strings")
    if job.stop_on_loop is not None:
        window, reps = job.stop_on_loop
        # exllamav3's job asserts the same bounds
        if not 1 < reps < window:
            raise ValueError(f"stop_on_loop={job.stop_on_loop!r}: give (window, min_reps) with 1 < min_reps < window")
    if not 0 <= job.top_tokens <= MAX_TOP_TOKENS:
        raise ValueError(f"top_tokens={job.top_tokens} must be between 0 (off) and {MAX_TOP_TOKENS}")


def check_prompt_fits(prompt_tokens: int, max_new_tokens: int, cache_tokens: int) -> None:
    """Refuse a prompt that leaves no room in the cache for one new token: the one message for it, whichever
    layer finds it first (the session, or an engine that lowers a job's answer to the room left)."""
    if prompt_tokens + 1 > cache_tokens:
        raise ValueError(
            f"the prompt has {prompt_tokens} tokens but the cache holds {cache_tokens}: shorten the prompt "
            f"or load with cache_tokens of at least {prompt_tokens + max_new_tokens}"
        )
