"""One generation request, typed and checked once where the user enters, then passed down unchanged.

`%%exl_generate` and the Python calls (`generate_live`, `exlnb.generation.start`) build a
`GenerationRequest` from the user's options; everything below reads its fields. A misspelt option fails
here, naming the valid ones, instead of three layers down.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from exlnb.engines.base import DEFAULT_MAX_NEW_TOKENS, SEED_MAX, SamplerSettings
from exlnb.engines.options import TOKEN_COLOURS
from exlnb.engines.token_info import MAX_TOP_TOKENS
from exlnb.engines.checks import check_field_types, check_option_names, check_text
from exlnb.engines.constraint import OutputConstraint
from exlnb.templates import TEMPLATES

# what each request field means, for the magics' help and the docs
REQUEST_HELP = {
    "system": "system prompt",
    "template": "prompt format; auto: the model's own chat template",
    "chat": "keep this conversation's turns in the session and answer after them",
    "amnesia": "forget the chat's earlier turns before this one (field report 4)",
    "n": "samples run concurrently (batched by the engine), shown side by side",
    "max_new_tokens": "most tokens to generate per sample",
    "stop": 'stop string or special token, repeatable ("\\n" for a newline)',
    "min_new_tokens": "no end of sequence before this many tokens",
    "banned_strings": "text that must never appear (case-insensitive), repeatable; the engine backtracks",
    "seed": "sample i uses seed + i",
    "loop_guard": "end a sample caught in a repetition loop (ExLlamaV3: its own loop detector)",
    "tokens": "show the answer as tokens coloured by probability, with N alternatives on hover (0: off)",
    "show_whitespace": "in the token view, draw spaces, tabs and newlines as marks (· → ↵)",
    "token_colour": "shade the token view by probability, or by latency (time since the previous token)",
    "json_schema": "the answer is JSON valid under this schema: a notebook variable holding a dict or a pydantic "
                   "model, or a .json file; result.parsed is the value",
    "regex": "the answer matches this regular expression in full (quote it: 'PATTERN'); result.parsed is the match",
}


@dataclass(frozen=True)
class GenerationRequest:
    """A prompt as the user's turn, how to render it, how many samples, and how to sample them."""

    prompt: str
    system: str | None = None
    template: str = "auto"
    chat: str | None = None
    amnesia: bool = False
    n: int = 1
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    sampler: SamplerSettings = field(default_factory=SamplerSettings)
    stop: tuple[str | int, ...] = ()
    seed: int | None = None
    loop_guard: bool = False
    min_new_tokens: int = 0
    banned_strings: tuple[str, ...] = ()
    tokens: int = 0  # JobSpec.top_tokens: per-token probabilities and alternatives, none computed at 0
    show_whitespace: bool = False  # the token view's marks; nothing an engine sees
    token_colour: str = "probability"  # or "latency": what the token view's shades say
    json_schema: dict | str | Path | type | None = None  # a schema, the path of a .json file, or a pydantic model
    regex: str | None = None  # a pattern the whole answer must match (not with json_schema)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "banned_strings", tuple(self.banned_strings))
        check_field_types(self)
        check_text("the prompt", self.prompt)
        if self.system is not None:
            check_text("the system prompt", self.system)
        if self.template not in TEMPLATES:
            raise ValueError(f"template={self.template!r}: choose one of {', '.join(TEMPLATES)}")
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if not 0 <= self.tokens <= MAX_TOP_TOKENS:
            raise ValueError(f"tokens={self.tokens} must be between 0 (off) and {MAX_TOP_TOKENS} alternatives per token")
        if self.show_whitespace and not self.tokens:
            raise ValueError("show_whitespace marks whitespace in the token view: ask for the view too (tokens=5)")
        if self.token_colour not in TOKEN_COLOURS:
            raise ValueError(f"token_colour={self.token_colour!r}: choose one of {', '.join(TOKEN_COLOURS)}")
        if self.chat is not None and self.n > 1:
            raise ValueError(f"a chat records one answer per turn: use n=1 with chat={self.chat!r} (got n={self.n})")
        if self.amnesia and self.chat is None:
            raise ValueError("amnesia forgets a chat's history: name the chat too (chat=...)")
        if any(s == "" for s in self.stop):
            raise ValueError("stop has an empty string, which would stop before the first token: remove it")
        if self.seed is not None and not 0 <= self.seed <= SEED_MAX - (self.n - 1):
            raise ValueError(f"seed={self.seed} is out of range: use 0 to {SEED_MAX - (self.n - 1)} (sample i uses seed + i)")
        OutputConstraint.given(self.json_schema, self.regex)  # a bad schema or pattern fails here, before any job

    @classmethod
    def option_names(cls) -> list[str]:
        """Every keyword `build` takes: the request's fields and every name of a sampler setting."""
        return [*(f.name for f in fields(cls) if f.name != "prompt"), *SamplerSettings.option_names()]

    @classmethod
    def build(cls, prompt: str, **options) -> GenerationRequest:
        """A request from keyword options as a user writes them.

        Request fields by name, sampler settings by their exllamav2 name or short option name
        (`temperature=0.7`, `rep_penalty=1.1`), or a whole `sampler=SamplerSettings(...)` to start from.
        """
        known = {f.name for f in fields(cls)} - {"prompt"}
        check_option_names(options, valid=cls.option_names())
        request_options = {k: v for k, v in options.items() if k in known}
        sampler_options = {k: v for k, v in options.items() if k not in known}
        sampler = request_options.pop("sampler", None) or SamplerSettings()
        return cls(prompt=prompt, sampler=sampler.with_options(**sampler_options), **request_options)

    def with_options(self, **options) -> GenerationRequest:
        """This request with some options changed (the same names `build` takes)."""
        return GenerationRequest.build(**{**self.as_options(), **options})

    def as_options(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
