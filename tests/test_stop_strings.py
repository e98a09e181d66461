"""Stop strings are matched on the text, across token boundaries, and held back text is never retracted."""

import random

from hypothesis import given, strategies as st

from jaxserve.engine.stop_strings import StopStringMatcher


def _stream(pieces, stops, include=False):
    matcher = StopStringMatcher(tuple(stops), include)
    out = []
    for piece in pieces:
        text, matched = matcher.feed(piece)
        out.append(text)
        if matched is not None:
            return "".join(out), matched
    out.append(matcher.flush())
    return "".join(out), None


def test_stop_split_across_pieces_is_caught_and_excluded():
    assert _stream(["Hello wo", "rld! E", "ND here"], ["END"]) == ("Hello world! ", "END")


def test_include_stop_str_in_output_keeps_it():
    assert _stream(["ab", "cSTO", "Pxyz"], ["STOP"], include=True) == ("abcSTOP", "STOP")


def test_earliest_of_several_stops_wins():
    assert _stream(["one two three"], ["three", "two"]) == ("one ", "two")


def test_partial_match_is_released_when_it_turns_out_not_to_be_a_stop():
    matcher = StopStringMatcher(("STOP",))
    assert matcher.feed("aST") == ("a", None)
    assert matcher.feed("X") == ("STX", None)


@given(
    text=st.text(alphabet="abcXY", max_size=40),
    stop=st.text(alphabet="abcXY", min_size=1, max_size=4),
    seed=st.integers(0, 1000),
)
def test_streamed_result_equals_matching_on_the_whole_text(text, stop, seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    index = text.find(stop)
    expected = (text, None) if index < 0 else (text[:index], stop)
    assert _stream(pieces, [stop]) == expected
