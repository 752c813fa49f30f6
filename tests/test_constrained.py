"""Constrained output (`json_schema=`, `regex=`, `--json-schema`, `--regex`) on the real bundled model: every
answer parses under its constraint, whatever the sampler does; bad constraints and settings an engine cannot
combine with one are one-line errors before any job starts."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import jsonschema
import pydantic
import pytest
from IPython.core.error import UsageError

from exlnb import EosReason, SamplerSettings
from exlnb.engines.constraint import OutputConstraint
from exlnb.engines.exllamav2.engine import ExLlamaV2Engine
from exlnb.engines.job_options import JobOptions
from exlnb.generation import start
from exlnb.request import GenerationRequest
from exlnb.templates import chatml
from tests.test_sampling_options import refused_on


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties: false, or the model adds keys
    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=120)


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"enum": ["France", "Germany", "Spain"]}},
    "required": ["city", "country"],
    "additionalProperties": False,
}
SCORES = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4}
REVIEW = {
    "type": "object",
    "properties": {"recommended": {"type": "boolean"}, "stars": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["recommended", "stars"],
    "additionalProperties": False,
}

# (prompt, constraint, samples, sampler settings): 100 samples, each case under other sampler settings
CASES = [
    ("Invent a person. Answer in JSON.", dict(json_schema=Person), 13, dict(temperature=1.0, top_p=0.9)),
    ("Name a European city and its country as JSON.", dict(json_schema=CITY), 13, dict(temperature=0.8)),
    ("Give a few test scores as a JSON list.", dict(json_schema=SCORES), 12, dict(temperature=1.5, min_p=0.1)),
    (
        "Review a film you like as JSON.",
        dict(json_schema="review.json"),
        12,
        dict(temperature=1.5, mirostat=True, mirostat_tau=5.0),
    ),
    (
        "Give me a US phone number.",
        dict(regex=r"[0-9]{3}-[0-9]{3}-[0-9]{4}"),
        13,
        dict(temperature=1.2, rep_penalty=1.3, dry_multiplier=0.8),
    ),
    (
        "Will it rain tomorrow?",
        dict(regex=r"(yes|no|maybe)"),
        12,
        dict(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.1),
    ),
    (
        "Name a famous painter.",
        dict(regex=r"[A-Z][a-z]{2,9}( [A-Z][a-z]{2,9})?"),
        13,
        dict(temperature=1.0, typical=0.9, tfs=0.95, smoothing_factor=0.3),
    ),
    (
        "When is the next leap day?",
        dict(regex=r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
        12,
        dict(min_temp=0.5, max_temp=1.5, skew=0.5, top_k=20),
    ),
]


@pytest.mark.slow  # a hundred constrained samples
def test_a_hundred_constrained_samples_all_parse_under_their_constraint(
    engine_name, idle_session, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "review.json").write_text(json.dumps(REVIEW))
    generations, samples = [], 0
    for i, (prompt, constraint, n, sampler) in enumerate(CASES):

        def begin():
            return start(prompt, **constraint, n=n, seed=10 * i, max_new_tokens=64, **sampler)

        if refused_on(engine_name, SamplerSettings().with_options(**sampler)):  # refused by name, before any job
            with pytest.raises(ValueError, match=f"^the {engine_name} engine has no "):
                begin()
            continue
        generations.append((constraint, begin()))
        samples += n
    parsed = 0
    for constraint, generation in generations:
        results = generation.wait(300)
        for result in results:
            assert result.eos_reason in (EosReason.END_FILTER, EosReason.STOP_TOKEN), (result, generation.errors[:2])
            value = result.parsed
            if "regex" in constraint:
                assert isinstance(value, re.Match) and value.group(0) == result.text
                assert re.fullmatch(constraint["regex"], result.text)
            elif constraint["json_schema"] is Person:
                assert isinstance(value, Person)
            else:
                schema = REVIEW if constraint["json_schema"] == "review.json" else constraint["json_schema"]
                jsonschema.validate(json.loads(result.text), schema)
                assert value == json.loads(result.text)
            parsed += 1
        assert len({r.text for r in results}) > 1  # seeded sampling, not one greedy answer n times
    assert parsed == samples == (100 if engine_name != "exllamav3" else 63)
    assert idle_session.jobs() == [] and idle_session.cache_view().free_pages == idle_session.cache_view().total_pages


def test_a_constraint_that_breaks_fails_its_own_job_and_no_other(engine_name, idle_session, monkeypatch):
    """Both ExLlama libraries run filters inside iterate(), where an exception would fail every job of the batch:
    the filters keep the error and the engine fails that job alone (exllamav2/filter.py, exllamav3/filter.py);
    the CPU engine samples each job on its own."""
    from exlnb.engines.grammar import GrammarMatcher
    from exlnb.streaming import JobError

    def breaking(accept, grammar_of):  # on the first token: an answer may end after its second ("no", stop)
        def accept_or_break(self, token):
            if "maybe" in grammar_of(self):
                raise RuntimeError(f"token {token} broke the test's grammar")
            accept(self, token)

        return accept_or_break

    monkeypatch.setattr(GrammarMatcher, "consume", breaking(GrammarMatcher.consume, lambda m: m.constraint.source))
    if engine_name == "exllamav3":  # its own llguidance filter, not exlnb's matcher
        from exllamav3.generator.filter import LLGuidanceFilter

        monkeypatch.setattr(
            LLGuidanceFilter, "accept_token", breaking(LLGuidanceFilter.accept_token, lambda f: str(f._grammar))
        )
    plain = idle_session.generate(chatml("Count to twenty."), max_new_tokens=40)
    other = idle_session.generate(chatml("Name a colour."), regex="[a-z]+( [a-z]+){0,6}", max_new_tokens=20)
    broken = idle_session.generate(chatml("Will it rain?"), regex="(yes|no|maybe)( [a-z]+){0,6}", max_new_tokens=20)

    with pytest.raises(JobError, match="broke the test's grammar"):
        broken.result()
    assert plain.result().new_tokens > 3 and other.result().eos_reason is not EosReason.FAILED
    assert idle_session.jobs() == [] and idle_session.cache_view().free_pages == idle_session.cache_view().total_pages


def test_a_greedy_answer_stays_inside_the_constraint_and_its_view_shows_the_models_own_choices(cpu_session):
    # every engine reports the model's own distribution, before the constraint's mask, and the sampler's beside it:
    # the alternatives say what the model wanted, the sampled probability what the constraint left it
    result = start("Is Paris in France?", regex="(yes|no)", temperature=0, tokens=5).wait(60)[0]

    assert result.parsed.group(0) in ("yes", "no")
    first = result.tokens().iloc[0]
    assert "yes".startswith(first.text) or "no".startswith(first.text)
    assert first.sampled_probability == 1.0
    assert len(first.alternatives) == 5
    model = [p for _, _, p in first.alternatives]
    assert model == sorted(model, reverse=True) and first.probability <= model[0]


def test_parsed_is_none_without_a_constraint(idle_session):
    assert idle_session.complete(chatml("Hi"), max_new_tokens=2).parsed is None


def test_an_answer_cut_short_says_so_when_parsed(idle_session, greedy):
    result = idle_session.complete(chatml("Hi"), regex=r"[a-z ]{40}\.", max_new_tokens=2, sampler=greedy)

    assert result.eos_reason is EosReason.MAX_NEW_TOKENS
    with pytest.raises(ValueError, match=r"does not satisfy its regex .* \(it ended: max new tokens reached\)"):
        result.parsed


def test_a_cancelled_constrained_sample_frees_its_pages(idle_session):
    generation = start("Write a long line.", regex="[a-z ]{200}", n=3, seed=1, max_new_tokens=220)
    for _sample, event in generation.follow():
        if event.new_tokens >= 3:
            break
    generation.cancel()
    results = generation.wait(60)

    assert {r.eos_reason for r in results} == {EosReason.CANCELLED}
    assert idle_session.jobs() == [] and idle_session.cache_view().free_pages == idle_session.cache_view().total_pages
    with pytest.raises(ValueError, match="ended: cancelled"):
        results[0].parsed


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (dict(json_schema=Person, regex="[0-9]+"), ValueError, "json_schema and regex both constrain the answer"),
        (
            dict(json_schema={"type": "objec"}),
            ValueError,
            "JSON schema cannot constrain an answer: Invalid type: objec",
        ),
        (dict(json_schema={"type": "string", "pattern": "(a"}), ValueError, "unclosed group"),
        (dict(json_schema="no_such_schema.json"), FileNotFoundError, "no such file"),
        (dict(json_schema=42), TypeError, "give a dict, a pydantic model class, or a .json file"),
        (dict(regex="(a"), ValueError, "does not compile"),
        (dict(regex="(?=a)b"), ValueError, "look-around"),
        (dict(regex=""), ValueError, "regex is empty"),
    ],
)
def test_a_bad_constraint_is_one_line_before_any_job_starts(idle_session, options, error, message):
    with pytest.raises(error, match=re.escape(message)) as raised:
        start("Hi", **options)
    assert "\n" not in str(raised.value)
    with pytest.raises(error, match=re.escape(message)):
        idle_session.generate(chatml("Hi"), **options)
    assert idle_session.jobs() == []


def test_a_setting_an_engine_cannot_combine_with_a_constraint_is_refused(cpu_session):
    with pytest.raises(ValueError, match=r"^the cpu engine does not implement banned_strings=\('x',\) with a regex"):
        start("Hi", regex="[a-z]+", banned_strings=["x"])
    assert cpu_session.jobs() == []

    spec = cpu_session.spec_for(chatml("Hi"), JobOptions(regex="[a-z]+", banned_strings=["x"]))
    exllamav2 = object.__new__(ExLlamaV2Engine)  # its checks need no GPU
    with pytest.raises(ValueError, match="the exllamav2 engine does not implement banned_strings.*cannot combine"):
        exllamav2.refuse_unsupported(spec)
    exllamav2.refuse_unsupported(replace(spec, banned_strings=()))
    with pytest.raises(ValueError, match="ends on a stop token"):
        replace(spec, banned_strings=(), stop_token_ids=frozenset())


def test_a_request_keeps_its_constraint_through_with_options():
    request = GenerationRequest.build("Hi", json_schema=Person).with_options(n=2)

    assert request.json_schema is Person and request.n == 2
    assert OutputConstraint.given(request.json_schema, request.regex).model is Person


def test_the_magic_takes_a_schema_variable_a_schema_file_and_a_regex(shell, cpu_session, tmp_path):
    shell.user_ns["Person"] = Person
    shell.run_cell_magic(
        "exl_generate", "--json-schema Person --temperature 0 --max-new-tokens 64 --out r", "Invent a person."
    )
    assert isinstance(shell.user_ns.pop("r").parsed, Person)

    (tmp_path / "scores.json").write_text(json.dumps(SCORES))
    shell.run_cell_magic(
        "exl_generate", f"--json-schema {tmp_path / 'scores.json'} --temperature 0 --out r", "Give some scores."
    )
    jsonschema.validate(shell.user_ns.pop("r").parsed, SCORES)

    # taken literally: IPython's own expansion of magic lines would make {3} a 3
    shell.run_cell_magic("exl_generate", "--regex '[0-9]{3}-[0-9]{4}' --n 2 --seed 3 --out r", "Give a phone number.")
    assert all(re.fullmatch("[0-9]{3}-[0-9]{4}", r.parsed.group(0)) for r in shell.user_ns.pop("r"))


def test_the_magic_says_what_is_wrong_with_a_constraint_in_one_line(shell, cpu_session, capsys):
    shell.user_ns.update(bad_schema={"type": "objec"}, Person=Person)
    for line, message in [
        ("--json-schema nobody", "--json-schema nobody: no variable 'nobody' in the notebook and no such file"),
        ("--json-schema bad_schema", "Invalid type: objec"),
        ("--json-schema Person --regex '[0-9]+'", "json_schema and regex both constrain the answer"),
        ("--regex '(a'", "does not compile"),
    ]:
        with pytest.raises(UsageError, match=re.escape(message)):
            shell.run_cell_magic("exl_generate", line, "Hi")
    assert cpu_session.jobs() == []

    shell.run_line_magic("exl_generate", "--help")
    help_text = capsys.readouterr().out
    assert "--json-schema NAME_OR_FILE" in help_text and "--regex PATTERN" in help_text
