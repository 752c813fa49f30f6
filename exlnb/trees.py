"""A notebook's sample tree: a user's turn rendered through its template, sampled N times into one tree.

`grow` is the plain Python behind `%%exl_tree`: the prompt is rendered (and linted) as `%%exl_generate` renders it,
then the session grows the tree (`Session.grow_tree`). `TreeOptions` declares what a tree adds to a generation
request: how many samples, how many alternatives each node records, how much probability an expansion covers,
and the reference it is compared with (`exlnb.tree_reference`).
"""

from __future__ import annotations

from dataclasses import dataclass

from exlnb.engines.checks import check_field_types
from exlnb.engines.declaration import declared, option
from exlnb.engines.sampling import SamplerSettings
from exlnb.engines.token_info import MAX_TOP_TOKENS
from exlnb.generation import as_request
from exlnb.prepared_prompt import prepare_prompt
from exlnb.request import GenerationRequest
from exlnb.session import Session, TreeGrowth, get_session
from exlnb.session.exploring import MAX_TREE_SAMPLES, TREE_ALTERNATIVES

# what a tree takes of a generation request: its prompt, how it is rendered, how long and how it samples
REQUEST_OPTIONS = ("system", "template", "max_new_tokens", "min_new_tokens", "stop", "seed")


@dataclass(frozen=True)
class TreeOptions:
    """What `%%exl_tree` adds to a request's prompt and sampler."""

    n: int = option(16, group="tree", help=f"samples drawn and merged into the tree (1 to {MAX_TREE_SAMPLES})")
    tokens: int = option(
        TREE_ALTERNATIVES,
        group="tree",
        help="the model's likeliest next tokens each node records: its probabilities, the mass no sample took and "
        "the margins need them (0: counts only)",
    )
    mass: float = option(
        0.9, group="tree", help="the share of the model's probability an expansion covers after a node"
    )
    reference: str | None = option(
        None,
        group="tree",
        metavar="MODEL_OR_FILE",
        help="a model folder (or the bundled name) or a kept .pt file: each node shows its probability and the "
        "KL from it (docs/tree.md)",
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        if not 0 <= self.tokens <= MAX_TOP_TOKENS:
            raise ValueError(f"tokens={self.tokens}: a node records 0 to {MAX_TOP_TOKENS} alternatives")
        if not 0 < self.mass <= 1:
            raise ValueError(
                f"mass={self.mass}: give the share of the model's probability to cover, above 0 and at most 1 "
                "(0.9 covers 90%)"
            )


TREE_OPTIONS = tuple(o.keyword for o in declared(TreeOptions))


def check_request_options(options: dict) -> None:
    """Refuse a generation option a tree does not take (a chat, a constraint, n samples side by side ...)."""
    refused = sorted(set(options) - {*REQUEST_OPTIONS, *SamplerSettings.option_names(), "sampler"})
    if refused:
        raise ValueError(
            f"a tree does not take {', '.join(refused)}: give the prompt's options ({', '.join(REQUEST_OPTIONS)}), "
            f"sampler settings, and the tree's own ({', '.join(TREE_OPTIONS)})"
        )


def grow(
    request: GenerationRequest | str,
    *,
    n: int = TreeOptions.n,
    tokens: int = TreeOptions.tokens,
    session: Session | None = None,
    **options,
) -> TreeGrowth:
    """Render the request's prompt as a user turn and grow its tree: `n` samples merged as they stream, each node
    recording `tokens` alternatives; `options` are the prompt's (REQUEST_OPTIONS) and the sampler's, as
    `%%exl_generate` takes them."""
    check_request_options(options)
    request, session = as_request(request, options), session or get_session()
    prompt = prepare_prompt(request, session)
    return session.grow_tree(
        prompt.ids,
        n,
        top_tokens=tokens,
        max_new_tokens=request.max_new_tokens,
        min_new_tokens=request.min_new_tokens,
        stop=request.stop,
        seed=request.seed,
        sampler=request.sampler,
    )
