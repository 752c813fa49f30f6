"""Prompt formats and the template linter (field report 4), with the bundled model's own tokenizer."""

from __future__ import annotations

import re

import pytest

from exlnb.engines.tokenizer import HfTokenizer
from exlnb.models import BUNDLED_MODEL, resolve_model
from exlnb.templates import (
    CHATML_VARIANTS,
    LLAMA3,
    LintKind,
    Message,
    conversation,
    lint,
    lint_rendered,
    render,
    summarise,
)

BRIEF = conversation("Hi", system="Be brief.")
WITH_HISTORY = conversation(
    "Name a colour.", system="Be brief.", history=[{"role": "user", "content": "Hi"}, Message("assistant", "Hello!")]
)


@pytest.fixture(scope="module")
def tokenizer() -> HfTokenizer:
    return HfTokenizer(resolve_model(BUNDLED_MODEL, progress=False))


def kinds_at(findings) -> list[tuple[str, int]]:
    return [(f.kind.value, f.position) for f in findings]


# -- rendering -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "template, expected",
    [
        (
            "chatml",
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n"
            "<|im_start|>assistant\n",
        ),
        (
            "llama3",
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nName a colour.<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        ("mistral", "<s>[INST] Be brief.\n\nHi [/INST]Hello!</s>[INST] Name a colour. [/INST]"),
        ("raw", "Be brief.\n\nHi\n\nHello!\n\nName a colour."),
    ],
)
def test_each_format_renders_a_conversation_exactly(template, expected):
    assert render(template, WITH_HISTORY) == expected


def test_without_a_generation_prompt_the_text_ends_after_the_last_turn():
    assert render("chatml", BRIEF, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_auto_renders_with_the_models_own_template(tokenizer):
    assert render("auto", BRIEF, tokenizer) == render("chatml", BRIEF)  # SmolLM2's template is ChatML


def test_auto_without_a_tokenizer_says_to_pass_one():
    with pytest.raises(ValueError, match="pass the tokenizer"):
        render("auto", BRIEF)


def test_an_unknown_template_or_role_names_the_valid_ones():
    with pytest.raises(ValueError, match="use one of auto, chatml, llama3, mistral, raw"):
        render("chatm", BRIEF)
    with pytest.raises(ValueError, match="not one of system, user, assistant"):
        Message("bot", "Hi")


# -- each ChatML variant's mistake ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [
        ("chatml", "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
        ("no_im_end", "<|im_start|>system\nBe brief.\n<|im_start|>user\nHi\n<|im_start|>assistant\n"),
        ("tags_removed", "system\nBe brief.\nuser\nHi\nassistant\n"),
        (
            "misplaced_newlines",
            "<|im_start|>\nsystem Be brief.<|im_end|><|im_start|>\nuser Hi<|im_end|><|im_start|>\nassistant",
        ),
        (
            "special_as_text",
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        ),
        ("no_template", "Be brief.\n\nHi"),
    ],
)
def test_each_chatml_variant_makes_its_one_mistake(name, expected):
    assert CHATML_VARIANTS[name].render(BRIEF) == expected


def test_special_tokens_as_text_become_several_ordinary_tokens(tokenizer):
    variant = CHATML_VARIANTS["special_as_text"]
    correct = CHATML_VARIANTS["chatml"].encode(BRIEF, tokenizer)
    as_text = variant.encode(BRIEF, tokenizer)

    assert tokenizer.token_to_id("<|im_start|>") in correct
    assert tokenizer.token_to_id("<|im_start|>") not in as_text
    assert len(as_text) > len(correct)


@pytest.mark.parametrize("name", CHATML_VARIANTS)
def test_the_linter_finds_exactly_the_mistake_each_variant_makes(name, tokenizer):
    variant = CHATML_VARIANTS[name]
    findings = lint(variant.render(BRIEF), tokenizer, special=variant.special)

    assert {f.kind.value for f in findings} == ({variant.lint_kind} if variant.lint_kind else set())


# -- where the linter puts each mistake ----------------------------------------------------------------------


def test_a_correct_prompt_has_no_findings_in_text_or_tokens(tokenizer):
    text = render("chatml", WITH_HISTORY)

    assert lint(text) == []
    assert lint(text, tokenizer) == []
    assert lint(tokenizer.encode(text), tokenizer) == []
    assert lint(render("llama3", WITH_HISTORY), template="llama3") == []


def test_turns_left_open_are_found_where_the_next_turn_opens():
    text = CHATML_VARIANTS["no_im_end"].render(BRIEF)
    findings = lint(text)

    assert kinds_at(findings) == [("unbalanced_tag", 29), ("unbalanced_tag", 49)]
    assert text[29:41] == text[49:61] == "<|im_start|>"
    assert (findings[0].line, findings[0].column) == (3, 1)
    assert "system turn opened at character 0" in findings[0].message


def test_a_closing_tag_without_an_open_turn_is_found():
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_end|>\n<|im_start|>assistant\n"

    assert ("unbalanced_tag", 30) in kinds_at(lint(text))
    assert text[30:40] == "<|im_end|>"


def test_role_names_without_tags_are_a_missing_tag_at_the_start():
    assert kinds_at(lint(CHATML_VARIANTS["tags_removed"].render(BRIEF))) == [("missing_tag", 0)]
    assert kinds_at(lint(render("raw", BRIEF))) == [("missing_tag", 0)]


def test_text_before_the_first_turn_is_outside_any_turn():
    findings = lint("Hello <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")

    assert kinds_at(findings) == [("missing_tag", 0)]
    assert "text outside any turn" in findings[0].message


def test_misplaced_newlines_are_found_after_the_tag_after_the_role_and_between_turns():
    text = "<|im_start|>\nuser Hi<|im_end|><|im_start|>assistant\n"

    assert kinds_at(lint(text)) == [("misplaced_newline", 12), ("misplaced_newline", 17), ("misplaced_newline", 30)]


def test_a_newline_before_the_closing_tag_and_an_extra_one_after_the_role_are_found():
    text = "<|im_start|>user\n\nHi\n<|im_end|>\n<|im_start|>assistant\n"
    findings = lint(text)

    assert kinds_at(findings) == [("misplaced_newline", 17), ("misplaced_newline", 20)]
    assert text[20] == "\n" and text[21:31] == "<|im_end|>"
    assert (findings[1].line, findings[1].column) == (3, 3)


def test_a_prompt_without_the_assistant_header_is_missing_its_generation_prompt():
    text = render("chatml", BRIEF, add_generation_prompt=False)

    assert kinds_at(lint(text)) == [("missing_tag", len(text))]
    assert lint(text, expect_generation_prompt=False) == []


def test_llama3_without_begin_of_text_is_a_missing_tag():
    text = render("llama3", BRIEF).removeprefix("<|begin_of_text|>")

    assert kinds_at(lint(text, template="llama3")) == [("missing_tag", 0)]


def test_every_tag_encoded_as_text_is_found_at_its_position_and_token(tokenizer):
    text = render("chatml", BRIEF)
    findings = lint(text, tokenizer, special=False)
    tags = sorted(m.start() for m in re.finditer(r"<\|im_start\|>|<\|im_end\|>", text))

    assert kinds_at(findings) == [("special_as_text", position) for position in tags]
    assert findings[0].token_index == 0
    assert findings[1].token_index > 1  # "<|im_start|>" took several tokens


def test_linting_token_ids_needs_their_tokenizer_and_a_known_format():
    with pytest.raises(ValueError, match="pass tokenizer="):
        lint([1, 2, 3])
    with pytest.raises(ValueError, match="not 'mistral'"):
        lint("[INST] Hi [/INST]", template="mistral")


# -- lint_rendered: what %%exl_generate shows ----------------------------------------------------------------


def test_auto_is_linted_as_the_turn_format_of_the_models_own_template(tokenizer):
    broken = CHATML_VARIANTS["no_im_end"].encode(BRIEF, tokenizer)

    assert lint_rendered(tokenizer.encode(render("auto", BRIEF, tokenizer)), "auto", tokenizer) == []
    assert {f.kind for f in lint_rendered(broken, "auto", tokenizer)} == {LintKind.UNBALANCED_TAG}


@pytest.mark.parametrize("template", ["mistral", "raw"])
def test_formats_without_turn_tags_have_nothing_to_lint(template, tokenizer):
    ids = tokenizer.encode(render(template, BRIEF))

    assert lint(tokenizer.decode(ids)) != []  # as ChatML it would be wrong
    assert lint_rendered(ids, template, tokenizer) == []


def test_another_templates_tags_are_summarised_as_one_finding_naming_the_models_template(tokenizer):
    ids = tokenizer.encode(render("llama3", BRIEF), special=True)
    findings = lint_rendered(ids, "llama3", tokenizer)
    foreign = [f for f in findings if f.kind is LintKind.SPECIAL_AS_TEXT]

    [first, *rest] = summarise(findings, "llama3", tokenizer)
    assert {f.tag for f in foreign} == set(LLAMA3.tags) and len(foreign) > len(
        LLAMA3.tags
    )  # each, as often as it stands
    assert first == (
        f"{len(foreign)} llama3 tags are plain text here (<|begin_of_text|>, <|start_header_id|>, "
        "<|end_header_id|>, <|eot_id|>): this model's template is chatml (--template chatml, or auto)"
    )
    assert rest == [str(f) for f in findings if f not in foreign]
    special_as_text = lint(render("chatml", BRIEF), tokenizer, special=False)  # its own tags, encoded as text
    assert summarise(special_as_text, "chatml", tokenizer) == [str(f) for f in special_as_text]
