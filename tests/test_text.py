"""Incremental detokenisation and stop strings."""

from __future__ import annotations

from exlnb.engines.text import IncrementalDecoder, StopStringFilter


def test_incremental_text_equals_whole_decode(cpu_session):
    tokenizer = cpu_session.tokenizer
    text = "Grüße aus Köln! 日本語のテキスト, emoji 🚀 and  double  spaces.\nNew line."
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.push(t) for t in tokenizer.encode(text)]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_split_across_chunks_is_caught_and_held_back():
    f = StopStringFilter(["STOP"])
    assert f.feed("hello ST") == ("hello ", False)
    assert f.feed("O") == ("", False)
    assert f.feed("P and more") == ("", True)


def test_false_alarm_prefix_is_released():
    f = StopStringFilter(["STOP"])
    assert f.feed("ST") == ("", False)
    assert f.feed("ar") == ("STar", False)
    assert f.flush() == ""


def test_earliest_of_several_stop_strings_wins():
    f = StopStringFilter(["world", "lo"])
    assert f.feed("hello world") == ("hel", True)
