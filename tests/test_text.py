"""Stop strings across token boundaries and UTF-8 hold-back."""

from engine.text.stream import TextStream, partial_stop_suffix


def feed_all(ts: TextStream, pieces: list[bytes]) -> str:
    out = []
    for p in pieces:
        out.append(ts.feed(p))
        if ts.stopped_by:
            return "".join(out)
    return "".join(out) + ts.flush()


def test_stop_string_spanning_tokens_is_not_emitted():
    ts = TextStream(("STOP",))
    emitted = [ts.feed(b"hello S"), ts.feed(b"TO"), ts.feed(b"P and more")]
    assert emitted == ["hello ", "", ""]
    assert ts.stopped_by == "STOP"


def test_partial_stop_is_released_when_it_does_not_complete():
    ts = TextStream(("STOP",))
    assert ts.feed(b"a ST") == "a "
    assert ts.feed(b"ill") == "STill"
    assert ts.stopped_by is None


def test_earliest_of_several_stops_wins():
    ts = TextStream(("world", "lo"))
    assert ts.feed(b"hello world") == "hel"
    assert ts.stopped_by == "lo"


def test_utf8_split_over_tokens_is_held_back():
    snow = "\u2603".encode()  # 3 bytes
    ts = TextStream()
    assert ts.feed(snow[:1]) == ""
    assert ts.feed(snow[1:2]) == ""
    assert ts.feed(snow[2:] + b"!") == "\u2603!"


def test_invalid_utf8_is_replaced_not_raised():
    ts = TextStream()
    text = ts.feed(b"\xff\xfeok")
    assert text.endswith("ok") and "\ufffd" in text


def test_incomplete_tail_is_flushed_as_replacement():
    ts = TextStream()
    assert ts.feed("é".encode()[:1]) == ""
    assert ts.flush() == "\ufffd"


def test_stop_after_multibyte():
    ts = TextStream(("\u2603",))
    snow = "\u2603".encode()
    assert feed_all(ts, [b"a", snow[:2], snow[2:]]) == "a"
    assert ts.stopped_by == "\u2603"


def test_partial_stop_suffix():
    assert partial_stop_suffix("abcST", ("STOP",)) == 2
    assert partial_stop_suffix("abc", ("STOP",)) == 0
    assert partial_stop_suffix("xS", ("STOP", "SX")) == 1
