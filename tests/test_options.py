"""Options declared once: the magic's flags, its grouped help, the Python keywords and docs/options.md all read
the same declarations, and a request reaches the engine whole, checked once where the user entered it."""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from IPython.core.error import UsageError

import exlnb.magics
from exlnb.engines.declaration import GROUPS, declared, option, takes_options
from exlnb.engines.job_options import JobOptions
from exlnb.engines.sampling import SamplerSettings
from exlnb.generation import start
from exlnb.magic_arguments import CELL_OPTIONS, GENERATE_OPTIONS, declared_arguments, given_options
from exlnb.magics import ExlnbMagics
from exlnb.request import GenerationRequest
from exlnb.session import LoadFailed, Session

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is the capital of France?"


def options_page():
    spec = importlib.util.spec_from_file_location("options_page", ROOT / "docs" / "options.py")
    page = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(page)
    return page


def test_the_options_page_is_what_the_declarations_say():
    assert (ROOT / "docs" / "options.md").read_text() == options_page().reference(), "run python docs/options.py"


@dataclass(frozen=True)
class Brew:
    """docs/architecture.md's recipe for an option, followed for a door of its own: one field each."""

    steep_s: int = option(180, group="samples", help="how long the leaves steep")
    milk: bool = option(False, group="samples", help="add milk")
    cup: str = option("mug", group="samples", choices=("mug", "cup"), help="what it is poured into")


def test_an_option_is_one_field_and_the_flag_the_keyword_and_the_docs_row_follow():
    @declared_arguments(declared(Brew), GROUPS)
    def brew(line: str) -> None:
        """Brew a pot."""

    @takes_options(Brew)
    def pour(**options) -> Brew:
        return Brew(**options)

    args = brew.parser.parse_args(["--steep-s", "240", "--milk"])
    assert pour(**given_options(args)) == Brew(steep_s=240, milk=True)
    assert "how long the leaves steep (default: 180)" in " ".join(brew.parser.format_help().split())
    assert inspect.signature(pour).parameters["cup"].default == "mug"
    rows = options_page()._rows(declared(Brew), GROUPS, "flag")
    assert "| `--cup` | `cup` | `mug` | what it is poured into (mug, cup) |" in rows


def test_every_magic_option_is_a_keyword_of_the_python_api():
    python_keywords = set(GenerationRequest.option_names())
    shows = set(inspect.signature(exlnb.magics.generate_live).parameters) | {"out"}
    for o in GENERATE_OPTIONS:
        assert o.keyword in python_keywords or o.keyword in shows, o.flag
    load_keywords = set(inspect.signature(Session.load).parameters)
    for action in ExlnbMagics.exl_load.parser._actions:
        assert action.dest == "help" or action.dest in load_keywords, action.dest


def test_the_python_signature_names_every_option_with_its_default():
    parameters = inspect.signature(start).parameters
    for o in GENERATE_OPTIONS:
        if o.keyword not in CELL_OPTIONS:
            assert parameters[o.keyword].default == o.default, o.keyword
    assert parameters["rep_penalty"].default == SamplerSettings().token_repetition_penalty


def test_help_says_the_cell_magic_opens_with_examples_and_groups_the_options(shell, capsys):
    shell.run_line_magic("exl_generate", "--help")
    shown = capsys.readouterr().out

    assert shown.startswith("%%exl_generate [options]")
    assert shown.index("Examples:") < shown.index("--temperature")
    assert shown.count("\n  %%exl_generate ") == 3
    headings = [shown.index(f"\n{group}:\n") for group in GROUPS]
    assert headings == sorted(headings)
    assert shown.index("\nsampling:\n") < shown.index("--top-k") < shown.index("\npenalties:\n")
    assert shown.index("\nDRY and XTC:\n") < shown.index("--xtc-threshold") < shown.index("\nconstraints:\n")
    assert "field report" not in shown and "stream read" not in shown


def test_a_request_reaches_the_engine_whole(cpu_session, monkeypatch):
    submitted = []
    original = cpu_session.submit_together
    monkeypatch.setattr(
        cpu_session, "submit_together", lambda specs, **kw: submitted.extend(specs) or original(specs, **kw)
    )
    generation = start(QUESTION, n=2, max_new_tokens=3, rep_penalty=1.1, regex="[A-Z][a-z]+")
    generation.wait(60)

    request = generation.request
    assert [spec.sampler for spec in submitted] == [request.sampler] * 2
    assert all(spec.sampler is request.sampler and spec.constraint is request.constraint for spec in submitted)


@pytest.mark.parametrize(
    ("option", "keyword", "value"),
    [
        ("--top-a inf", "top_a", float("inf")),
        ("--temp-exponent inf", "temp_exponent", float("inf")),
        ("--rep-decay 100000000000000000000", "rep_decay", 10**20),
        ("--freq-penalty nan", "freq_penalty", float("nan")),
        ("--presence-penalty nan", "presence_penalty", float("nan")),
    ],
)
def test_values_that_would_fail_in_the_engine_are_refused_at_the_entrance(shell, cpu_session, option, keyword, value):
    with pytest.raises(ValueError, match="is out of range: it must be"):
        start(QUESTION, max_new_tokens=2, **{keyword: value})
    with pytest.raises(UsageError, match="is out of range: it must be"):
        shell.run_cell_magic("exl_generate", f"{option} --max-new-tokens 2", QUESTION)
    assert cpu_session.jobs() == []


def test_one_string_is_one_stop_string_not_its_letters(cpu_session):
    full = start(QUESTION, temperature=0, max_new_tokens=24).wait(60)[0].text
    assert "Paris" in full
    stopped = start(QUESTION, temperature=0, max_new_tokens=24, stop="Paris").wait(60)[0].text
    assert stopped == full[: full.index("Paris")]
    assert cpu_session.spec_for("Hi", JobOptions(stop="Paris")).stop_strings == ("Paris",)


def test_one_string_is_one_banned_string_and_one_dry_breaker(cpu_session):
    request = GenerationRequest.build(QUESTION, banned_strings="abc", dry_sequence_breakers="::")
    assert request.banned_strings == ("abc",)
    assert request.sampler.dry_sequence_breakers == frozenset({"::"})
    assert cpu_session.spec_for("Hi", JobOptions(banned_strings="abc")).banned_strings == ("abc",)


@pytest.mark.parametrize(
    ("keyword", "value"), [("max_batch_size", 1.5), ("cache_tokens", "4096"), ("cache_tokens", 4096.0)]
)
def test_load_refuses_counts_that_are_not_integers(keyword, value):
    with pytest.raises(TypeError, match=f"{keyword}={value!r} has the wrong type: it must be an integer"):
        Session().load(engine="cpu", **{keyword: value})


@pytest.mark.parametrize("body", ["", "   \n\t  \n"])
def test_an_empty_prompt_is_refused(shell, cpu_session, body):
    with pytest.raises(ValueError, match="the prompt is empty"):
        start(body)
    with pytest.raises(UsageError, match="empty"):  # IPython refuses a cell with no body at all itself
        shell.run_cell_magic("exl_generate", "--max-new-tokens 2", body)
    assert cpu_session.jobs() == []


@pytest.mark.parametrize("name", ["1abc", "a-b", "class"])
def test_out_must_name_a_python_variable(shell, cpu_session, monkeypatch, name):
    monkeypatch.setattr(exlnb.magics, "generate_live", lambda *a, **k: pytest.fail("generated before refusing"))
    with pytest.raises(UsageError, match=f"--out {name}: name a Python variable"):
        shell.run_cell_magic("exl_generate", f"--out {name} --max-new-tokens 2", QUESTION)
    assert name not in shell.user_ns


def test_quantizing_a_file_is_one_line(shell, tmp_path):
    a_file = tmp_path / "passwd"
    a_file.write_text("root:x:0:0\n")
    with pytest.raises(UsageError, match="passwd is a file: pass the model's folder"):
        shell.run_line_magic("exl_quantize", str(a_file))


def test_a_prompt_far_too_long_for_the_cache_is_refused_before_tokenizing(shell, cpu_session, monkeypatch):
    tokenizer = cpu_session.tokenizer
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized a prompt that cannot fit"))
    huge = "word " * (cpu_session.engine.max_seq_len * 40)  # far beyond any tokens' length
    with pytest.raises(ValueError, match="characters, more than the cache's .* tokens could hold"):
        start(huge, max_new_tokens=2)
    with pytest.raises(ValueError, match="characters, more than the cache's"):
        cpu_session.spec_for(huge)
    shell.user_ns["huge"] = huge
    with pytest.raises(UsageError, match="characters, more than the cache's"):
        shell.run_cell_magic("exl_generate", "--max-new-tokens 2", "{huge}")
    assert cpu_session.jobs() == []


def test_a_megabyte_of_text_is_refused_by_its_length_at_the_vocabulary_s_longest_token(cpu_session, monkeypatch):
    longest = cpu_session.tokenizer.longest_token()
    assert longest == 81  # SmolLM2's runs of '#' and of spaces: 8192 tokens hold at most 663,552 characters
    monkeypatch.setattr(cpu_session.tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized it first"))
    limit = cpu_session.engine.max_seq_len
    with pytest.raises(ValueError) as raised:
        cpu_session.generate("x" * 1_000_000, max_new_tokens=2)
    assert str(raised.value) == (
        f"the prompt has 1,000,000 characters, more than the cache's {limit} tokens could hold even at {longest} "
        "characters a token (the vocabulary's longest): shorten it, or load with a larger cache_tokens"
    )
    assert cpu_session.jobs() == []


class TenMillionIds(Sequence):
    """A prompt of 10^7 token ids that fails the test when any of them is looked at."""

    def __len__(self) -> int:
        return 10**7

    def __getitem__(self, index):
        pytest.fail("looked at the ids of a prompt that its length alone refuses")


def test_token_ids_too_many_for_the_cache_are_refused_by_their_count_alone(cpu_session):
    limit = cpu_session.engine.max_seq_len
    with pytest.raises(ValueError) as raised:
        cpu_session.generate(TenMillionIds(), max_new_tokens=2)
    assert str(raised.value) == (
        f"the prompt has 10000000 tokens but the cache holds {limit}: shorten the prompt or load with cache_tokens "
        "of at least 10000002"
    )


@pytest.mark.parametrize(
    "prompt", [b"What is the capital of France?", None, 123, [1.5, 2], np.array([1.5, 2.0]), np.array([[1, 2]])]
)
def test_a_prompt_that_is_neither_text_nor_token_ids_is_refused(cpu_session, prompt):
    with pytest.raises(TypeError) as raised:
        cpu_session.generate(prompt, max_new_tokens=2)
    assert str(raised.value) == (
        f"prompt={prompt!r:.60} has the wrong type: it must be a string, or token ids: a list of integers, or a 1-D "
        "array or tensor of them"
    )
    assert cpu_session.jobs() == []


@pytest.mark.parametrize("as_given", [np.array, torch.tensor])
def test_token_ids_as_an_array_or_a_tensor_give_the_answer_of_the_same_list(cpu_session, as_given):
    ids = cpu_session.tokenizer.encode("The capital of France is", special=True)
    answer = cpu_session.complete(as_given(ids), max_new_tokens=6, temperature=0)
    assert answer.token_ids == cpu_session.complete(list(ids), max_new_tokens=6, temperature=0).token_ids


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(stop=[1.5]), "stop=(1.5,) has the wrong type: it must be a list of strings or integers"),
        (dict(stop=[None]), "stop=(None,) has the wrong type: it must be a list of strings or integers"),
        (dict(stop=None), "stop=None has the wrong type: it must be a list of strings or integers"),
        (dict(stop=b"\n"), "stop=b'\\n' has the wrong type: it must be a list of strings or integers"),
        (dict(stop=""), "stop has an empty string, which would stop before the first token: remove it"),
        (dict(stop=[-1]), "token ids [-1] are outside the vocabulary (0..49151)"),
        (dict(stop=[10**9]), "token ids [1000000000] are outside the vocabulary (0..49151)"),
        (
            dict(sampler="greedy"),
            "sampler='greedy' has the wrong type: it must be a SamplerSettings, e.g. SamplerSettings.greedy(), or "
            "give settings by name (temperature=0)",
        ),
        (dict(token_bias="x"), "token_bias='x' must map token ids to numbers, e.g. {198: -2.5}"),
        (dict(stop_on_loop=(1,)), "stop_on_loop=(1,) has the wrong type: it must be a tuple of 2 integers or None"),
    ],
)
def test_a_job_option_of_the_wrong_kind_is_refused_saying_what_it_must_be(cpu_session, options, message):
    with pytest.raises((TypeError, ValueError)) as raised:
        cpu_session.generate(QUESTION, max_new_tokens=2, **options)
    assert str(raised.value) == message
    assert cpu_session.jobs() == []


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(stop=""), "stop has an empty string, which would stop before the first token: remove it"),
        (dict(stop=None), "stop=None has the wrong type: it must be a list of strings or integers"),
        (dict(stop=[10**9]), "token ids [1000000000] are outside the vocabulary (0..49151)"),
        (dict(sampler="greedy"), "sampler='greedy' has the wrong type: it must be a SamplerSettings"),
    ],
)
def test_a_request_refuses_what_a_job_refuses_in_the_same_words(cpu_session, options, message):
    with pytest.raises((TypeError, ValueError)) as raised:
        start(QUESTION, max_new_tokens=2, **options)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)
    assert cpu_session.jobs() == []


ENDLESS = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
ENDS = {"type": "object", "properties": {"value": {"type": "integer"}, "next": {"$ref": "#"}}, "required": ["value"]}


def test_a_schema_whose_references_never_end_is_refused_at_the_entrance(shell, cpu_session):
    with pytest.raises(ValueError, match="json_schema's '#' refers back to itself with nothing to end it"):
        start(QUESTION, json_schema=ENDLESS)
    shell.user_ns["endless"] = ENDLESS
    with pytest.raises(UsageError, match="refers back to itself"):
        shell.run_cell_magic("exl_generate", "--json-schema endless", QUESTION)
    assert cpu_session.jobs() == []

    # recursion that may stop is followed, as llguidance does
    result = start("A number as JSON", json_schema=ENDS, temperature=0, max_new_tokens=40).wait(60)[0]
    assert isinstance(result.parsed["value"], int)


def test_a_failed_rollback_says_that_no_model_is_loaded(monkeypatch):
    session = Session()
    session.load("smollm2-135m-instruct", engine="cpu", progress=False)

    def no_memory(options, progress):
        raise MemoryError("out of memory")

    monkeypatch.setattr("exlnb.session.loading.create_engine", no_memory)
    with pytest.raises(
        LoadFailed,
        match=r"loading smollm2-135m-instruct again failed too \(.*out of memory\): no model "
        r"is loaded now",
    ):
        session.load("smollm2-135m-instruct", engine="cpu", cache_tokens=4096, progress=False)
    assert not session.loaded
