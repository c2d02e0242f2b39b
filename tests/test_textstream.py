from octo.textstream import TextStream


def feed(stream, pieces):
    out, stopped = [], False
    for p in pieces:
        text, stopped = stream.push(p.encode() if isinstance(p, str) else p)
        out.append(text)
        if stopped:
            break
    return "".join(out), stopped


def test_stop_string_across_token_boundaries():
    s = TextStream(["END"])
    text, stopped = feed(s, ["hello E", "N", "D more"])
    assert (text, stopped) == ("hello ", True)
    assert s.matched == "END"


def test_held_back_text_released_when_not_a_stop():
    s = TextStream(["ENDX"])
    text, stopped = feed(s, ["a EN", "D", "!"])
    assert not stopped and text == "a END!"


def test_earliest_stop_wins():
    s = TextStream(["bb", "a"])
    text, stopped = feed(s, ["xxbba"])
    assert (text, stopped, s.matched) == ("xx", True, "bb")


def test_utf8_split_across_tokens():
    data = "é€😀".encode()
    s = TextStream()
    pieces = [data[i:i + 1] for i in range(len(data))]
    text, _ = feed(s, pieces)
    assert text + s.flush() == "é€😀"


def test_flush_returns_held_text():
    s = TextStream(["STOP"])
    text, stopped = feed(s, ["abc ST"])
    assert text == "abc " and not stopped
    assert s.flush() == "ST"
