"""Incremental detokenisation, stop strings and banned strings."""

from __future__ import annotations

from exlnb.engines.text import BannedStrings, IncrementalDecoder, Rewind, StopStringFilter


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


def test_banned_strings_hold_a_possible_start_and_rewind_to_it_on_a_match():
    guard = BannedStrings(["World"])
    assert guard.feed(1, "Hello", 10, (0, 0, 0)) == ("Hello", [1])
    assert guard.feed(2, " wor", 11, (1, 0, 1)) == ("", [])  # could begin "world": held
    rewind = guard.feed(3, "ld", 12, (2, 1, 2))
    assert rewind == Rewind(length=11, decoder_state=(1, 0, 1))
    assert guard.blocked(11) == [2] and guard.blocked(12) == []


def test_banned_strings_release_held_text_that_turns_out_harmless():
    guard = BannedStrings(["world"])
    guard.feed(1, " wor", 5, (0, 0, 0))
    assert guard.feed(2, "ds", 6, (1, 0, 1)) == (" words", [1, 2])
