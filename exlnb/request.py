"""One generation request, typed and checked once where the user enters, then passed down unchanged.

`%%exl_generate` and the Python calls (`generate_live`, `exlnb.generation.start`) build a
`GenerationRequest` from the user's options; everything below reads its fields. A misspelt option fails
here, naming the valid ones, instead of three layers down.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from exlnb.engines.base import DEFAULT_MAX_NEW_TOKENS, SEED_MAX, JobSpec, SamplerSettings, Tokenizer
from exlnb.engines.options import TOKEN_COLOURS
from exlnb.engines.token_info import MAX_TOP_TOKENS
from exlnb.engines.checks import check_field_types, check_option_names, check_text, one_or_many
from exlnb.engines.constraint import OutputConstraint
from exlnb.engines.declaration import declared, option
from exlnb.templates import TEMPLATES

@dataclass(frozen=True)
class GenerationRequest:
    """A prompt as the user's turn, how to render it, how many samples, and how to sample them.

    Every field but `prompt` and `sampler` is declared with `option()`, so it is a keyword of
    `exlnb.generate` and a flag of `%%exl_generate` with the same help; `sampler`'s fields are options too.
    """

    prompt: str
    system: str | None = option(None, group="prompt", metavar="TEXT", help="system prompt")
    template: str = option("auto", group="prompt", choices=tuple(TEMPLATES),
                           help="prompt format; auto: the model's own chat template")
    chat: str | None = option(None, group="prompt", metavar="NAME",
                              help="keep this conversation's turns in the session and answer after them")
    amnesia: bool = option(False, group="prompt", help="forget the chat's earlier turns before this one, so each "
                                                       "answer costs what the first did")
    n: int = option(1, group="samples", help="samples run concurrently (batched by the engine), shown side by side")
    max_new_tokens: int = option(DEFAULT_MAX_NEW_TOKENS, group="samples", help="most tokens to generate per sample")
    min_new_tokens: int = option(0, group="samples", help="no end of sequence before this many tokens")
    stop: tuple[str | int, ...] = option((), group="samples", repeatable=True, metavar="TEXT",
                                         help='stop string or special token, repeatable ("\\n" for a newline)')
    seed: int | None = option(None, group="samples", help="sample i uses seed + i")
    loop_guard: bool = option(False, group="samples",
                              help="end a sample caught in a repetition loop (ExLlamaV3: its own loop detector)")
    sampler: SamplerSettings = field(default_factory=SamplerSettings)  # its fields are options of their own
    json_schema: dict | str | Path | type | None = option(
        None, group="constraints", metavar="NAME_OR_FILE",
        help="the answer is JSON valid under this schema: a notebook variable holding a dict or a pydantic model, "
             "or a .json file; result.parsed is the value",
    )
    regex: str | None = option(None, group="constraints", metavar="PATTERN",
                               help="the answer matches this regular expression in full (quote it: 'PATTERN'); "
                                    "result.parsed is the match")
    banned_strings: tuple[str, ...] = option(
        (), group="constraints", flag="--ban", repeatable=True, metavar="TEXT",
        help="text that must never appear (case-insensitive), repeatable; the engine backtracks",
    )
    tokens: int = option(0, group="display",  # JobSpec.top_tokens: none computed at 0
                         help="show the answer as tokens coloured by the model's probability, each with the N likeliest "
                         "alternatives in a popover (0: off)")
    show_whitespace: bool = option(False, group="display",
                                   help="in the token view, draw spaces, tabs and newlines as marks (· → ↵)")
    token_colour: str = option("probability", group="display", choices=TOKEN_COLOURS,
                               help="shade the token view by probability, or by latency (time since the previous token)")
    constraint: OutputConstraint | None = field(init=False, repr=False, compare=False)  # read from the two above

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", one_or_many(self.stop))
        object.__setattr__(self, "banned_strings", one_or_many(self.banned_strings))
        check_field_types(self)
        check_text("the prompt", self.prompt)
        if not self.prompt.strip():
            raise ValueError("the prompt is empty: write the question (the user's turn) to answer")
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
        # a bad schema or pattern fails here, before any job; the jobs carry this one
        object.__setattr__(self, "constraint", OutputConstraint.given(self.json_schema, self.regex))

    def job_specs(self, prompt_ids: Sequence[int], tokenizer: Tokenizer, *,
                  stop_on_loop: tuple[int, int] | None = None) -> list[JobSpec]:
        """The request's `n` jobs over one rendered prompt, sample i seeded `seed + i`: what the engine gets,
        read from this request's fields, already checked."""
        stopping = JobSpec.stopping(self.stop, tokenizer)
        return [
            JobSpec(
                input_ids=tuple(prompt_ids), max_new_tokens=self.max_new_tokens, sampler=self.sampler, **stopping,
                seed=None if self.seed is None else self.seed + i, identifier=f"sample {i}" if self.n > 1 else None,
                min_new_tokens=self.min_new_tokens, banned_strings=self.banned_strings, stop_on_loop=stop_on_loop,
                top_tokens=self.tokens, constraint=self.constraint,
            )
            for i in range(self.n)
        ]

    @classmethod
    def option_names(cls) -> list[str]:
        """Every keyword `build` takes: the request's fields and every name of a sampler setting."""
        return [*(o.keyword for o in declared(cls)), "sampler", *SamplerSettings.option_names()]

    @classmethod
    def build(cls, prompt: str, **options) -> GenerationRequest:
        """A request from keyword options as a user writes them.

        Request fields by name, sampler settings by their exllamav2 name or short option name
        (`temperature=0.7`, `rep_penalty=1.1`), or a whole `sampler=SamplerSettings(...)` to start from.
        """
        known = {o.keyword for o in declared(cls)} | {"sampler"}
        check_option_names(options, valid=cls.option_names())
        request_options = {k: v for k, v in options.items() if k in known}
        sampler_options = {k: v for k, v in options.items() if k not in known}
        sampler = request_options.pop("sampler", None) or SamplerSettings()
        return cls(prompt=prompt, sampler=sampler.with_options(**sampler_options), **request_options)

    def with_options(self, **options) -> GenerationRequest:
        """This request with some options changed (the same names `build` takes)."""
        return GenerationRequest.build(**{**self.as_options(), **options})

    def as_options(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}


def takes_request_options(func):
    """Give `func(request, ..., **options)` a signature that names every option with its type and default, read
    from the declarations, so `help()` and a notebook's `func?` and tab completion show them."""
    signature = inspect.signature(func)
    kept = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    options = [inspect.Parameter("sampler", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=SamplerSettings)]
    options += [inspect.Parameter(o.keyword, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=o.hint)
                for o in (*declared(GenerationRequest), *declared(SamplerSettings))]
    func.__signature__ = signature.replace(parameters=[*kept, *options])
    return func
