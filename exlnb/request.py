"""One generation request, typed and checked once where the user enters, then passed down unchanged.

`%%exl_generate` and the Python calls (`generate_live`, `exlnb.generation.start`) build a
`GenerationRequest` from the user's options; everything below reads its fields. A misspelt option fails
here, naming the valid ones, instead of three layers down.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from exlnb.engines.base import JobSpec, Tokenizer
from exlnb.engines.checks import SEED_MAX, check_field_types, check_seed, check_text
from exlnb.engines.constraint import OutputConstraint
from exlnb.engines.declaration import option, same_option, takes_options
from exlnb.engines.job_options import JobOptions
from exlnb.engines.options import TOKEN_COLOURS
from exlnb.engines.sampling import SamplerSettings, build_sampled, sampled_option_names
from exlnb.engines.token_info import MAX_TOP_TOKENS
from exlnb.templates import TEMPLATES


@dataclass(frozen=True)
class GenerationRequest:
    """A prompt as the user's turn, how to render it, how many samples, and how to sample them.

    Every field but `prompt` and `sampler` is declared with `option()` (those a job's options share, by
    `JobOptions`), so it is a keyword of `exlnb.generate` and a flag of `%%exl_generate` with the same help;
    `sampler`'s fields are options too.
    """

    prompt: str
    system: str | None = option(None, group="prompt", metavar="TEXT", help="system prompt")
    template: str = option(
        "auto", group="prompt", choices=tuple(TEMPLATES), help="prompt format; auto: the model's own chat template"
    )
    chat: str | None = option(
        None, group="prompt", metavar="NAME", help="keep this conversation's turns in the session and answer after them"
    )
    amnesia: bool = option(
        False,
        group="prompt",
        help="forget the chat's earlier turns before this one, so each answer costs what the first did",
    )
    n: int = option(1, group="samples", help="samples run concurrently (batched by the engine), shown side by side")
    max_new_tokens: int = same_option(JobOptions, "max_new_tokens")
    min_new_tokens: int = same_option(JobOptions, "min_new_tokens")
    stop: tuple[str | int, ...] = same_option(JobOptions, "stop")
    seed: int | None = option(None, group="samples", help="sample i uses seed + i")
    loop_guard: bool = option(
        False, group="samples", help="end a sample caught in a repetition loop (ExLlamaV3: its own loop detector)"
    )
    sampler: SamplerSettings = field(default_factory=SamplerSettings)  # its fields are options of their own
    json_schema: dict | str | Path | type | None = same_option(JobOptions, "json_schema")
    regex: str | None = same_option(JobOptions, "regex")
    banned_strings: tuple[str, ...] = same_option(JobOptions, "banned_strings")
    tokens: int = option(
        0,
        group="display",  # JobSpec.top_tokens: none computed at 0
        help="show the answer as tokens coloured by the model's probability, each with the N likeliest "
        "alternatives in a popover (0: off)",
    )
    show_whitespace: bool = option(
        False, group="display", help="in the token view, draw spaces, tabs and newlines as marks (· → ↵)"
    )
    token_colour: str = option(
        "probability",
        group="display",
        choices=TOKEN_COLOURS,
        help="shade the token view by probability, by latency (time since the previous token), or by margin (the "
        "top logit over the runner-up's: where greedy runs may part; needs --tokens 2)",
    )
    # what every sample's job asks, checked once (a bad schema or pattern fails here, before any job)
    job: JobOptions = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        job = JobOptions(
            max_new_tokens=self.max_new_tokens,
            min_new_tokens=self.min_new_tokens,
            stop=self.stop,
            banned_strings=self.banned_strings,
            json_schema=self.json_schema,
            regex=self.regex,
            sampler=self.sampler,
        )
        object.__setattr__(self, "job", job)
        object.__setattr__(self, "stop", job.stop)
        object.__setattr__(self, "banned_strings", job.banned_strings)
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
        if not 0 <= self.tokens <= MAX_TOP_TOKENS:
            raise ValueError(
                f"tokens={self.tokens} must be between 0 (off) and {MAX_TOP_TOKENS} alternatives per token"
            )
        if self.show_whitespace and not self.tokens:
            raise ValueError("show_whitespace marks whitespace in the token view: ask for the view too (tokens=5)")
        if self.token_colour not in TOKEN_COLOURS:
            raise ValueError(f"token_colour={self.token_colour!r}: choose one of {', '.join(TOKEN_COLOURS)}")
        if self.token_colour == "margin" and self.tokens < 2:
            raise ValueError(
                "token_colour='margin' shades by the top logit over the runner-up's: ask for two alternatives or more "
                "(tokens=2, --tokens 2)"
            )
        if self.chat is not None and self.n > 1:
            raise ValueError(f"a chat records one answer per turn: use n=1 with chat={self.chat!r} (got n={self.n})")
        if self.amnesia and self.chat is None:
            raise ValueError("amnesia forgets a chat's history: name the chat too (chat=...)")
        check_seed(self.seed, SEED_MAX - (self.n - 1), " (sample i uses seed + i)")

    @property
    def constraint(self) -> OutputConstraint | None:
        return self.job.constraint

    def job_specs(
        self, prompt_ids: Sequence[int], tokenizer: Tokenizer, *, stop_on_loop: tuple[int, int] | None = None
    ) -> list[JobSpec]:
        """The request's `n` jobs over one rendered prompt, sample i seeded `seed + i`: what the engine gets,
        read from this request's fields, already checked."""
        spec = replace(self.job.make_spec(prompt_ids, tokenizer), top_tokens=self.tokens, stop_on_loop=stop_on_loop)
        return [
            replace(
                spec,
                seed=None if self.seed is None else self.seed + i,
                identifier=f"sample {i}" if self.n > 1 else None,
            )
            for i in range(self.n)
        ]

    @classmethod
    def option_names(cls) -> list[str]:
        """Every keyword `build` takes: the request's fields and every name of a sampler setting."""
        return sampled_option_names(cls)

    @classmethod
    def build(cls, prompt: str, **options) -> GenerationRequest:
        """A request from keyword options as a user writes them.

        Request fields by name, sampler settings by their exllamav2 name or short option name
        (`temperature=0.7`, `rep_penalty=1.1`), or a whole `sampler=SamplerSettings(...)` to start from.
        """
        return build_sampled(cls, options, prompt=prompt)

    def with_options(self, **options) -> GenerationRequest:
        """This request with some options changed (the same names `build` takes)."""
        return GenerationRequest.build(**{**self.as_options(), **options})

    def as_options(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}


# `func(request, ..., **options)` with a signature that names every option with its type and default, read from the
# declarations, so `help()` and a notebook's `func?` and tab completion show them
takes_request_options = takes_options(
    GenerationRequest,
    SamplerSettings,
    leading=[inspect.Parameter("sampler", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=SamplerSettings)],
)
