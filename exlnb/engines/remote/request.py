"""A `JobSpec` as an OpenAI-style request body in the server's dialect; what the server cannot take is refused by name.

OpenAI's API has temperature, top_p, the frequency and presence penalties, seed, stop and max_tokens. Servers
accept more under their own names: vLLM and SGLang `top_k`, `min_p`, `repetition_penalty`; TabbyAPI (ExLlama's
server) exllamav2's own names, DRY and XTC included; llama-cpp-python `repeat_penalty` and `typical_p`;
`transformers serve` a `generation_config` object instead. A setting is sent under the name the server's dialect
gives it; a setting changed from its default that the dialect has no name for is refused, never dropped. Defaults
the dialect cannot carry leave the server's own default in force, and `defaults_not_sent` says which at load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from exlnb.engines.base import JobSpec, SamplerSettings
from exlnb.engines.options import SERVER_DIALECTS

# SamplerSettings field -> the request field each dialect sends it as
_OPENAI = {
    "temperature": "temperature",
    "top_p": "top_p",
    "token_frequency_penalty": "frequency_penalty",
    "token_presence_penalty": "presence_penalty",
}
_VLLM = {**_OPENAI, "top_k": "top_k", "min_p": "min_p", "token_repetition_penalty": "repetition_penalty"}
_TABBY = {
    **_VLLM,
    "top_a": "top_a",
    "tfs": "tfs",
    "typical": "typical",
    "smoothing_factor": "smoothing_factor",
    "skew": "skew",
    "temperature_last": "temperature_last",
    "dry_multiplier": "dry_multiplier",
    "dry_base": "dry_base",
    "dry_allowed_length": "dry_allowed_length",
    "dry_range": "dry_range",
    "xtc_probability": "xtc_probability",
    "xtc_threshold": "xtc_threshold",
    "min_temp": "min_temp",
    "max_temp": "max_temp",
    "temp_exponent": "temp_exponent",
    "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta",
}
_LLAMA_CPP = {
    **_OPENAI,
    "top_k": "top_k",
    "min_p": "min_p",
    "typical": "typical_p",
    "token_repetition_penalty": "repeat_penalty",
    "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta",
}
# transformers serve takes a GenerationConfig as JSON; it reads frequency_penalty as a repetition penalty, so
# exlnb sends the penalty by its GenerationConfig name instead
# exllamav2 turns these off with 0; servers (llama.cpp, transformers, TabbyAPI's schema) with 1.0, and
# transformers refuses typical_p=0 outright ("has to be a float > 0 and < 1")
_OFF_ON_THE_WIRE = {"typical": 1.0, "tfs": 1.0}
_TRANSFORMERS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "typical": "typical_p",
    "token_repetition_penalty": "repetition_penalty",
}


@dataclass(frozen=True)
class Dialect:
    """What one kind of server takes beyond OpenAI's fields."""

    name: str
    sampler: dict[str, str]
    min_tokens: str | None  # the field for JobSpec.min_new_tokens
    ignore_eos: str | None  # the field for stop_at_eos=False (a load test's exact output lengths)
    logprobs: bool  # the server returns logprobs and top_logprobs when asked
    banned_strings: bool = False
    generation_config: bool = False  # sampler settings go inside transformers' `generation_config` JSON
    # owned_by in /v1/models, which identifies the server at load
    owners: tuple[str, ...] = ()


DIALECTS = {
    d.name: d
    for d in (
        Dialect("vllm", _VLLM, "min_tokens", "ignore_eos", True, owners=("vllm",)),
        Dialect("sglang", _VLLM, "min_tokens", "ignore_eos", True, owners=("sglang",)),
        Dialect("tabbyapi", _TABBY, "min_tokens", "ban_eos_token", True, banned_strings=True, owners=("tabbyapi",)),
        Dialect("llama.cpp", _LLAMA_CPP, "min_tokens", None, True, owners=("me", "llamacpp")),
        Dialect(
            "transformers", _TRANSFORMERS, "min_new_tokens", None, False, generation_config=True, owners=("local",)
        ),
        Dialect("openai", _OPENAI, None, None, True),
    )
}


assert set(DIALECTS) == set(SERVER_DIALECTS), "a server dialect without its fields"


def dialect_for(owner: object, listing: dict, named: str | None = None) -> Dialect:
    """The dialect the user `named`, else the server's from its /v1/models answer: `owned_by` names vLLM, SGLang,
    TabbyAPI and llama.cpp; `transformers serve` marks each model with a load `status`. Anything else gets OpenAI's
    own fields only."""
    if named is not None:
        return DIALECTS[named]
    owner = owner.lower() if isinstance(owner, str) else ""
    for dialect in DIALECTS.values():
        if owner in dialect.owners:
            return dialect
    entries = listing.get("data") or [{}]
    if isinstance(entries[0], dict) and "status" in entries[0]:
        return DIALECTS["transformers"]
    return DIALECTS["openai"]


def refused(spec: JobSpec, dialect: Dialect, eos_ids: frozenset[int]) -> list[str]:
    """What `spec` asks that this server cannot be told, as "name=value (why)"."""
    where = f"{'an' if dialect.name[0] in 'aeiou' else 'a'} {dialect.name} server"
    missing = [
        f"{name}={value!r} (no field for it on {where})" for name, value in unmapped_settings(spec.sampler, dialect)
    ]
    if spec.min_new_tokens and dialect.min_tokens is None:
        missing.append(f"min_new_tokens={spec.min_new_tokens} (no field for it on {where})")
    if spec.banned_strings and not dialect.banned_strings:
        missing.append(f"banned_strings={list(spec.banned_strings)!r} (only TabbyAPI takes them)")
    if spec.top_tokens and not dialect.logprobs:
        missing.append(
            f"tokens={spec.top_tokens} (a {dialect.name} server returns no logprobs, so there is no token "
            "view: use a server that does, such as llama.cpp or vLLM)"
        )
    if spec.stop_on_loop is not None:
        missing.append(f"stop_on_loop={spec.stop_on_loop!r} (a server has no loop detector; --loop-guard uses exlnb's)")
    if spec.constraint is not None:
        missing.append(f"{spec.constraint.describe()} (the openai engine sends no constraints)")
    extra_ids = sorted(spec.stop_token_ids - eos_ids)
    if extra_ids:
        missing.append(f"stop token ids {extra_ids} (a server stops on strings; give the stop as text)")
    if not spec.stop_token_ids & eos_ids and dialect.ignore_eos is None and dialect.min_tokens is None:
        missing.append(f"stop_at_eos=False ({where} always stops at the end of sequence)")
    return missing


# each setting at the value that does nothing: what a server with no field for it does anyway
_NEUTRAL = SamplerSettings(top_k=0, top_p=1.0, token_repetition_penalty=1.0)


def unmapped_settings(settings: SamplerSettings, dialect: Dialect) -> list[tuple[str, object]]:
    """Settings changed from their defaults that the dialect has no field for, and that ask something (a value that
    does nothing needs no field: greedy's repetition penalty of 1.0 on a plain OpenAI server)."""
    default = SamplerSettings()
    return [
        (f.name, getattr(settings, f.name))
        for f in fields(settings)
        if f.name not in dialect.sampler
        and not _sent_otherwise(f.name, settings, dialect)
        and getattr(settings, f.name) not in (getattr(default, f.name), getattr(_NEUTRAL, f.name))
    ]


def _sent_otherwise(name: str, settings: SamplerSettings, dialect: Dialect) -> bool:
    """TabbyAPI's mirostat is a mode number, sent with its tau and eta; greedy's top_k=1 goes as temperature 0."""
    return (name == "mirostat" and "mirostat_tau" in dialect.sampler) or (name == "top_k" and settings.is_greedy)


def defaults_not_sent(dialect: Dialect) -> list[str]:
    """exllamav2's defaults this dialect cannot carry (where the server's own defaults stand instead)."""
    default = SamplerSettings()
    return [
        f"{f.name}={getattr(default, f.name)!r}"
        for f in fields(default)
        if f.name not in dialect.sampler and getattr(default, f.name) != getattr(_NEUTRAL, f.name)
    ]


def request_body(spec: JobSpec, dialect: Dialect, model: str, prompt: dict, eos_ids: frozenset[int]) -> dict:
    """The streaming request for `spec`: `prompt` is {"prompt": text} or {"messages": [...]}."""
    sampler = {
        dialect.sampler[f.name]: _on_the_wire(f.name, getattr(spec.sampler, f.name))
        for f in fields(spec.sampler)
        if f.name in dialect.sampler
    }
    if spec.sampler.mirostat and "mirostat_tau" in dialect.sampler:
        sampler["mirostat_mode"] = 2
    if spec.sampler.is_greedy:  # every server reads temperature 0 as greedy; top_k=1 alone is not understood so
        sampler[dialect.sampler["temperature"]] = 0.0
    exact_length = not spec.stop_token_ids & eos_ids
    minimum = spec.max_new_tokens if exact_length and dialect.ignore_eos is None else spec.min_new_tokens
    body: dict = {"model": model, **prompt, "max_tokens": spec.max_new_tokens, "stream": True}
    if dialect.generation_config:
        config = {**sampler, "do_sample": not spec.sampler.is_greedy}
        if minimum:
            config[dialect.min_tokens] = minimum
        body["generation_config"] = json.dumps(config | {"max_new_tokens": spec.max_new_tokens})
    else:
        body |= sampler
        body["stream_options"] = {"include_usage": True}
        if minimum and dialect.min_tokens:
            body[dialect.min_tokens] = minimum
    if exact_length and dialect.ignore_eos:
        body[dialect.ignore_eos] = True
    if spec.seed is not None:
        body["seed"] = spec.seed
    if spec.stop_strings:
        body["stop"] = list(spec.stop_strings)
    if spec.banned_strings:
        body["banned_strings"] = list(spec.banned_strings)
    if spec.top_tokens and dialect.logprobs:
        body |= (
            {"logprobs": True, "top_logprobs": spec.top_tokens}
            if "messages" in prompt
            else {"logprobs": spec.top_tokens}
        )
    return body


def _on_the_wire(name: str, value: object) -> object:
    return _OFF_ON_THE_WIRE.get(name, value) if value == 0 else value
