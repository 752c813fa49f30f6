"""What one job asks besides its prompt, declared once and checked where the user gives it.

`Session.generate(prompt, **options)` takes these keywords (its signature is read from here); `GenerationRequest`
takes the ones a notebook's request shares with them, from the same declarations. A `JobOptions` makes the
engine's `JobSpec` for an encoded prompt (`make_spec`), so everything the session submits was checked whole first.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from exlnb.engines.base import DEFAULT_MAX_NEW_TOKENS, JobSpec, Tokenizer
from exlnb.engines.checks import check_field_types, check_job_limits, one_or_many
from exlnb.engines.constraint import OutputConstraint
from exlnb.engines.declaration import option
from exlnb.engines.sampling import SamplerSettings, build_sampled


@dataclass(frozen=True)
class JobOptions:
    """How long one job runs, where it stops, how it samples and what its answer must be."""

    max_new_tokens: int = option(DEFAULT_MAX_NEW_TOKENS, group="samples", help="most tokens to generate per sample")
    min_new_tokens: int = option(0, group="samples", help="no end of sequence before this many tokens")
    stop: tuple[str | int, ...] = option(
        (),
        group="samples",
        repeatable=True,
        metavar="TEXT",
        help='stop string or special token, repeatable ("\\n" for a newline)',
    )
    stop_at_eos: bool = option(True, group="samples", help="the tokenizer's end-of-sequence tokens end the job")
    seed: int | None = option(None, group="samples", help="the job's sampling draws from this seed")
    stop_on_loop: tuple[int, int] | None = option(
        None,
        group="samples",
        help="(window, min_reps): end a job whose last window tokens only repeat a cycle (ExLlamaV3's loop detector)",
    )
    sampler: SamplerSettings = field(default_factory=SamplerSettings)  # its fields are options of their own
    json_schema: dict | str | Path | type | None = option(
        None,
        group="constraints",
        metavar="NAME_OR_FILE",
        help="the answer is JSON valid under this schema: a notebook variable holding a dict or a pydantic model, "
        "or a .json file; result.parsed is the value",
    )
    regex: str | None = option(
        None,
        group="constraints",
        metavar="PATTERN",
        help="the answer matches this regular expression in full (quote it: 'PATTERN'); result.parsed is the match",
    )
    banned_strings: tuple[str, ...] = option(
        (),
        group="constraints",
        flag="--ban",
        repeatable=True,
        metavar="TEXT",
        help="text that must never appear (case-insensitive), repeatable; the engine backtracks",
    )
    top_tokens: int = option(
        0, group="display", help="each new token carries its probability and this many alternatives (0: none computed)"
    )
    identifier: Hashable | None = option(None, group="display", help="the label the job table and cache grid show")
    constraint: OutputConstraint | None = field(init=False, repr=False, compare=False)  # read from the two above

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", one_or_many(self.stop))
        object.__setattr__(self, "banned_strings", one_or_many(self.banned_strings))
        check_field_types(self)
        check_job_limits(self)
        if any(s == "" for s in self.stop):
            raise ValueError("stop has an empty string, which would stop before the first token: remove it")
        # a bad schema or pattern fails here, before any job; every job made from these options carries this one
        object.__setattr__(self, "constraint", OutputConstraint.given(self.json_schema, self.regex))

    @classmethod
    def build(cls, **options) -> JobOptions:
        """Options as a user writes them: these fields by name, a whole `sampler=` to start from, and sampler
        settings by their exllamav2 or short name (`temperature=0.7`, `rep_penalty=1.1`)."""
        return build_sampled(cls, options)

    def make_spec(self, input_ids: Sequence[int], tokenizer: Tokenizer) -> JobSpec:
        """The engine's job for a prompt already encoded with `tokenizer` (which reads the stop strings that are
        special tokens, and the end-of-sequence tokens, as ids)."""
        return JobSpec(
            input_ids=tuple(input_ids),
            max_new_tokens=self.max_new_tokens,
            sampler=self.sampler,
            **JobSpec.stopping(self.stop, tokenizer, at_eos=self.stop_at_eos),
            seed=self.seed,
            identifier=self.identifier,
            min_new_tokens=self.min_new_tokens,
            banned_strings=self.banned_strings,
            stop_on_loop=self.stop_on_loop,
            top_tokens=self.top_tokens,
            constraint=self.constraint,
        )
