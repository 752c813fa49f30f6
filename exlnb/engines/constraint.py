"""What an answer must be: JSON valid under a schema, or text a regular expression matches in full.

Checked where the user gives it, so a bad schema or pattern is one line before any job starts. Every engine
constrains sampling to it through llguidance (grammar.py on the CPU and ExLlamaV2 engines, exllamav3's own
`LLGuidanceFilter`), and a finished answer is read back with `parse` (`GenerationResult.parsed`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from llguidance import LLMatcher, grammar_from

from exlnb.engines.schema_refs import check_references_end

# llguidance's grammar formats, which are also the keywords of exllamav3's LLGuidanceFilter
CONSTRAINT_KINDS = ("json_schema", "regex")
# How a JSON answer is laid out: on one line, separated as Python's json.dumps does. llguidance's default allows
# any whitespace anywhere, and SmolLM2 sampled at temperature 1.5 spent 64 tokens on it before its first value.
# Sent in the schema ("x-guidance"), so exllamav3's own filter lays it out alike; a schema's own x-guidance wins.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class OutputConstraint:
    """A JSON schema (as JSON text) or a regular expression, and the pydantic model a schema came from."""

    kind: str
    source: str
    model: type | None = None  # parse() returns an instance of it

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind {self.kind!r}: choose one of {', '.join(CONSTRAINT_KINDS)}")
        if self.kind == "regex":
            if not self.source:
                raise ValueError("regex is empty: give a pattern the whole answer must match")
            try:
                re.compile(self.source)
            except re.error as error:  # the answer is read back with Python's re.fullmatch
                raise ValueError(
                    f"regex={self.source!r} does not compile ({error}): use syntax that Python's re "
                    "and Rust's regex both read"
                ) from None
        problem = LLMatcher.validate_grammar(self.grammar())
        if problem:
            raise ValueError(f"{self.describe()} cannot constrain an answer: {_llguidance_words(problem)}")

    @classmethod
    def given(cls, json_schema: object = None, regex: str | None = None) -> OutputConstraint | None:
        """The constraint a user's `json_schema=` or `regex=` asks for (at most one of them), or None."""
        if json_schema is not None and regex is not None:
            raise ValueError("json_schema and regex both constrain the answer: give one of them")
        if regex is not None:
            if not isinstance(regex, str):
                raise TypeError(f"regex={regex!r} has the wrong type: it must be a string")
            return cls("regex", regex)
        if json_schema is not None:
            return cls.from_json_schema(json_schema)
        return None

    @classmethod
    def from_json_schema(cls, schema: object) -> OutputConstraint:
        """From a dict, a pydantic model class, JSON text, or the path of a .json file holding the schema."""
        model = schema if isinstance(schema, type) and hasattr(schema, "model_json_schema") else None
        if model is not None:
            schema = model.model_json_schema()
        elif isinstance(schema, str) and schema.lstrip().startswith("{"):
            schema = _json_object(schema, "json_schema")
        elif isinstance(schema, (str, os.PathLike)):
            schema = _schema_file(Path(schema))
        elif not isinstance(schema, dict):
            raise TypeError(
                f"json_schema={schema!r} has the wrong type: give a dict, a pydantic model class, "
                "or a .json file's path"
            )
        check_references_end(schema)
        try:
            text = json.dumps({"x-guidance": JSON_LAYOUT, **schema})  # the schema's own x-guidance wins
        except TypeError as error:
            raise ValueError(
                f"json_schema is not JSON ({error}): give plain dicts, lists, strings and numbers"
            ) from None
        return cls("json_schema", text, model=model)

    def grammar(self) -> str:
        """llguidance's grammar for this constraint (its default JSON options on every engine)."""
        return grammar_from(self.kind, self.source)

    def describe(self) -> str:
        if self.kind == "regex":
            return f"regex {self.source!r}"
        return f"JSON schema ({self.model.__name__})" if self.model else "JSON schema"

    def parse(self, text: str):
        """The answer as a value: a `re.Match` over all of it, the JSON value, or the pydantic model's instance.
        ValueError when the text does not satisfy the constraint (an answer cut short)."""
        if self.kind == "regex":
            match = re.fullmatch(self.source, text)
            if match is None:
                raise ValueError(f"{text[:60]!r} does not match {self.describe()}")
            return match
        if self.model is not None:
            return self.model.model_validate_json(text)  # pydantic's ValidationError is a ValueError
        return json.loads(text)  # JSONDecodeError is a ValueError


def _json_object(text: str, where: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where} is not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where} holds {type(value).__name__} JSON: a JSON schema is an object ({{...}})")
    return value


def _schema_file(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(
            f"json_schema={str(path)!r}: no such file; give a .json file, a dict or a pydantic model"
        )
    return _json_object(path.read_text(), str(path))


def _llguidance_words(message: str) -> str:
    """llguidance's messages span lines (a regex error draws a caret under the pattern); keep the words."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line.removeprefix("error:").strip() for line in lines[1:] if line.startswith("error:")]
    return " ".join(lines[:1] + errors)
